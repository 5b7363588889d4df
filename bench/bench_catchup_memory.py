"""The driver's peak memory catching up, everything on, against a baseline in the same run.

    ./dev bench catchup_memory [--messages 130000] [--body 16384] [--keys 1000000]
                               [--broker apache-kafka|tansu|none] [--rounds 2]
                               [--variant NAME=SECTION.KEY=VALUE[,SECTION.KEY=VALUE] ...]
                               [--baseline-tree DIR]

One commitlog is written (``--messages`` of ``--body`` bytes over ``--keys`` keys, 64 queues), then
each variant runs ``tierlog run --until-caught-up`` on it as a new process, on a fresh tier, state
and checkpoints, rounds alternating the variants' order.  With a broker, the mirror and the
changelog send to it (a topic prefix of the run's own).  Printed per run: the driver's peak
resident memory (sampled every 0.1 s from ``/proc``), the peak of its whole process tree (the JVM
and Python workers too) and the wall clock.

``--baseline-tree`` runs each variant once more from another checkout (``git worktree add DIR
REV``): the code before, measured in the same rounds.  Without ``--variant``, the variants are the
product's defaults (``default``) and compaction at the source's cap (``cap-256mib``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

from bench.bench_catchup import write_config, write_log
from bench.common import descendants, kafka_broker, report

DEFAULT_VARIANTS = {"default": {}, "cap-256mib": {"compaction.max_batch_bytes": str(256 << 20)}}
SAMPLE_S = 0.1


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6
    except (OSError, IndexError, ValueError):
        return 0.0


def run(root: str, log_dir: str, bootstrap: str | None, settings: dict, tree: str | None, tag: str) -> dict:
    """One ``tierlog run --until-caught-up``; its peaks and seconds."""
    work = tempfile.mkdtemp(dir=root, prefix="run-")
    overrides = dict(settings)
    if bootstrap:
        prefix = f"mem{os.getpid()}{tag}"
        overrides.update({"kafka.bootstrap": bootstrap, "kafka.mirror_topic": prefix + "-mirror-{topic}",
                          "kafka.changelog_topic": prefix + "-changelog-{topic}"})
    path = write_config(work, log_dir, overrides)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERLOG_")}
    command = [sys.executable, "-m", "streaming.cli", "run", "--until-caught-up", "--config", path]
    driver = whole = 0.0
    started = time.perf_counter()
    with open(os.path.join(work, "service.log"), "w") as log:
        proc = subprocess.Popen(command, env=env, cwd=tree or os.getcwd(), stdout=subprocess.DEVNULL, stderr=log)
        while proc.poll() is None:
            driver = max(driver, rss_mb(proc.pid))
            whole = max(whole, sum(rss_mb(p) for p in [proc.pid, *descendants(proc.pid)]))
            time.sleep(SAMPLE_S)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        with open(os.path.join(work, "service.log")) as fh:
            raise SystemExit(f"tierlog run failed:\n{fh.read()[-3000:]}")
    shutil.rmtree(work, ignore_errors=True)
    return {"driver_peak_mb": round(driver), "tree_peak_mb": round(whole), "seconds": round(seconds, 1)}


def parse_variants(items: list[str]) -> dict[str, dict]:
    variants = {}
    for item in items:
        name, sep, rest = item.partition("=")
        pairs = [p.partition("=") for p in rest.split(",") if p] if sep else []
        if not sep or any(not s or "." not in k for k, s, _v in pairs):
            raise SystemExit(f"--variant {item!r}: give NAME=SECTION.KEY=VALUE[,SECTION.KEY=VALUE], "
                             "or NAME= for the defaults")
        variants[name] = {k: v for k, _s, v in pairs}
    return variants


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=130_000)
    ap.add_argument("--body", type=int, default=16384, help="body bytes")
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--broker", choices=["apache-kafka", "tansu", "none"], default="apache-kafka")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=SECTION.KEY=VALUE[,...]")
    ap.add_argument("--baseline-tree", help="a checkout of the code before (git worktree add DIR REV), run too")
    args = ap.parse_args()
    variants = parse_variants(args.variant) or DEFAULT_VARIANTS
    trees = {"": None} if not args.baseline_tree else {"": None, "before:": os.path.abspath(args.baseline_tree)}
    runs = [(prefix + name, settings, tree) for prefix, tree in trees.items() for name, settings in variants.items()]
    root = tempfile.mkdtemp(prefix="tierlog-bench-memory-")
    results: dict[str, list] = {name: [] for name, _s, _t in runs}
    try:
        log_dir = os.path.join(root, "commitlog")
        print(f"writing {args.messages:,} messages of {args.body:,} bytes over {args.keys:,} keys ...", file=sys.stderr)
        size = write_log(log_dir, args.messages, {"queues": 64, "keys": args.keys, "body": args.body})
        with kafka_broker(None if args.broker == "none" else args.broker) as (bootstrap, _pid):
            for r in range(args.rounds):
                for i, (name, settings, tree) in enumerate(runs if r % 2 == 0 else runs[::-1]):
                    got = run(root, log_dir, bootstrap, settings, tree, f"r{r}v{i}")
                    print(f"round {r + 1}: {name}: {got}", file=sys.stderr)
                    results[name].append(got)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report({"benchmark": "catchup_memory", "messages": args.messages, "body": args.body, "keys": args.keys,
            "log_mb": round(size / 1e6), "broker": args.broker, "variants": {n: s for n, s, _t in runs},
            "results": results})


if __name__ == "__main__":
    main()

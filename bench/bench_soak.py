"""The soak: the chaos harness for 30 minutes at 2,000 messages/s, a fault every 30-60 s.

    ./dev bench soak [--minutes 30] [--rate 2000] [--tier s3|posix] [--seed 1] [--skip KIND ...] [--workdir DIR]

It runs the whole service (tiering, compaction, both Kafka sinks) against a
producer appending at ``--rate``, under a seeded fault schedule: SIGKILL of
the service and the producer (also mid-append), S3 errors, throttling,
timeouts and a 30 s outage (or a full disk on posix), a 30 s Kafka broker
outage and skewed store clocks.  Then it checks every invariant against a
plain replay of the commitlog and prints one JSON report: messages produced,
tiered, replicated, lost and duplicated, the maximum dispatch-behind, and
the service's memory a minute after each start and at its last sample (the
longest-lived process shows growth best, since faults restart it).  The baseline
is the run itself: ``tiered_ratio`` and ``replicated_ratio`` (of produced)
must be 1; ``rss_last_third_over_first_third`` (per role: private memory of
the driver, the JVM and the Python workers, and mapped files, sampled each
minute) is about 1 when memory does not grow, and
``rss_last_third_over_middle_third`` the same after a warm-up (with
``--skip kill_service``, one process warming up in the first third);
``state_memory_last_third_over_middle_third`` does the same for what each
RocksDB store holds (``tierlog_state_memory_bytes``: kv, metadata, spark).
Exit code 1 when an invariant failed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from tests.chaos.harness import ChaosRun, Plan


def growth(series: list[dict], base: int = 0) -> dict[str, float]:
    """Per role, the median memory of the run's last third over that of its third number ``base``
    (0: the first, 1: the middle): about 1 when memory is flat.  Medians, because a fault restarts
    the service and its memory starts low again.  Over the middle third, a process that lives for
    the whole run is compared after its warm-up (the JVM's heap and RocksDB's caches filling)."""
    third = len(series) // 3
    if third == 0:
        return {}
    def ratio(role: str) -> float | None:  # None: no sample in one of the two thirds
        last, before = ([s[role] for s in samples if role in s]
                        for samples in (series[-third:], series[base * third:(base + 1) * third]))
        return round(statistics.median(last) / max(1e-9, statistics.median(before)), 3) if last and before else None

    return {role: ratio(role) for role in sorted({k for s in series for k in s} - {"t"})}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--minutes", type=float, default=30.0, help="how long faults keep coming (default 30)")
    p.add_argument("--rate", type=int, default=2000, help="messages per second the producer appends")
    p.add_argument("--tier", choices=["s3", "posix"], default="s3")
    p.add_argument("--seed", type=int, default=1, help="fixes the fault schedule and the messages")
    p.add_argument("--gap", type=float, nargs=2, default=(30.0, 60.0), metavar=("MIN", "MAX"),
                   help="seconds between faults (default 30 60)")
    p.add_argument("--outage", type=float, default=30.0, help="seconds the S3 endpoint or broker stays down")
    p.add_argument("--skip", nargs="+", default=[], metavar="KIND",
                   help="fault kinds to leave out: kill_service keeps one service process up for the "
                        "whole run, to watch its memory (kinds: kill_service kill_producer tear_producer "
                        "kafka_down clock_skew s3_errors s3_throttle s3_timeouts s3_down disk_full)")
    p.add_argument("--rocksdb-memory-mb", type=int, metavar="MB",
                   help="the service's state.rocksdb_memory_mb (default: its own, 512): a smaller budget fills "
                        "within minutes, so a plateau shows in a shorter run")
    p.add_argument("--workdir", help="keep the run here (default: a temporary directory, kept on failure)")
    args = p.parse_args(argv)

    plan = Plan(seed=args.seed, tier=args.tier, faults=1, gap_s=tuple(args.gap), outage_s=args.outage,
                rate=args.rate, min_duration_s=args.minutes * 60, file_size=64 << 20, keys=100_000,
                settle_timeout_s=1800, skip=tuple(args.skip),
                rocksdb_memory_mb=args.rocksdb_memory_mb)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tierlog-soak-"))
    run = ChaosRun(plan, workdir, log=lambda line: print(line, file=sys.stderr, flush=True))
    report = run.run()
    out = json.loads(report.as_json())
    out.update(bench="soak", minutes=args.minutes, rate=args.rate, workdir=str(workdir),
               rocksdb_memory_mb=args.rocksdb_memory_mb,
               tiered_ratio=round(report.tiered / max(1, report.produced), 6),
               replicated_ratio=round(report.replicated / max(1, report.produced), 6),
               rss_end_over_start=(round(report.rss_mb_end / report.rss_mb_start, 3)
                                   if report.rss_mb_start and report.rss_mb_end else None),
               longest_service_process=max(report.rss_by_service_process, key=lambda p: p[0], default=None),
               rss_last_third_over_first_third=growth(report.rss_series),
               rss_last_third_over_middle_third=growth(report.rss_series, base=1),
               state_memory_last_third_over_middle_third=growth(report.state_memory_series, base=1))
    print(json.dumps(out, sort_keys=True))
    try:
        run.check()
    except AssertionError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

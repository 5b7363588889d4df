"""What a quiet broker costs: the whole service's CPU at a low, steady append rate.

    ./dev bench quiet [--rate 100] [--seconds 60] [--warmup 30] [--rounds 2] [--kafka] [--series S]

For each variant, in alternating order over ``--rounds``: a new root; ``tierlog run`` as a process
(tiering and compaction, with ``--kafka`` the mirror and the changelog into an embedded tansu); a
separate process appending 1 KiB messages over 64 queues (``bench/loadgen.py``); after
``--warmup`` seconds (the JIT, the first batches), the CPU of the service's whole process tree
(the Python driver, the JVM, Spark's Python workers; what exited is in its parent's children's
time) over ``--seconds``, read from /proc.  The producer is not in that tree.

variants
  every-trigger  compaction and the mirror run a micro-batch at every trigger that finds data
                 (min_batch_bytes 0: the default before issue 53)
  batched        compaction's and the mirror's min_batch_bytes = 1 MiB, max_batch_delay_s = 5: on a
                 quiet broker each runs a micro-batch every 5 s (the default since issue 53)
  the default    the configuration's defaults, whatever they are now
  spark-mirror   the defaults, but every mirror batch sent by Spark's tasks (kafka.mirror_driver_bytes
                 = 0: the default before the driver sent a quiet broker's small batches itself)
  both-jit-tiers the defaults, but the JVM's JIT with both its tiers (spark.jit_c1_only = false: the
                 default before it)
  mirror-process the defaults, but the driver's mirror steps sent from a process of their own
                 (kafka.mirror_process = true)
  huge-pages     the defaults, but the service's processes with transparent huge pages as the kernel
                 is set up (spark.transparent_huge_pages = true: the default before it)
  shuffle-partitions-N
                 the defaults, but compaction's state in N partitions (spark.shuffle_partitions = N,
                 for the new checkpoint each run makes; the default is 4)
  compaction-min-mib-N
                 the defaults, but compaction.min_batch_bytes = N MiB: fewer, larger compaction
                 batches at a sustained rate, the KV view that much staler
  tables-off     the defaults, but no Iceberg tables (tables.enabled = false): what they cost
  mirror-only    the defaults, but compaction off (so, with Kafka, no changelog either): tiering
                 and the mirror alone
  max-batch-mib-N
                 the defaults, but source.max_bytes_per_trigger = N MiB (256 by default): larger
                 batches for every query while it is behind, so a compaction batch over many keys
                 holds more repeats of a key and sends fewer changes
  compaction-max-mib-N
                 the defaults, but compaction.max_batch_bytes = N MiB: only compaction's batches
                 larger while it is behind

It prints each round's cores (CPU seconds over wall seconds) and the medians; with ``--series S``
also the cores of each S-second slice of the window; and the window's longest tiering batch with
its phases and the seals in the window (a quiet broker's queues all seal by age every
``tier.segment_age_s``, 600 s: ``--warmup 0 --seconds 840 --series 30`` takes one such wave in).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import statistics
import subprocess
import tempfile
import time

from bench.bench_tiering import REPO, ServiceProcess, batch_lines
from bench import loadgen
from bench.common import kafka_broker, report, tree_cpu_s
from streaming import config as cfg


# The variants named ``<prefix>N``: one setting of one section, N times a unit.
NUMBERED = {
    "shuffle-partitions-": ("spark", "shuffle_partitions", 1),
    "compaction-min-mib-": ("compaction", "min_batch_bytes", 1 << 20),
    "max-batch-mib-": ("source", "max_bytes_per_trigger", 1 << 20),
    "compaction-max-mib-": ("compaction", "max_batch_bytes", 1 << 20),
    "compaction-nice-": ("compaction", "nice", 1),
}


def variant_conf(root: str, name: str, kafka: str | None) -> cfg.Config:
    conf = cfg.Config(
        commitlog=cfg.CommitlogConfig(dir=os.path.join(root, "commitlog"), file_size=256 << 20),
        tier=cfg.TierConfig(location=os.path.join(root, "tier")),
        state=cfg.StateConfig(dir=os.path.join(root, "state")),
        checkpoint=cfg.CheckpointConfig(dir=os.path.join(root, "checkpoints")),
        metrics=cfg.MetricsConfig(port=0),
        kafka=cfg.KafkaConfig(bootstrap=kafka, partitions=4) if kafka else cfg.KafkaConfig(),
    )
    if name in ("every-trigger", "batched"):
        least, delay = (0, 0.0) if name == "every-trigger" else (1 << 20, 5.0)
        conf = dataclasses.replace(
            conf, compaction=dataclasses.replace(conf.compaction, min_batch_bytes=least, max_batch_delay_s=delay),
            kafka=dataclasses.replace(conf.kafka, mirror_min_batch_bytes=least, mirror_max_batch_delay_s=delay))
    if name == "spark-mirror":
        conf = dataclasses.replace(conf, kafka=dataclasses.replace(conf.kafka, mirror_driver_bytes=0))
    if name == "both-jit-tiers":
        conf = dataclasses.replace(conf, spark=dataclasses.replace(conf.spark, jit_c1_only=False))
    if name == "mirror-process":
        conf = dataclasses.replace(conf, kafka=dataclasses.replace(conf.kafka, mirror_process=True))
    if name == "json-topics":  # what typing every topic's bodies costs (with ``--bodies json``)
        conf = dataclasses.replace(conf, topics=dataclasses.replace(conf.topics, body_format="*=json"))
    if name == "tables-off":  # what the Iceberg tables cost: the service without them
        conf = dataclasses.replace(conf, tables=dataclasses.replace(conf.tables, enabled=False))
    if name == "mirror-only":
        conf = dataclasses.replace(conf, compaction=dataclasses.replace(conf.compaction, enabled=False))
    for prefix, (section, key, unit) in NUMBERED.items():
        if name.startswith(prefix):
            value = int(name[len(prefix):]) * unit
            conf = dataclasses.replace(conf, **{section: dataclasses.replace(getattr(conf, section), **{key: value})})
    if name == "huge-pages":
        conf = dataclasses.replace(conf, spark=dataclasses.replace(conf.spark, transparent_huge_pages=True))
    return conf


@contextlib.contextmanager
def service_under_load(conf_for, rate: float, body: int = 1024, prefix: str = "tierlog-quiet-",
                       env: dict | None = None, keys: int = 1000, bodies: str = "random"):
    """A service over a new root (``conf_for(root)``), with ``env`` added to its environment, its
    first batch committed, while a separate process (``bench/loadgen.py``, records encoded beforehand,
    under a tenth of a core) appends ``rate`` messages a second of ``body`` bytes over 64 queues,
    their keys drawn from ``keys``, the bodies ``bodies`` (``loadgen --bodies``) (its pid is the service's ``generator_pid``); both are killed and
    the root removed on the way out."""
    root = tempfile.mkdtemp(prefix=prefix)
    service = ServiceProcess(root, conf=conf_for(root))
    service.env.update(env or {})
    producer = None
    try:
        service.produce(100, seed=1)
        service.start_until_first_commit()
        producer = subprocess.Popen(loadgen.command(service.conf.commitlog, rate, 10**12, body, keys, 2,
                                                    bodies=bodies),
                                    cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        service.generator_pid = producer.pid
        yield service
    finally:
        if producer is not None:
            producer.kill()
            producer.wait()
        service.kill()
        shutil.rmtree(root, ignore_errors=True)


def measure(name: str, args, kafka: str | None) -> dict:
    with service_under_load(lambda root: variant_conf(root, name, kafka), args.rate) as service:
        time.sleep(args.warmup)
        cpu0, t0, wall0 = tree_cpu_s(service.proc.pid), time.monotonic(), time.time()
        series, at, cpu = [], t0, cpu0
        while at - t0 < args.seconds - 1e-6:  # one slice of --series seconds at a time (all of it without)
            time.sleep(min(args.series or args.seconds, args.seconds - (at - t0)))
            now, used = time.monotonic(), tree_cpu_s(service.proc.pid)
            series.append([round(now - t0), round((used - cpu) / (now - at), 3)])
            at, cpu = now, used
        if service.proc.poll() is not None:
            raise RuntimeError(f"the service in {service.root} exited (see {service.log})")
        out = {"variant": name, "cores": round((cpu - cpu0) / (at - t0), 3)}
        if args.series:
            out["series"] = series
        tiering = [b for ms, b in batch_lines(service.log) if b["query"] == "tiering" and ms / 1000 >= wall0]
        if tiering:  # a seal wave (every tier.segment_age_s) shows here as a long batch
            longest = max(tiering, key=lambda b: b["seconds"])
            out["longest_tiering_batch"] = {"seconds": longest["seconds"], "phases": longest.get("phases"),
                                            "seals_in_window": sum(b.get("seals", 0) for b in tiering)}
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=100.0, help="messages per second (default 100)")
    parser.add_argument("--seconds", type=float, default=60.0, help="measured window (default 60)")
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds before the window (default 30)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kafka", action="store_true", help="the mirror and changelog into an embedded tansu")
    parser.add_argument("--variants", default="every-trigger,batched")
    parser.add_argument("--series", type=float, default=0.0,
                        help="also print the cores of each slice of this many seconds of the window")
    args = parser.parse_args()
    names = args.variants.split(",")
    rounds: dict[str, list[float]] = {n: [] for n in names}
    runs = []
    with kafka_broker("tansu" if args.kafka else None) as (bootstrap, _pid):
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else list(reversed(names))):  # alternating order
                runs.append(measure(name, args, bootstrap))
                rounds[name].append(runs[-1]["cores"])
    result = {"benchmark": "quiet", "rate_msgs_s": args.rate, "body_bytes": 1024, "kafka": args.kafka,
              "window_s": args.seconds, "warmup_s": args.warmup,
              "cores": {n: {"rounds": v, "median": statistics.median(v)} for n, v in rounds.items()}, "runs": runs}
    if "every-trigger" in rounds and "batched" in rounds:
        result["ratio_batched_over_every_trigger"] = round(
            statistics.median(rounds["batched"]) / statistics.median(rounds["every-trigger"]), 3)
    for other in ("spark-mirror", "both-jit-tiers", "huge-pages"):
        if "the default" in rounds and other in rounds:
            result[f"ratio_default_over_{other.replace('-', '_')}"] = round(
                statistics.median(rounds["the default"]) / statistics.median(rounds[other]), 3)
    report(result)


if __name__ == "__main__":
    main()

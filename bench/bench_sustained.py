"""The highest append rate the whole service keeps up with, against the load generator's own maximum.

    ./dev bench sustained [--bodies 1024,16384] [--rates 4,8,16,32] [--minutes 5] [--no-kafka]
                          [--producer kafka-python|librdkafka] [--mirror-process] [--broker tansu|apache-kafka]

For each body size:

baseline   the load generator alone (``bench/loadgen.py``: records encoded beforehand, one
           ``pwrite`` a tick, a process of its own; the same workload) with no rate to hold: its
           maximum append rate in MB/s, measured twice, before and after the probes.
probe R    a new service over a new root (``tierlog run`` as a process: tiering, compaction, and
           with Kafka the mirror and the changelog on an embedded tansu broker), first batch
           committed, then the generator appends R MB/s for ``--minutes`` (``--broker apache-kafka``:
           a real Apache Kafka, the tests' KRaft node, instead of tansu).  Every 5 s
           the benchmark samples each sink's lag in bytes: the commitlog's end minus the offset
           that sink has applied (the metadata store, read-only, as ``tierlog status`` reads it).
           Over the probe, the service's cores and the whole machine's (``machine_busy_cores``,
           from ``/proc/stat``: the broker, the generator and the kernel's threads too): a probe
           that falls behind on a full machine says so.

Why the generator and not ``tierlog produce``: that encodes every message in Python, about 20 µs
of a core each, on the same 2 cores as the service, so the rates asked for were not the rates
appended, and the producer's CPU was the service's loss.  The generator costs under a tenth of a
core (its own figure is in each probe's ``generator_cores``).

A probe keeps up when the lag stops growing: the least-squares slope of the largest sink lag over
the probe's second half is under 2% of the append rate (a lag that grows by 2% of the input each
second would reach a GiB in about an hour at 16 MB/s; over 5 minutes that is the resolution this
method has).  Rates are tried in ascending order and a body size stops at its first rate that
does not keep up.  The result is the highest rate that kept up, over the generator's maximum.
Sealing is at the product's defaults; 64 queues of one topic, 100,000 keys.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench import loadgen
from bench.bench_tiering import REPO, ServiceProcess
from bench.common import BROKERS, kafka_broker, machine_cpu_s, report, tree_cpu_s
from connectors.commitlog.reader import CommitLogReader
from state.metadata import MetadataStore
from connectors.kafka.settings import PRODUCERS
from streaming import config as cfg
from streaming.plan import enabled_sinks
from streaming.settings import derive

SAMPLE_S = 5.0
KEEPS_UP_SLOPE = 0.02  # of the append rate
KEYS = 100_000


def make_conf(root: str, bootstrap: str | None, producer: str = cfg.KafkaConfig.producer,
              mirror_process: bool = cfg.KafkaConfig.mirror_process) -> cfg.Config:
    kafka = (cfg.KafkaConfig(bootstrap=bootstrap, partitions=4, producer=producer, mirror_process=mirror_process)
             if bootstrap else cfg.KafkaConfig())
    return cfg.Config(
        commitlog=cfg.CommitlogConfig(dir=os.path.join(root, "commitlog"), file_size=256 << 20),
        tier=cfg.TierConfig(location=os.path.join(root, "tier")),
        state=cfg.StateConfig(dir=os.path.join(root, "state")),
        checkpoint=cfg.CheckpointConfig(dir=os.path.join(root, "checkpoints")),
        kafka=kafka,
    )


class Root(ServiceProcess):
    """One probe's service (``bench_tiering.ServiceProcess``) over a new directory, with this
    benchmark's config, and its producer in the background."""

    def __init__(self, bootstrap: str | None, producer: str = cfg.KafkaConfig.producer,
                 mirror_process: bool = cfg.KafkaConfig.mirror_process):
        root = tempfile.mkdtemp(prefix="tierlog-sustained-")
        super().__init__(root, conf=make_conf(root, bootstrap, producer, mirror_process))

    def producer(self, body: int, messages: int, rate_msgs: float = 0.0, seed: int = 0) -> subprocess.Popen:
        """The load generator appending ``messages`` at ``rate_msgs`` a second (0: as fast as it can)."""
        command = loadgen.command(self.conf.commitlog, rate_msgs or 1e12, messages, body, KEYS, seed)
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO)

    def close(self) -> None:
        self.kill()
        if os.environ.get("BENCH_KEEP"):
            print(f"kept {self.root}", file=sys.stderr)
        else:
            shutil.rmtree(self.root, ignore_errors=True)


def producer_max(body: int, mb: int = 512) -> float:
    """The load generator's own append rate, MB/s, over ``mb`` of messages with nothing else running."""
    root = Root(None)
    try:
        proc = root.producer(body, int(mb * 1e6 / (body + 200)))
        out, _ = proc.communicate()
        done = json.loads(out)
        return done["bytes"] / done["seconds"] / 1e6
    finally:
        root.close()


def lag_samples(root: Root, producer: subprocess.Popen, minutes: float) -> list[tuple[float, int, dict]]:
    """(seconds since start, largest sink lag in bytes, lag per sink) every ``SAMPLE_S`` while the producer runs."""
    samples, hint, started = [], None, time.monotonic()
    with CommitLogReader(root.conf.commitlog.dir) as reader:
        while producer.poll() is None and time.monotonic() - started < minutes * 60 + 30:
            time.sleep(SAMPLE_S)
            hint = end = reader.end_offset(hint)
            lags = sink_lags(root.conf, end)
            samples.append((round(time.monotonic() - started, 1), max(lags.values()), lags))
    return samples


def sink_lags(conf: cfg.Config, end: int) -> dict[str, int]:
    """Bytes of commitlog each enabled sink has yet to apply: ``end`` (the commitlog's) minus the
    sink's applied offset, from the metadata store read-only, as ``tierlog status`` reads it."""
    store = MetadataStore(derive(conf).paths.metadata, read_only=True)
    try:
        applied = store.journal.sinks()
    finally:
        store.close()
    return {sink: end - applied.get(sink, 0) for sink in enabled_sinks(derive(conf))}


def slope(points: list[tuple[float, int]]) -> float:
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def probe(body: int, rate_mb: float, minutes: float, bootstrap: str | None,
          producer: str = cfg.KafkaConfig.producer, mirror_process: bool = cfg.KafkaConfig.mirror_process) -> dict:
    root = Root(bootstrap, producer, mirror_process)
    try:
        root.start()
        # Warm-up: the first batches start Spark's Python workers and compile plans.
        root.producer(body, 2000, seed=99).communicate()
        store_path = derive(root.conf).paths.metadata
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if root.proc.poll() is not None:
                raise RuntimeError(f"tierlog run exited with {root.proc.returncode}: see {root.log}")
            if os.path.exists(store_path):
                store = MetadataStore(store_path, read_only=True)
                try:
                    if all(s in store.journal.sinks() for s in enabled_sinks(derive(root.conf))):
                        break
                finally:
                    store.close()
            time.sleep(1)
        rate_msgs = rate_mb * 1e6 / (body + 200)  # a stored message is its body plus ~200 bytes of header
        machine0, service0, started = machine_cpu_s()[0], tree_cpu_s(root.proc.pid), time.monotonic()
        producer = root.producer(body, int(rate_msgs * minutes * 60), rate_msgs, seed=1)
        samples = lag_samples(root, producer, minutes)
        out, _ = producer.communicate()
        held = time.monotonic() - started
        machine, service = (machine_cpu_s()[0] - machine0) / held, (tree_cpu_s(root.proc.pid) - service0) / held
        produced = json.loads(out)
        achieved = produced["bytes"] / produced["seconds"] / 1e6
        half = [(t, lag) for t, lag, _ in samples if t >= samples[-1][0] / 2]
        growth = slope(half)  # bytes/s
        return {"rate_mb_s": rate_mb, "achieved_mb_s": round(achieved, 2), "generator_cores": produced["cores"],
                "samples": len(samples),
                "lag_growth_mb_s": round(growth / 1e6, 3), "lag_growth_of_rate": round(growth / (achieved * 1e6), 4),
                "max_lag_mb": round(max(lag for _, lag, _ in samples) / 1e6, 1),
                "last_lag_mb": {s: round(v / 1e6, 1) for s, v in samples[-1][2].items()},
                "keeps_up": growth < KEEPS_UP_SLOPE * achieved * 1e6,
                # Every process and kernel thread: a probe that falls behind on a full machine says so.
                "machine_busy_cores": round(machine, 3), "of_cores": os.cpu_count(), "service_cores": round(service, 3)}
    finally:
        root.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bodies", default="1024,16384", help="body sizes in bytes, comma-separated")
    ap.add_argument("--rates", default="4,8,16,32", help="append rates to try, MB/s, ascending")
    ap.add_argument("--minutes", type=float, default=5.0, help="minutes each rate is held")
    ap.add_argument("--no-kafka", action="store_true", help="tiering and compaction only")
    ap.add_argument("--producer", default=cfg.KafkaConfig.producer, choices=PRODUCERS,
                    help="kafka.producer of the service (default: the product's)")
    ap.add_argument("--mirror-process", action="store_true",
                    help="kafka.mirror_process = true: the driver's mirror steps sent from a process of their own")
    ap.add_argument("--broker", default="tansu", choices=BROKERS, help="the Kafka-protocol broker (default tansu)")
    args = ap.parse_args()
    results = []
    with kafka_broker(None if args.no_kafka else args.broker) as (bootstrap, _pid):
        for body in (int(b) for b in args.bodies.split(",")):
            before = producer_max(body)
            probes = []
            for rate in (float(r) for r in args.rates.split(",")):
                probes.append(probe(body, rate, args.minutes, bootstrap, args.producer, args.mirror_process))
                print(json.dumps({"body": body, **probes[-1]}), file=sys.stderr)
                if not probes[-1]["keeps_up"]:
                    break
            after = producer_max(body)
            best = max((p["achieved_mb_s"] for p in probes if p["keeps_up"]), default=None)
            producer = statistics.mean([before, after])
            results.append({"body": body, "producer_max_mb_s": [round(before, 1), round(after, 1)],
                            "sustained_mb_s": best, "of_producer_max": round(best / producer, 3) if best else None,
                            "probes": probes})
    report({"benchmark": "sustained", "minutes_per_rate": args.minutes, "kafka": not args.no_kafka,
            "broker": None if args.no_kafka else args.broker,
            "producer": args.producer if not args.no_kafka else None,
            "mirror_process": args.mirror_process if not args.no_kafka else None,
            "keeps_up": f"lag growth over each probe's second half < {KEEPS_UP_SLOPE:.0%} of the append rate",
            "results": results})


if __name__ == "__main__":
    main()

"""Append -> visible in the topic's Iceberg table, against append -> visible in the tier, in one run.

    ./dev bench table_freshness [--rates 2000,10000] [--seconds 60] [--warmup 20] [--poll 0.5]

``tierlog run`` with its defaults (tables on, a 1 s trigger, compaction on, Kafka off) tails a
commitlog that ``bench/loadgen.py`` appends to at a steady rate from a process of its own
(pre-encoded records, one topic of 64 queues, 1 KiB bodies).  A poller in this process asks, every
``--poll`` seconds, what any reader sees: DuckDB's ``iceberg_scan`` of the table's newest metadata
file (each queue's highest offset), and ``TierReader.queue_infos`` (each queue's commit offset, the
baseline).  Per message stored after the warm-up: the time from its store timestamp to the middle
of the first poll that saw it, in the table and in the tier.  Every message counts: one the table
never shows within ``--drain`` seconds of the end counts as that long.  Also: the table commits and
fresh files a minute (from the service's batch lines), and the trend (first fifth against last).

Target (issue 97): the table's p99 <= 5 s at 2,000 and 10,000 msgs/s, not growing, none missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time

import duckdb

from bench import loadgen
from bench.bench_tiering import REPO, ServiceProcess
from bench.common import report
from connectors.commitlog.reader import CommitLogReader
from connectors.tier.reader import TierReader
from streaming import config as cfg

TOPIC = "topic-0"


def _conf(root: str) -> cfg.Config:
    return cfg.Config(commitlog=cfg.CommitlogConfig(dir=os.path.join(root, "commitlog"), file_size=256 << 20),
                      tier=cfg.TierConfig(location=os.path.join(root, "tier")),
                      state=cfg.StateConfig(dir=os.path.join(root, "state")),
                      checkpoint=cfg.CheckpointConfig(dir=os.path.join(root, "checkpoints")),
                      metrics=cfg.MetricsConfig(port=0))


class Poller(threading.Thread):
    """Every ``every`` seconds: each queue's highest offset in the table, and its commit offset in the tier."""

    def __init__(self, conf: cfg.Config, every: float):
        super().__init__(daemon=True)
        self.conf, self.every, self.done = conf, every, threading.Event()
        self.table: list[tuple[float, dict[int, int]]] = []
        self.tier: list[tuple[float, dict[int, int]]] = []
        self.read_s: list[float] = []

    def run(self) -> None:
        from pyiceberg.catalog.sql import SqlCatalog

        extensions = importlib.util.find_spec("duckdb_ext").submodule_search_locations[0] + "/extensions"
        con = duckdb.connect(config={"extension_directory": extensions, "autoinstall_known_extensions": False})
        con.execute("LOAD iceberg")
        catalog = None
        while not self.done.is_set():
            t0 = time.time()
            try:
                catalog = catalog or SqlCatalog("tierlog", uri=f"sqlite:///{self.conf.state.dir}/tables.db")
                location = catalog.load_table(("tierlog", "rmq_topic_0")).metadata_location
                rows = con.execute(f"select queue_id, max(queue_offset) from iceberg_scan('{location}') "
                                   "group by all").fetchall()
                t1 = time.time()
                self.table.append(((t0 + t1) / 2, {q: o for q, o in rows}))
                self.read_s.append(t1 - t0)
            except Exception:  # noqa: BLE001 - no table yet
                pass
            try:
                t2 = time.time()
                infos = TierReader(self.conf.tier.location).queue_infos(topic=TOPIC)
                self.tier.append(((t2 + time.time()) / 2, {i.queue_id: i.commit - 1 for i in infos}))
            except Exception:  # noqa: BLE001 - no tier yet
                pass
            self.done.wait(max(0.0, self.every - (time.time() - t0)))


def _committed_any(conf: cfg.Config) -> bool:
    try:
        return bool(TierReader(conf.tier.location).queue_infos(topic=TOPIC))
    except Exception:  # noqa: BLE001 - no tier yet
        return False


def _seen_at(polls: list[tuple[float, dict[int, int]]], queue: int, offset: int) -> float | None:
    lo, hi = 0, len(polls)  # polls only grow: the first that holds the offset
    while lo < hi:
        mid = (lo + hi) // 2
        if polls[mid][1].get(queue, -1) >= offset:
            hi = mid
        else:
            lo = mid + 1
    return polls[lo][0] if lo < len(polls) else None


def _summary(latencies: list[float], missing: int) -> dict:
    ms = sorted(x * 1000 for x in latencies)
    q = statistics.quantiles(ms, n=100) if len(ms) > 1 else ms * 99
    fifth = max(1, len(latencies) // 5)
    return {"p50_ms": round(q[49]), "p99_ms": round(q[98]), "max_ms": round(ms[-1]) if ms else None,
            "first_fifth_p50_ms": round(statistics.median(latencies[:fifth]) * 1000),
            "last_fifth_p50_ms": round(statistics.median(latencies[-fifth:]) * 1000), "not_seen": missing}


def measure(rate: int, seconds: float, warmup: float, poll: float, drain: float) -> dict:
    root = tempfile.mkdtemp(prefix="tierlog-table-fresh-")
    conf = _conf(root)
    service = ServiceProcess(root, conf=conf)
    poller = Poller(conf, poll)
    try:
        service.start()
        subprocess.run(loadgen.command(conf.commitlog, rate, int(rate * 5), 1024, 5000, 99), check=True,
                       capture_output=True, cwd=REPO)  # the first batches start Spark's workers
        deadline = time.time() + 600
        while not _committed_any(conf):
            if time.time() > deadline or service.proc.poll() is not None:
                raise RuntimeError(f"the service committed nothing; see {service.log}")
            time.sleep(0.5)
        poller.start()
        time.sleep(warmup)
        steady_from = time.time()
        produced = json.loads(subprocess.run(loadgen.command(conf.commitlog, rate, int(rate * seconds), 1024, 5000, 0),
                                             check=True, capture_output=True, text=True, cwd=REPO).stdout)
        stored = []
        with CommitLogReader(conf.commitlog.dir, check_crc=False) as reader:
            for batch in reader.record_batches(reader.first_offset(), reader.end_offset(),
                                               columns=["topic", "queue_id", "queue_offset", "store_ts"]):
                for t, q, o, ts in zip(*(batch.column(c).to_pylist() for c in ("topic", "queue_id", "queue_offset",
                                                                                 "store_ts"))):
                    if t == TOPIC and ts.timestamp() >= steady_from:
                        stored.append((ts.timestamp(), q, o))
        end = time.time() + drain
        last = {}
        for _, q, o in stored:
            last[q] = max(last.get(q, -1), o)
        while time.time() < end and not (poller.table and all(poller.table[-1][1].get(q, -1) >= o
                                                               for q, o in last.items())):
            time.sleep(0.2)
        poller.done.set()
        poller.join(10)
        table, tier, missing_table, missing_tier = [], [], 0, 0
        for ts, q, o in sorted(stored):
            seen = _seen_at(poller.table, q, o)
            table.append((seen - ts) if seen is not None else drain)
            missing_table += seen is None
            seen = _seen_at(poller.tier, q, o)
            tier.append((seen - ts) if seen is not None else drain)
            missing_tier += seen is None
        service.proc.terminate()
        service.proc.wait(120)
        lines = [json.loads(line.split("batch ", 1)[1]) for line in open(service.log)
                 if "tierlog.service: batch {" in line]
        window = [line for line in lines if line["query"] == "tiering" and "tables" in line]
        minutes = max(1e-9, (seconds + drain) / 60)
        commits = sum(line["tables"]["commits"] for line in window)
        files = sum(line["tables"]["files"] for line in window)
        tab, tie = _summary(table, missing_table), _summary(tier, missing_tier)
        return {"rate": rate, "achieved_rate": produced["msgs_per_s"], "generator_cores": produced.get("cores"),
                "measured": len(stored), "append_to_table": tab, "append_to_tier": tie,
                "p99_ratio_table_to_tier": round(tab["p99_ms"] / max(1, tie["p99_ms"]), 2),
                "table_commits_per_min": round(commits / minutes, 1), "fresh_files_per_min": round(files / minutes, 1),
                "poll_read_p50_ms": round(statistics.median(poller.read_s) * 1000) if poller.read_s else None,
                "target_p99_ms": 5000, "met": tab["p99_ms"] <= 5000 and missing_table == 0
                and tab["last_fifth_p50_ms"] - tab["first_fifth_p50_ms"] <= 1000}
    finally:
        poller.done.set()
        if service.proc is not None and service.proc.poll() is None:
            service.proc.kill()
        if os.environ.get("BENCH_KEEP"):
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="2000,10000")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--warmup", type=float, default=20)
    ap.add_argument("--poll", type=float, default=0.5)
    ap.add_argument("--drain", type=float, default=30)
    args = ap.parse_args()
    report({"benchmark": "table-freshness",
            "runs": [measure(int(r), args.seconds, args.warmup, args.poll, args.drain) for r in args.rates.split(",")]})


if __name__ == "__main__":
    main()

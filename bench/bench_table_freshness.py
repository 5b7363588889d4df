"""Append -> visible in the topic's Iceberg table, against append -> visible in the tier, in one run.

    ./dev bench table_freshness [--rates 2000,10000] [--rounds 1] [--keys 5000] [--seconds 60] [--warmup 20]

``tierlog run`` with its defaults (tables on, a 1 s trigger, compaction on, Kafka off) tails a
commitlog that ``bench/loadgen.py`` appends to at a steady rate from a process of its own
(pre-encoded records, one topic of 64 queues, 1 KiB bodies over ``--keys`` keys).  A poller in
this process asks, every ``--poll`` seconds, what any reader sees: DuckDB's ``iceberg_scan`` of
the message table's newest metadata file (each queue's highest offset), the latest-per-key
table's snapshot offset (``through_phy``: every message below it is reflected), and
``TierReader.queue_infos`` (each queue's commit offset: the baseline, the tier's own freshness).
Per message stored after the warm-up: the time from its store timestamp to the middle of the
first poll that saw it, in each table and in the tier.  Every message counts: one never shown
within ``--drain`` seconds of the end counts as that long.  Also: the table commits and fresh
files a minute over the window (from the service's batch lines), and the trend (first fifth
against last).

Targets (issue 97): the message table's p99 <= 5 s at 2,000 and 10,000 msgs/s, not growing, none
missing; the latest-per-key table's p99 <= 60 s at 10,000 msgs/s over 100,000 keys.
"""

from __future__ import annotations

import argparse
import datetime
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
        self.latest: list[tuple[float, int]] = []  # (when, the latest table's through_phy)
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
                t3 = time.time()
                props = catalog.load_table(("tierlog", "rmq_topic_0_latest")).properties
                self.latest.append(((t3 + time.time()) / 2, int(props["tierlog.through-phy.broker-a"])))
            except Exception:  # noqa: BLE001 - no snapshot yet
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


def _through_at(polls: list[tuple[float, int]], phy: int) -> float | None:
    lo, hi = 0, len(polls)  # the first poll whose snapshot offset is past the message
    while lo < hi:
        mid = (lo + hi) // 2
        if polls[mid][1] > phy:
            hi = mid
        else:
            lo = mid + 1
    return polls[lo][0] if lo < len(polls) else None


def _logged_at(line: str) -> float:
    """When the service logged ``line`` (its logging's asctime, local time)."""
    return datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _summary(latencies: list[float], missing: int) -> dict:
    ms = sorted(x * 1000 for x in latencies)
    q = statistics.quantiles(ms, n=100) if len(ms) > 1 else ms * 99
    fifth = max(1, len(latencies) // 5)
    return {"p50_ms": round(q[49]), "p99_ms": round(q[98]), "max_ms": round(ms[-1]) if ms else None,
            "first_fifth_p50_ms": round(statistics.median(latencies[:fifth]) * 1000),
            "last_fifth_p50_ms": round(statistics.median(latencies[-fifth:]) * 1000), "not_seen": missing}


def measure(rate: int, keys: int, seconds: float, warmup: float, poll: float, drain: float) -> dict:
    root = tempfile.mkdtemp(prefix="tierlog-table-fresh-")
    conf = _conf(root)
    service = ServiceProcess(root, conf=conf)
    poller = Poller(conf, poll)
    try:
        service.start()
        subprocess.run(loadgen.command(conf.commitlog, rate, int(rate * 5), 1024, keys, 99), check=True,
                       capture_output=True, cwd=REPO)  # the first batches start Spark's workers
        deadline = time.time() + 600
        while not _committed_any(conf):
            if time.time() > deadline or service.proc.poll() is not None:
                raise RuntimeError(f"the service committed nothing; see {service.log}")
            time.sleep(0.5)
        poller.start()
        time.sleep(warmup)
        steady_from = time.time()
        produced = json.loads(subprocess.run(loadgen.command(conf.commitlog, rate, int(rate * seconds), 1024, keys, 0),
                                             check=True, capture_output=True, text=True, cwd=REPO).stdout)
        stored = []
        with CommitLogReader(conf.commitlog.dir, check_crc=False) as reader:
            for batch in reader.record_batches(reader.first_offset(), reader.end_offset(),
                                               columns=["topic", "queue_id", "queue_offset", "store_ts", "phy_offset"]):
                for t, q, o, ts, phy in zip(*(batch.column(c).to_pylist() for c in ("topic", "queue_id", "queue_offset",
                                                                                      "store_ts", "phy_offset"))):
                    if t == TOPIC and ts.timestamp() >= steady_from:
                        stored.append((ts.timestamp(), q, o, phy))
        end = time.time() + drain
        last = {}
        for _, q, o, _phy in stored:
            last[q] = max(last.get(q, -1), o)
        last_phy = max((phy for *_, phy in stored), default=-1)
        while time.time() < end and not (poller.table and all(poller.table[-1][1].get(q, -1) >= o
                                                               for q, o in last.items())
                                         and poller.latest and poller.latest[-1][1] > last_phy):
            time.sleep(0.2)
        poller.done.set()
        poller.join(10)
        stopped = time.time()
        table, tier, latest, missing_table, missing_tier, missing_latest = [], [], [], 0, 0, 0
        for ts, q, o, phy in sorted(stored):
            seen = _through_at(poller.latest, phy)
            latest.append((seen - ts) if seen is not None else drain)
            missing_latest += seen is None
            seen = _seen_at(poller.table, q, o)
            table.append((seen - ts) if seen is not None else drain)
            missing_table += seen is None
            seen = _seen_at(poller.tier, q, o)
            tier.append((seen - ts) if seen is not None else drain)
            missing_tier += seen is None
        service.proc.terminate()
        service.proc.wait(120)
        lines = [(_logged_at(line), json.loads(line.split("batch ", 1)[1])) for line in open(service.log)
                 if "tierlog.service: batch {" in line]
        window = [line for at, line in lines
                  if steady_from <= at <= stopped and line["query"] == "tiering" and "tables" in line]
        minutes = max(1e-9, (stopped - steady_from) / 60)
        commits = sum(line["tables"]["commits"] for line in window)
        files = sum(line["tables"]["files"] for line in window)
        tab, tie, lat = _summary(table, missing_table), _summary(tier, missing_tier), _summary(latest, missing_latest)
        return {"rate": rate, "keys": keys, "achieved_rate": produced["msgs_per_s"], "generator_cores": produced.get("cores"),
                "measured": len(stored), "append_to_table": tab, "append_to_tier": tie, "append_to_latest_table": lat,
                "p99_ratio_table_to_tier": round(tab["p99_ms"] / max(1, tie["p99_ms"]), 2),
                "table_commits_per_min": round(commits / minutes, 1), "fresh_files_per_min": round(files / minutes, 1),
                "poll_read_p50_ms": round(statistics.median(poller.read_s) * 1000) if poller.read_s else None,
                "target_p99_ms": 5000, "met": tab["p99_ms"] <= 5000 and missing_table == 0
                and tab["last_fifth_p50_ms"] - tab["first_fifth_p50_ms"] <= 1000,
                "latest_target_p99_ms": 60000, "latest_met": lat["p99_ms"] <= 60000 and missing_latest == 0}
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
    ap.add_argument("--rounds", type=int, default=1, help="each rate this many times, the order of the rates "
                    "reversed every other round; the summary gives each figure's median")
    ap.add_argument("--keys", type=int, default=5000)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--warmup", type=float, default=20)
    ap.add_argument("--poll", type=float, default=0.5)
    ap.add_argument("--drain", type=float, default=90, help="how long after the last append a message may still "
                    "be seen (a latest-per-key snapshot comes every compaction.snapshot_interval_s)")
    args = ap.parse_args()
    rates = [int(r) for r in args.rates.split(",")]
    runs = []
    for round_ in range(args.rounds):
        for rate in (rates if round_ % 2 == 0 else rates[::-1]):
            runs.append({"round": round_, **measure(rate, args.keys, args.seconds, args.warmup, args.poll, args.drain)})
    medians = {}
    for rate in rates:
        mine = [r for r in runs if r["rate"] == rate]
        medians[rate] = {f"{kind}_p99_ms": statistics.median(r[kind]["p99_ms"] for r in mine)
                         for kind in ("append_to_table", "append_to_tier", "append_to_latest_table")}
        medians[rate]["table_commits_per_min"] = statistics.median(r["table_commits_per_min"] for r in mine)
    report({"benchmark": "table-freshness", "runs": runs, "medians": medians})


if __name__ == "__main__":
    main()

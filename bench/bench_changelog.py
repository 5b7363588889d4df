"""The changelog sink alone: changed keys per second, against a bare producer sending the same records.

    ./dev bench changelog [--rows 300000] [--body 1024] [--keys 100000] [--bootstrap HOST:PORT] [--rounds 3]
                          [--producers kafka-python,librdkafka]

Why: the changelog is sent on compaction's apply thread, which the sustained benchmark's
profile found busy all the time; this measures that thread's share per record without Spark.

changelog   ``ChangelogSink.publish`` of one table of ``--rows`` changed keys (``CHANGE_ROW``
            columns, as compaction hands them over): Arrow columns to rows, routing, Kafka's
            key partitioning, headers, the position checks, the send and the flush.  The
            topics are created and their positions read back before the clock starts.
bare        the client library alone (``kafka.producer``: kafka-python's KafkaProducer or
            librdkafka's Producer, the sink's settings) sending exactly the records the sink
            sends, built beforehand: the baseline.  Both connect (one record to a topic of
            its own) before the clock starts.

Each library is measured against its own bare producer; ``--rounds`` rounds, the order of the
steps reversed every other round; ratios are the medians of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import pyarrow as pa

from bench.bench_kafka import capture_sends, run_bare
from bench.common import report
from connectors.changes import CHANGE_ROW
from connectors.kafka.changelog import ChangelogSink
from connectors.kafka.settings import KafkaSettings

TOPICS = 2


def changes(rows: int, body: int, keys: int) -> pa.Table:
    rng = random.Random(7)
    payload = rng.randbytes(body)
    picked = sorted(rng.sample(range(keys * 4), rows)) if rows <= keys * 4 else list(range(rows))
    columns = {
        "topic": [f"t{i % TOPICS}" for i in range(rows)],
        "key": [f"k{picked[i] % (keys * 4):07d}" for i in range(rows)],
        "phy_offset": [i * (body + 200) for i in range(rows)],
        "queue_id": [i % 8 for i in range(rows)],
        "queue_offset": [i // 8 for i in range(rows)],
        "store_ts": [1_700_000_000_000 + i for i in range(rows)],
        "deleted": [i % 50 == 0 for i in range(rows)],
        "body": [None if i % 50 == 0 else payload for i in range(rows)],
    }
    types = {"phy_offset": pa.int64(), "queue_offset": pa.int64(), "store_ts": pa.int64(), "queue_id": pa.int32(),
             "body": pa.binary()}
    return pa.table({c: pa.array(columns[c], type=types.get(c)) for c in CHANGE_ROW})


def settings(bootstrap: str, prefix: str, producer: str) -> KafkaSettings:
    return KafkaSettings(client={"bootstrap_servers": bootstrap, "client_id": "bench"},
                         changelog_topic=f"{prefix}.{{topic}}.changelog", partitions=8, producer=producer)


WARM = "bench-warm"  # a topic of its own, so the sink's topics hold only its records


def ready_sink(s: KafkaSettings) -> ChangelogSink:
    """A sink whose topics exist, whose positions are read back and whose producer has
    connected: what a running service's sink is at a batch."""
    from connectors.kafka.sink import ensure_topic

    sink = ChangelogSink(s)
    sink.learn([sink.route(f"t{i}") for i in range(TOPICS)])
    ensure_topic(s, WARM, compacted=False)
    sink.producer.send(WARM, 0, None, b"warm", [], None, lambda error: None)
    assert sink.producer.flush(60)
    return sink


def records_of(table: pa.Table, s: KafkaSettings) -> list[tuple]:
    """Exactly what the sink sends, for the bare producer."""
    sink = ready_sink(s)
    sent = capture_sends(sink)
    sink.publish(table)
    return sent


def run_sink(table: pa.Table, s: KafkaSettings) -> float:
    sink = ready_sink(s)
    t = time.perf_counter()
    sink.publish(table)
    seconds = time.perf_counter() - t
    sent = sink.stats.sent
    sink.close()
    assert sent == table.num_rows, f"the changelog sent {sent} of {table.num_rows}"
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=300_000)
    ap.add_argument("--body", type=int, default=1024)
    ap.add_argument("--keys", type=int, default=100_000, help="the table holds distinct keys drawn from 4x this")
    ap.add_argument("--bootstrap", help="an existing broker (default: an embedded tansu on loopback)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--producers", default="kafka-python,librdkafka")
    args = ap.parse_args()
    broker = None
    bootstrap = args.bootstrap
    if not bootstrap:
        from connectors.kafka.embedded import EmbeddedBroker

        broker = EmbeddedBroker().start()
        bootstrap = broker.bootstrap
    try:
        table = changes(args.rows, args.body, args.keys)
        libraries = args.producers.split(",")
        rounds = []
        for r in range(args.rounds):
            got: dict[str, float] = {}
            steps = []
            for lib in libraries:
                def bare(lib=lib):
                    s = settings(bootstrap, f"bare{r}{lib}", lib)
                    got[f"bare {lib}"] = args.rows / run_bare(records_of(table, s), s, warm_topic=WARM)

                def changelog(lib=lib):
                    got[f"changelog {lib}"] = args.rows / run_sink(table, settings(bootstrap, f"sink{r}{lib}", lib))

                steps += [(f"bare {lib}", bare), (f"changelog {lib}", changelog)]
            order = steps if r % 2 == 0 else steps[::-1]
            for _name, step in order:
                step()
            rounds.append({"order": [name for name, _ in order], **{k: round(v) for k, v in got.items()},
                           **{f"changelog_vs_bare {lib}": round(got[f"changelog {lib}"] / got[f"bare {lib}"], 3)
                              for lib in libraries}})
        out = {"rows": args.rows, "body_bytes": args.body, "rounds": args.rounds,
               "broker": "tansu (embedded)" if broker else bootstrap}
        for lib in libraries:
            for name in ("bare", "changelog"):
                rate = statistics.median(x[f"{name} {lib}"] for x in rounds)
                out[f"{name} {lib}"] = {"rows_per_s": round(rate), "us_per_row": round(1e6 / rate, 1)}
            out[f"changelog_vs_bare {lib}"] = statistics.median(x[f"changelog_vs_bare {lib}"] for x in rounds)
        out["per_round"] = rounds
        report(out)
    finally:
        if broker is not None:
            broker.stop()


if __name__ == "__main__":
    main()

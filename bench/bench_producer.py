"""The sinks' librdkafka producer alone: CPU a record with a delivery report for failures only (the
producer as it is) against a report for every record (the code before), into a real broker.

    python -m bench.bench_producer [--records 200000] [--body 1024] [--rounds 6] [--broker apache-kafka]

Each round sends the same ``--records`` records, prepared beforehand (a key, a body, the mirror's
eight headers), to 8 partitions of a topic of its own through ``RdKafkaProducer.send``, then
flushes.  ``thread_us``: the sending thread's CPU a record (``time.thread_time``), the part that
holds the driver's interpreter lock; ``process_us``: the whole process's, librdkafka's threads
included; the broker is left out.  The two producers alternate, the order reversed every other
round; a first round of each, not counted, warms the broker and the JIT.

``every record`` is the baseline: the same class with ``delivery.report.only.error`` off and the
position of every record kept in flight until its report, as the sink did before.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import deque

from bench.common import BROKERS, kafka_broker, paired_medians, report, warmed_rounds
from connectors.kafka.rdkafka import RdKafkaProducer, rdkafka_options
from connectors.kafka.records import source_headers
from connectors.kafka.settings import KafkaSettings
from connectors.kafka.sink import ensure_topic

PARTITIONS = 8


class EveryRecordReported(RdKafkaProducer):
    """The code before: a report for every record, whose position is the oldest its partition has
    in flight (librdkafka reports a partition's records in the order they were produced)."""

    def __init__(self, settings: KafkaSettings):
        super().__init__(settings)
        self._producer = self._ck.Producer({**rdkafka_options(settings), "error_cb": self._client_error,
                                            "on_delivery": self._report})
        self._in_flight: dict[tuple[str, int], deque] = {}

    def send(self, topic, partition, key, value, headers, timestamp_ms, position) -> None:
        super().send(topic, partition, key, value, headers, timestamp_ms, position)
        in_flight = self._in_flight.get((topic, partition))
        if in_flight is None:
            in_flight = self._in_flight[(topic, partition)] = deque()
        in_flight.append(position)

    def _report(self, err, msg) -> None:
        in_flight = self._in_flight.get((msg.topic(), msg.partition()))
        position = in_flight.popleft() if in_flight else -1
        if err is not None and not self._discarded:
            self._fail(position, self._send_error(err))


PRODUCERS = {"failures only": RdKafkaProducer, "every record": EveryRecordReported}


def records(count: int, body: int) -> list[tuple]:
    """``(key, value, headers, position)``: the mirror's headers, the message's properties first."""
    value = os.urandom(body)
    return [(b"k%d" % (i % 100_000), value,
             [("KEYS", b"k%d" % i), ("UNIQ_KEY", b"7F0000011A2B18B4AAC2%012d" % i),
              *source_headers(i, "orders", i % 64, i // 64, 1764633600000, "broker-a")], i)
            for i in range(count)]


def send_all(cls, settings: KafkaSettings, topic: str, rows: list[tuple]) -> dict:
    producer = cls(settings)
    thread, process = time.thread_time(), time.process_time()
    for key, value, headers, position in rows:
        producer.send(topic, position % PARTITIONS, key, value, headers, 1764633600000, position)
    if not producer.flush(120):
        raise SystemExit(f"the broker did not take {len(rows)} records within 120 s")
    thread, process = time.thread_time() - thread, time.process_time() - process
    failed = producer.failure()
    producer.close(5)
    if failed is not None:
        raise SystemExit(f"a record failed: {failed[0].text}")
    return {"thread_us": thread / len(rows) * 1e6, "process_us": process / len(rows) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--body", type=int, default=1024, help="body bytes (default 1024)")
    parser.add_argument("--rounds", type=int, default=6, help="counted rounds of each producer (default 6)")
    parser.add_argument("--broker", choices=BROKERS, default="apache-kafka")
    args = parser.parse_args()
    rows = records(args.records, args.body)
    with kafka_broker(args.broker) as (bootstrap, _pid):
        settings = KafkaSettings(client={"bootstrap_servers": bootstrap}, partitions=PARTITIONS)

        def run(name: str, r: int) -> dict:
            topic = f"bench-producer-{os.getpid()}-{r}-{list(PRODUCERS).index(name)}"
            ensure_topic(settings, topic, compacted=False)
            return send_all(PRODUCERS[name], settings, topic, rows)

        got = warmed_rounds(list(PRODUCERS), args.rounds, run)
    out = {"benchmark": "producer", "broker": args.broker, "records": args.records, "body_bytes": args.body,
           "rounds": args.rounds}
    out.update(paired_medians(got, ("thread_us", "process_us"), "failures only", "every record"))
    report(out)


if __name__ == "__main__":
    main()

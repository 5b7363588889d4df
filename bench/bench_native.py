"""The mirror's records sent from columns by the native producer, against the same records sent a
call a record through confluent-kafka's binding (the code before), into a real broker.

    ./dev bench native [--records 200000] [--body 1024] [--rounds 6] [--broker apache-kafka]

Each round reads one commitlog of ``--records`` messages (64 queues, keyed, with properties) with
the Arrow fast path, as the mirror's rows (``MIRROR_COLUMNS``), and sends them into topics of its
own through ``MirrorSink.send_batch``, then flushes: once with the native producer (``Records``
read from the Arrow buffers into librdkafka), once with ``RdKafkaProducer`` (the binding's
``produce``, a record's Python objects a call: ``Records.python_rows``, the rows built as the sink
built them before).  The commitlog is read before the clock starts.  ``thread_us``: the sending
thread's CPU a record (``time.thread_time``), the part that holds the driver's interpreter lock;
``process_us``: the whole process's, librdkafka's threads included; the broker is left out.  The
two alternate, the order reversed every other round; a first round of each, not counted, warms the
broker and the JIT.  Every record is counted back from the topics, off the clock.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

from bench.common import BROKERS, kafka_broker, paired_medians, report, warmed_rounds
from connectors.commitlog.format import Message
from connectors.commitlog.reader import CommitLogReader
from connectors.commitlog.writer import CommitLogWriter
from connectors.kafka import native
from connectors.kafka.mirror_sink import MIRROR_COLUMNS, MirrorSink
from connectors.kafka.native_producer import NativeProducer
from connectors.kafka.rdkafka import RdKafkaProducer
from connectors.kafka.settings import KafkaSettings
from tests.kafka_helpers import read_topic

PARTITIONS = 8


class BindingSink(MirrorSink):
    """The mirror sink with the binding's producer: a record's Python objects a call."""

    @property
    def producer(self):
        if self._producer is None:
            self._producer = RdKafkaProducer(self.settings)
        return self._producer


SINKS = {"native": MirrorSink, "binding": BindingSink}


def commitlog(directory: str, n: int, body: int) -> list:
    rng = random.Random(3)
    with CommitLogWriter(directory, file_size=256 << 20, fsync="never") as writer:
        for start in range(0, n, 10_000):
            writer.append_many([Message(topic="orders", queue_id=i % 64, body=rng.randbytes(body),
                                        properties={"KEYS": f"k{rng.randrange(100_000):06d}", "TAGS": "bench"})
                                for i in range(start, min(n, start + 10_000))])
    with CommitLogReader(directory) as reader:
        return list(reader.record_batches(0, reader.end_offset(), columns=MIRROR_COLUMNS))


def send_all(cls, settings: KafkaSettings, batches: list) -> dict:
    sink = cls(settings)
    sink.partitions(settings.mirror_topic.replace("{topic}", "orders"))  # topic and read-back off the clock
    thread, process = time.thread_time(), time.process_time()
    for batch in batches:
        sink.send_batch(batch)
    sink.flush()
    thread, process = time.thread_time() - thread, time.process_time() - process
    sent, is_native = sink.stats.sent, isinstance(sink.producer, NativeProducer)
    sink.close()
    return {"thread_us": thread / sent * 1e6, "process_us": process / sent * 1e6, "sent": sent, "native": is_native}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--body", type=int, default=1024, help="body bytes (default 1024)")
    parser.add_argument("--rounds", type=int, default=6, help="counted rounds of each way (default 6)")
    parser.add_argument("--broker", choices=BROKERS, default="apache-kafka")
    args = parser.parse_args()
    if native.library() is None:
        raise SystemExit("no librdkafka loadable through ctypes: the native producer is not used here")
    with tempfile.TemporaryDirectory(prefix="tierlog-bench-native-") as root:
        batches = commitlog(os.path.join(root, "commitlog"), args.records, args.body)
        with kafka_broker(args.broker) as (bootstrap, _pid):
            def run(name: str, r: int) -> dict:
                prefix = f"bench-native-{os.getpid()}-{r}-{name}"
                settings = KafkaSettings(client={"bootstrap_servers": bootstrap}, partitions=PARTITIONS,
                                         mirror_topic=prefix + ".{topic}")
                result = send_all(SINKS[name], settings, batches)
                if result.pop("native") != (name == "native"):
                    raise SystemExit(f"the {name} way did not use the producer it names")
                received = sum(len(v) for v in read_topic(bootstrap, prefix + ".orders").values())
                if received != args.records or result["sent"] != args.records:
                    raise SystemExit(f"{name}: sent {result['sent']}, received {received} of {args.records}")
                return result

            got = warmed_rounds(list(SINKS), args.rounds, run)
    out = {"benchmark": "native", "broker": args.broker, "records": args.records, "body_bytes": args.body,
           "rounds": args.rounds}
    out.update(paired_medians(got, ("thread_us", "process_us"), "native", "binding"))
    report(out)


if __name__ == "__main__":
    main()

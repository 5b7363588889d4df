"""When each record of a Kafka topic arrived at a consumer, by the commitlog position in its
``tierlog.phy`` header: append -> consumed from the mirror topic, the measure issue 53 names.

    python -m bench.topic_times BOOTSTRAP TOPIC[,TOPIC...] OUT

Reads every partition of each TOPIC from its start until SIGTERM, then writes OUT: one line per record,
``phy arrival_ms`` (wall clock when the poll that returned it returned).  A process of its own, so
its consuming does not share the service's interpreter; the benchmark counts its CPU beside the
service's.  Imports nothing of tierlog: the header's name is the documented one.
"""

from __future__ import annotations

import resource
import signal
import sys
import time

import confluent_kafka

HEADER = "tierlog.phy"


def main() -> None:
    bootstrap, topics, out = sys.argv[1:4]
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    consumer = confluent_kafka.Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-topic-times",
                                         "enable.auto.commit": False, "fetch.wait.max.ms": 50})
    consumer.assign([confluent_kafka.TopicPartition(topic, p, confluent_kafka.OFFSET_BEGINNING)
                     for topic in topics.split(",") for p in consumer.list_topics(topic, timeout=30).topics[topic].partitions])
    seen: list[tuple[int, int]] = []
    while not stop:
        got = consumer.consume(10_000, 0.05)
        now = int(time.time() * 1000)
        for m in got:
            if m.error() is None:
                phy = next((v for k, v in m.headers() or () if k == HEADER), None)
                if phy is not None:
                    seen.append((int(phy), now))
    consumer.close()
    with open(out, "w") as fh:
        fh.writelines(f"{phy} {at}\n" for phy, at in seen)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(round(usage.ru_utime + usage.ru_stime, 3))


if __name__ == "__main__":
    main()

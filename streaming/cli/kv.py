"""``tierlog kv``: the KV view (latest value per key): get, scan, rebuild."""

from __future__ import annotations

import itertools
import logging

from connectors.errors import ConfigError, TierlogError
from streaming import config as cfg
from streaming.cli.found import open_kv, require_kv_topic
from streaming.cli.output import emit, ms_to_iso

log = logging.getLogger("tierlog")


KV_COLUMNS = ["topic", "key", "body", "phy_offset", "queue_id", "queue_offset", "store_ts"]


def _kv_row(entry) -> dict:
    return {"topic": entry.topic, "key": entry.key, "body": entry.body, "phy_offset": entry.phy_offset,
            "queue_id": entry.queue_id, "queue_offset": entry.queue_offset, "store_ts": ms_to_iso(entry.store_ts)}


def cmd_kv(args, conf: cfg.Config) -> int:
    if args.kv_command == "rebuild":
        return _kv_rebuild(args, conf)
    if args.kv_command in ("get", "scan") and not args.topic:
        raise ConfigError(f"`tierlog kv {args.kv_command}` needs a TOPIC")
    with open_kv(conf) as kv:
        if args.kv_command == "snapshot":
            rows = snapshot_now(conf, kv)
            emit([{"keys": rows, "through_phy": kv.applied_through(), "tier": conf.tier.location}], args.format)
            return 0
        if args.kv_command == "get":
            if args.key is None:
                raise ConfigError("`tierlog kv get` needs a TOPIC and a KEY")
            entry = kv.get(args.topic, args.key)
            if entry is None:
                require_kv_topic(kv, args.topic)
                raise TierlogError(f"key {args.key!r} is not in topic {args.topic!r} (the view has applied "
                                   f"messages below physical offset {kv.applied_through()})")
            emit([_kv_row(entry)], args.format, KV_COLUMNS)
            return 0
        require_kv_topic(kv, args.topic)
        entries = kv.scan(args.topic, args.prefix or "")
        rows = (_kv_row(e) for e in itertools.islice(entries, args.limit or None))
        if emit(rows, args.format, KV_COLUMNS) == 0 and args.format == "table":
            log.info("no live key in topic %r with prefix %r", args.topic, args.prefix or "")
        return 0


def snapshot_now(conf: cfg.Config, kv) -> int:
    """Write every topic's live keys from ``kv`` to the tier now (and to the latest-per-key tables,
    when tables are on); returns the keys written."""
    from state.kv_writer import open_latest_tables, write_snapshot
    from streaming.settings import tables

    settings = tables(conf)
    latest = open_latest_tables(settings, conf.tier.location, conf.broker.name) if settings else None
    return write_snapshot(kv, conf.tier.location, conf.broker.name, keep=max(1, conf.compaction.snapshot_keep),
                          tables=latest)


def _kv_rebuild(args, conf: cfg.Config) -> int:
    import dataclasses

    from state.rebuild import rebuild_view
    from streaming.plan import kv_path
    from streaming.settings import derive

    settings = derive(conf)
    report = rebuild_view(
        kv_path(conf), commitlog_dir=conf.commitlog.dir, tier_location=conf.tier.location, broker=conf.broker.name,
        source=args.source, ttl=settings.ttl, key_property=conf.commitlog.key_property,
        topics=settings.filters["compaction"],
    )
    emit([dataclasses.asdict(report)], args.format)
    return 0

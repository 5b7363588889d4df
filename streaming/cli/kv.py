"""``tierlog kv``: the KV view (latest value per key): get, scan, rebuild, snapshot; and, from the
tier alone, a key's value as of a time (``get --as-of``) and its ``history``."""

from __future__ import annotations

import itertools
import logging

from connectors.errors import ConfigError, TierlogError
from streaming import config as cfg
from streaming.cli.found import open_kv, open_reader, require_kv_topic
from streaming.cli.output import emit, ms_to_iso, parse_time, parsed_body
from streaming.settings import Settings, derive

log = logging.getLogger("tierlog")


KV_COLUMNS = ["topic", "key", "body", "phy_offset", "queue_id", "queue_offset", "store_ts"]


def _kv_row(entry, fmt: str = "table", settings: Settings | None = None) -> dict:
    row = {"topic": entry.topic, "key": entry.key, "body": entry.body, "phy_offset": entry.phy_offset,
           "queue_id": entry.queue_id, "queue_offset": entry.queue_offset, "store_ts": ms_to_iso(entry.store_ts)}
    if fmt == "json" and settings is not None:
        row.update(parsed_body(entry.body, settings.body_formats.typed(entry.topic)))
    return row


def cmd_kv(args, conf: cfg.Config) -> int:
    s = derive(conf)
    if args.kv_command == "rebuild":
        return _kv_rebuild(args, s)
    if args.kv_command in ("get", "scan", "history") and not args.topic:
        raise ConfigError(f"`tierlog kv {args.kv_command}` needs a TOPIC")
    if args.kv_command in ("get", "history") and args.key is None:
        raise ConfigError(f"`tierlog kv {args.kv_command}` needs a TOPIC and a KEY")
    if args.kv_command == "history" or (args.kv_command == "get" and args.as_of):
        return _from_tier(args, s)
    with open_kv(s) as kv:
        if args.kv_command == "snapshot":
            rows = snapshot_now(s, kv)
            emit([{"keys": rows, "through_phy": kv.applied_through(), "tier": s.paths.tier}], args.format)
            return 0
        if args.kv_command == "get":
            entry = kv.get(args.topic, args.key)
            if entry is None:
                require_kv_topic(kv, args.topic)
                gone = kv.tombstone(args.topic, args.key)
                if gone is not None:
                    state, phy, ms = gone
                    why = ("deleted by the message" if state == "deleted" else
                           "past its time to live (compaction.ttl) since the message")
                    raise TierlogError(f"key {args.key!r} of topic {args.topic!r} has no value: {why} stored "
                                       f"{ms_to_iso(ms)} at physical offset {phy}")
                raise TierlogError(f"key {args.key!r} is not in topic {args.topic!r}: no message of the topic "
                                   f"below physical offset {kv.applied_through()} (what the view has applied) "
                                   "carried it")
            emit([_kv_row(entry, args.format, s)], args.format, KV_COLUMNS)
            return 0
        require_kv_topic(kv, args.topic)
        entries = kv.scan(args.topic, args.prefix or "")
        rows = (_kv_row(e, args.format, s) for e in itertools.islice(entries, args.limit or None))
        if emit(rows, args.format, KV_COLUMNS) == 0 and args.format == "table":
            log.info("no live key in topic %r with prefix %r", args.topic, args.prefix or "")
        return 0


HISTORY_COLUMNS = ["store_ts", "broker", "phy_offset", "queue_id", "queue_offset", "op", "body"]


def _from_tier(args, settings: Settings) -> int:
    """``get --as-of`` and ``history``: the tier and its snapshots alone (connectors.tier.asof)."""
    from connectors.tier.asof import AsOfReader

    reader = AsOfReader(open_reader(settings, args.read_broker, args.topic),
                        {t: int(s * 1000) for t, s in (settings.ttl or {}).items()})
    if args.kv_command == "history":
        start = parse_time(args.source) if args.source else None
        until = parse_time(args.until) if args.until else None
        if start is not None and until is not None and start > until:
            raise ConfigError(f"`tierlog kv history --from {args.source} --to {args.until}`: the window ends before "
                              "it starts; give --from the earlier time")
        rows = reader.history(args.topic, args.key, start, until)
        emit(({**r, "store_ts": ms_to_iso(r["store_ts"])} for r in rows), args.format, HISTORY_COLUMNS)
        log.info("%d change(s) of key %r in topic %s in the tier", len(rows), args.key, args.topic)
        return 0
    at = parse_time(args.as_of)
    now = parse_time("now")
    if at > now + 1000:  # a second of clock skew
        raise ConfigError(f"--as-of {args.as_of} ({ms_to_iso(at)}) is in the future: the tier answers up to now "
                          f"({ms_to_iso(now)}); give --as-of now, or leave it out for the KV view's value")
    answer = reader.get(args.topic, args.key, at)
    row = {"topic": args.topic, "key": args.key, "as_of": ms_to_iso(answer.at_ms), "state": answer.state,
           "body": answer.value}
    if args.format == "json":
        row.update(parsed_body(answer.value, settings.body_formats.typed(args.topic)))
    if answer.change is not None:
        row.update(store_ts=ms_to_iso(answer.change["store_ts"]), broker=answer.change["broker"],
                   phy_offset=answer.change["phy_offset"], queue_id=answer.change["queue_id"],
                   queue_offset=answer.change["queue_offset"])
    emit([row], args.format, list(row))
    if answer.state != "live":
        why = {"deleted": "deleted by the message", "expired": "past its time to live (compaction.ttl) since the "
               "message", "absent": "not set by then"}[answer.state]
        where = "" if answer.change is None else f" stored {row['store_ts']} at physical offset {row['phy_offset']}"
        log.info("key %r of topic %s has no value at %s: %s%s", args.key, args.topic, row["as_of"], why, where)
    return 0 if answer.state == "live" else 1


def snapshot_now(settings: Settings, kv) -> int:
    """Write every topic's live keys from ``kv`` to the tier now (and to the latest-per-key tables,
    when tables are on); returns the keys written."""
    from state.kv_writer import open_latest_tables, write_snapshot

    tier, tables = settings.paths.tier, settings.tables
    latest = open_latest_tables(tables, tier, settings.broker) if tables else None
    return write_snapshot(kv, tier, settings.broker, keep=settings.compaction.writer.snapshot_keep, tables=latest)


def _kv_rebuild(args, settings: Settings) -> int:
    import dataclasses

    from state.rebuild import rebuild_view

    paths = settings.paths
    report = rebuild_view(
        paths.kv, commitlog_dir=paths.commitlog, tier_location=paths.tier, broker=settings.broker,
        source=_rebuild_source(args.source), ttl=settings.ttl, key_property=settings.reader.key_property,
        topics=settings.filters["compaction"], references=settings.compaction.writer.references,
    )
    emit([dataclasses.asdict(report)], args.format)
    return 0


def _rebuild_source(text: str | None) -> str:
    if text is None:
        return "snapshot"
    if text not in ("snapshot", "tier", "commitlog"):
        raise ConfigError(f"`tierlog kv rebuild --from {text}`: rebuild starts from snapshot, tier or commitlog")
    return text

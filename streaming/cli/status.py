"""``tierlog status``: per-queue offsets and lag, the sinks' progress and health, the safepoint."""

from __future__ import annotations

import logging
import os
import sys

from connectors.errors import ConfigError, TierlogError
from connectors.sinks import FILTER_OF
from streaming import config as cfg
from connectors.commitlog.errors import DeletedBeforeReadError
from connectors.tier.errors import NotFoundInTier
from state import gaps
from streaming.cli.found import open_metadata
from streaming.cli.output import emit
from streaming.settings import Settings, derive

log = logging.getLogger("tierlog")


STATUS_COLUMNS = ["topic", "queue", "dispatch", "commit", "sealed", "low", "lag", "segments"]
TABLE_COLUMNS = ["table", "kind", "tier_seq", "lag_messages", "lag_s", "through_phy"]


def queue_lag(settings: Settings, source_end: int | None, cap_bytes: int = 256 << 20) -> tuple[dict, int, bool]:
    """Per-queue messages not yet tiered, from the commitlog past ``source_end``; and the frontier."""
    lag: dict = {}
    with settings.reader.open(check_crc=False) as reader:
        start = source_end if source_end is not None else reader.first_offset()
        frontier = reader.end_offset(start)
        end = reader.scan(start, max_bytes=cap_bytes).end
        for batch in reader.record_batches(start, end, key_property=settings.reader.key_property):
            for t, q, qo in zip(batch["topic"].to_pylist(), batch["queue_id"].to_pylist(), batch["queue_offset"].to_pylist()):
                lag[(t, q)] = max(lag.get((t, q), -1), qo)
    return lag, frontier, end < frontier


def cmd_status(args, conf: cfg.Config) -> int:
    settings = derive(conf)
    if args.watch is None:
        return show_status(args, settings)
    import time

    if args.watch <= 0:
        raise ConfigError(f"--watch {args.watch}: the refresh interval must be positive seconds")
    done = 0
    while args.count is None or done < args.count:
        if args.format == "table":
            if done or sys.stdout.isatty():
                print("\x1b[H\x1b[2J", end="")  # cursor home, clear screen: redraw in place
            print(f"tierlog status every {args.watch:g} s, {time.strftime('%H:%M:%S')} (Ctrl-C stops)\n")
        show_status(args, settings)
        sys.stdout.flush()
        done += 1
        if args.count is None or done < args.count:
            time.sleep(args.watch)
    return 0


def show_status(args, settings: Settings) -> int:
    from streaming.plan import enabled_sinks, safepoint

    store = open_metadata(settings)
    topic = getattr(args, "topic", None)
    try:
        queues = store.queues(topic, getattr(args, "limit", None))
        if topic is not None and not queues:
            raise NotFoundInTier.topic(topic, f"the metadata store at {store.path}",
                                       sorted({q.topic for q in store.queues()}))
        sinks, source_end = store.journal.sinks(), store.source_end()
        health, skipped, filtered = store.journal.health(), store.journal.skipped(), store.filtered()
        skipped_ranges = store.quarantined()
        held = store.feed.held() if store.feed.listed_from() is not None else (None, None)
    finally:
        store.close()
    gap_list = gaps.gaps(skipped_ranges)
    acks = gaps.acknowledged(settings.paths.state)
    gap_rows = [{"start_phy": g["start_phy"], "end_phy": g["end_phy"], "bytes": g["end_phy"] - g["start_phy"],
                 "found": _iso(g["at"]) if g.get("at") else None, "acknowledged": str(g["start_phy"]) in acks}
                for g in gap_list]
    quarantined = [{k: v for k, v in q.items() if k != "at"} for q in skipped_ranges if q not in gap_list]
    try:
        newest, frontier, capped = queue_lag(settings, source_end)
    except TierlogError as exc:
        newest, frontier, capped = {}, None, False
        log.warning("commitlog not readable for lag: %s", exc)
    rows = []
    for q in queues:
        pending = newest.get((q.topic, q.queue_id), q.commit - 1) + 1 - q.commit
        rows.append({"topic": q.topic, "queue": q.queue_id, "dispatch": q.dispatch, "commit": q.commit,
                     "sealed": q.sealed, "low": q.low, "lag": f">={pending}" if capped else max(0, pending),
                     "segments": q.segments})
    point = safepoint(settings, sinks)
    room = _headroom(settings, point if point is not None else source_end)
    summary = {"broker": settings.broker, "tiered_to_phy": source_end, "commitlog_end_phy": frontier,
               "lag_bytes": None if frontier is None or source_end is None else frontier - source_end,
               "safepoint": point, "headroom_bytes": None if room is None else room.bytes,
               "headroom_s": None if room is None or room.seconds is None else round(room.seconds),
               "headroom_at_risk": None if room is None else room.at_risk,
               "held_batches": held[0], "held_bytes": held[1],
               "sinks": sinks, "queues": len(queues), "quarantined": len(quarantined),
               "gaps": sum(1 for g in gap_rows if not g["acknowledged"])}
    sink_rows = [{"sink": name, "applied_phy": sinks.get(name),
                  "state": health[name]["state"] if name in health else "ok",
                  "since": _iso(health[name]["since"]) if name in health else None,
                  "skipped": sum(1 for x in skipped if x["sink"] == name),
                  "filtered": _filtered_text(filtered.get(FILTER_OF.get(name, name), {})),
                  "error": health.get(name, {}).get("error")} for name in _shown_sinks(enabled_sinks(settings), sinks)]
    tables = _table_lag(settings)
    if args.format == "json":
        emit([{"kind": "queue", **r} for r in rows] + [{"kind": "sink", **r} for r in sink_rows]
             + [{**r, "table_kind": r["kind"], "kind": "table"} for r in tables]
             + [{"kind": "skipped", **x} for x in skipped]
             + [{"kind": "quarantined", **q} for q in quarantined]
             + [{"kind": "gap", **g} for g in gap_rows]
             + [{"kind": "summary", **summary}], "json")
    else:
        emit(rows, "table", STATUS_COLUMNS)
        print()
        emit(sink_rows, "table")
        print()
        if tables:
            typed = ["unreadable_bodies"] if any("unreadable_bodies" in t for t in tables) else []
            emit(tables, "table", TABLE_COLUMNS + typed)  # a JSON topic's bodies that are not JSON objects
            print()
        if quarantined:
            print("quarantined (corrupt commitlog ranges skipped under commitlog.on_corrupt = quarantine):")
            emit(quarantined, "table")
            print()
        if gap_rows:
            print("gaps (commitlog ranges deleted before tierlog read them, skipped under source.on_missing = skip):")
            emit(gap_rows, "table")
            print()
        shown = {k: v for k, v in summary.items() if k not in ("sinks", "headroom_bytes", "headroom_s", "headroom_at_risk")}
        emit([{**shown, "headroom": _headroom_text(room)}], "table")
    if room is not None and room.below(settings.headroom_warn_fraction, settings.headroom_warn_s):
        log.warning(room.warning())
    if summary["gaps"]:
        print(f"tierlog: {summary['gaps']} commitlog range(s) were deleted before tierlog read them (gaps above): "
              "their messages are not in the tier, the KV view or Kafka. Once you have dealt with them, "
              "`tierlog gap ack` acknowledges them and `status` exits 0 again", file=sys.stderr)
        return DeletedBeforeReadError.exit_code
    return 0


def cmd_gap(args, conf: cfg.Config) -> int:
    """``tierlog gap ack``: acknowledge every recorded gap, so ``status`` exits 0 again."""
    settings = derive(conf)
    store = open_metadata(settings)
    try:
        found = gaps.gaps(store.quarantined())
    finally:
        store.close()
    new = gaps.acknowledge(settings.paths.state, found)
    emit([{"start_phy": g["start_phy"], "end_phy": g["end_phy"], "bytes": g["end_phy"] - g["start_phy"]}
          for g in new], args.format)
    log.info("%d gap(s) acknowledged now, %d before", len(new), len(found) - len(new))
    return 0


def _headroom_text(room) -> str | None:
    """The headroom as a person reads it: how much the broker's retention may delete before it
    reaches what tierlog has not read, or that it cannot reach it at all."""
    if room is None:
        return None
    if not room.at_risk:
        return "not at risk (unread data only in the file being written)"
    if room.bytes < 0:
        return f"none: {-room.bytes:,} bytes were deleted unread"
    hours = "" if room.seconds is None else f", {room.seconds / 3600:.1f} h"
    return f"{room.bytes:,} bytes{hours} of older files"


def _headroom(settings: Settings, needed: int | None):
    """The commitlog's headroom for ``needed`` (``connectors.commitlog.headroom``), None when unknown."""
    from connectors.commitlog.headroom import headroom

    if needed is None:
        return None
    try:
        with settings.reader.open(check_crc=False) as reader:
            return headroom(reader, needed)
    except TierlogError as exc:
        log.warning("commitlog not readable for its headroom: %s", exc)
        return None


def _shown_sinks(enabled: list[str], recorded: dict) -> list[str]:
    """The sinks this configuration runs, then any other that has recorded progress (the demo's
    Kafka sinks, whose embedded broker its config file no longer names), so none is hidden."""
    return enabled + sorted(name for name in recorded if name not in enabled)


def _table_lag(settings: Settings) -> list[dict]:
    """Each Iceberg table's lag behind the tier ([tables] enabled), or none when they are off."""
    tables = settings.tables
    if tables is None:
        return []
    from connectors.tables.catalog import sqlite_file
    from streaming.cli.tables import table_rows

    file = sqlite_file(tables.catalog_uri)
    if file is not None and not os.path.exists(file):
        return []  # no table yet; status reads, so it must not make the catalog

    try:
        return table_rows(settings)
    except Exception as exc:  # status shows the rest whatever the catalog does
        log.warning("the Iceberg tables could not be read for their lag (catalog %s): %s: %s", tables.catalog_uri,
                    type(exc).__name__, exc)
        return []


def _filtered_text(by_class: dict[str, int]) -> str:
    """``system=12 retry=3``: messages a sink's topic filter left out, by topic class."""
    return " ".join(f"{cls}={n}" for cls, n in sorted(by_class.items())) or "0"


def _iso(epoch_s: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(epoch_s, dt.timezone.utc).isoformat(timespec="seconds")

"""``tierlog status``: per-queue offsets and lag, the sinks' progress and health, the safepoint."""

from __future__ import annotations

import logging
import sys

from connectors.errors import ConfigError, TierlogError
from connectors.sinks import FILTER_OF
from streaming import config as cfg
from connectors.tier.errors import NotFoundInTier
from streaming.cli.found import open_metadata
from streaming.cli.output import emit

log = logging.getLogger("tierlog")


STATUS_COLUMNS = ["topic", "queue", "dispatch", "commit", "sealed", "low", "lag", "segments"]
TABLE_COLUMNS = ["table", "kind", "tier_seq", "lag_segments", "through_phy"]


def queue_lag(conf: cfg.Config, source_end: int | None, cap_bytes: int = 256 << 20) -> tuple[dict, int, bool]:
    """Per-queue messages not yet tiered, from the commitlog past ``source_end``; and the frontier."""
    from streaming.settings import reader_options

    lag: dict = {}
    with reader_options(conf).open(check_crc=False) as reader:
        start = source_end if source_end is not None else reader.first_offset()
        frontier = reader.end_offset(start)
        end = reader.scan(start, max_bytes=cap_bytes).end
        for batch in reader.record_batches(start, end, key_property=conf.commitlog.key_property):
            for t, q, qo in zip(batch["topic"].to_pylist(), batch["queue_id"].to_pylist(), batch["queue_offset"].to_pylist()):
                lag[(t, q)] = max(lag.get((t, q), -1), qo)
    return lag, frontier, end < frontier


def cmd_status(args, conf: cfg.Config) -> int:
    if args.watch is None:
        return show_status(args, conf)
    import time

    if args.watch <= 0:
        raise ConfigError(f"--watch {args.watch}: the refresh interval must be positive seconds")
    done = 0
    while args.count is None or done < args.count:
        if args.format == "table":
            if done or sys.stdout.isatty():
                print("\x1b[H\x1b[2J", end="")  # cursor home, clear screen: redraw in place
            print(f"tierlog status every {args.watch:g} s, {time.strftime('%H:%M:%S')} (Ctrl-C stops)\n")
        show_status(args, conf)
        sys.stdout.flush()
        done += 1
        if args.count is None or done < args.count:
            time.sleep(args.watch)
    return 0


def show_status(args, conf: cfg.Config) -> int:
    from streaming.plan import enabled_sinks, safepoint

    store = open_metadata(conf)
    topic = getattr(args, "topic", None)
    try:
        queues = store.queues(topic, getattr(args, "limit", None))
        if topic is not None and not queues:
            topics = sorted({q.topic for q in store.queues()})
            there = f"topics: {', '.join(topics)}" if topics else "it holds no queue yet"
            raise NotFoundInTier(f"no topic {topic!r} in the metadata store at {store.path}; {there}")
        sinks, source_end = store.sinks(), store.source_end()
        health, skipped, filtered = store.health(), store.skipped(), store.filtered()
        quarantined = [{k: v for k, v in q.items() if k != "at"} for q in store.quarantined()]
    finally:
        store.close()
    try:
        newest, frontier, capped = queue_lag(conf, source_end)
    except TierlogError as exc:
        newest, frontier, capped = {}, None, False
        log.warning("commitlog not readable for lag: %s", exc)
    rows = []
    for q in queues:
        pending = newest.get((q.topic, q.queue_id), q.commit - 1) + 1 - q.commit
        rows.append({"topic": q.topic, "queue": q.queue_id, "dispatch": q.dispatch, "commit": q.commit,
                     "sealed": q.sealed, "low": q.low, "lag": f">={pending}" if capped else max(0, pending),
                     "segments": q.segments})
    summary = {"broker": conf.broker.name, "tiered_to_phy": source_end, "commitlog_end_phy": frontier,
               "lag_bytes": None if frontier is None or source_end is None else frontier - source_end,
               "safepoint": safepoint(conf, sinks), "sinks": sinks, "queues": len(queues),
               "quarantined": len(quarantined)}
    sink_rows = [{"sink": name, "applied_phy": sinks.get(name),
                  "state": health[name]["state"] if name in health else "ok",
                  "since": _iso(health[name]["since"]) if name in health else None,
                  "skipped": sum(1 for x in skipped if x["sink"] == name),
                  "filtered": _filtered_text(filtered.get(FILTER_OF.get(name, name), {})),
                  "error": health.get(name, {}).get("error")} for name in _shown_sinks(enabled_sinks(conf), sinks)]
    tables = _table_lag(conf)
    if args.format == "json":
        emit([{"kind": "queue", **r} for r in rows] + [{"kind": "sink", **r} for r in sink_rows]
             + [{**r, "table_kind": r["kind"], "kind": "table"} for r in tables]
             + [{"kind": "skipped", **x} for x in skipped]
             + [{"kind": "quarantined", **q} for q in quarantined]
             + [{"kind": "summary", **summary}], "json")
    else:
        emit(rows, "table", STATUS_COLUMNS)
        print()
        emit(sink_rows, "table")
        print()
        if tables:
            emit(tables, "table", TABLE_COLUMNS)
            print()
        if quarantined:
            print("quarantined (corrupt commitlog ranges skipped under commitlog.on_corrupt = quarantine):")
            emit(quarantined, "table")
            print()
        emit([{k: v for k, v in summary.items() if k != "sinks"}], "table")
    return 0


def _shown_sinks(enabled: list[str], recorded: dict) -> list[str]:
    """The sinks this configuration runs, then any other that has recorded progress (the demo's
    Kafka sinks, whose embedded broker its config file no longer names), so none is hidden."""
    return enabled + sorted(name for name in recorded if name not in enabled)


def _table_lag(conf: cfg.Config) -> list[dict]:
    """Each Iceberg table's lag behind the tier ([tables] enabled), or none when they are off."""
    from streaming.settings import tables

    settings = tables(conf)
    if settings is None:
        return []
    from streaming.cli.tables import table_rows

    try:
        return table_rows(conf, settings)
    except Exception as exc:  # status shows the rest whatever the catalog does
        log.warning("the Iceberg tables could not be read for their lag (catalog %s): %s: %s", settings.catalog_uri,
                    type(exc).__name__, exc)
        return []


def _filtered_text(by_class: dict[str, int]) -> str:
    """``system=12 retry=3``: messages a sink's topic filter left out, by topic class."""
    return " ".join(f"{cls}={n}" for cls, n in sorted(by_class.items())) or "0"


def _iso(epoch_s: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(epoch_s, dt.timezone.utc).isoformat(timespec="seconds")

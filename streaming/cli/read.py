"""Reading the tier from the command line: ``get``, ``key``, ``offset-for-time``, ``queues``."""

from __future__ import annotations

import logging
from typing import Iterator

from connectors.errors import TierlogError
from streaming import config as cfg
from streaming.cli.found import open_kv, open_reader
from streaming.cli.inspect import INSPECT_COLUMNS
from streaming.cli.output import emit, ms_to_iso, parse_time, parsed_body
from streaming.settings import Settings, derive

log = logging.getLogger("tierlog")


def _message_rows(table, fmt: str, settings: Settings) -> Iterator[dict]:
    """Arrow message rows as the CLI prints them: store and born times in epoch ms (ISO in tables);
    in JSON lines, a JSON topic's body parsed too (``value``)."""
    for row in table.to_pylist():
        row["properties"] = dict(row["properties"] or [])
        for col in ("born_ts", "store_ts"):
            ms = round(row[col].timestamp() * 1000)
            row[col] = ms_to_iso(ms) if fmt == "table" else ms
        if fmt == "json":
            row.update(parsed_body(row["body"], settings.body_formats.typed(row["topic"])))
        yield row


def cmd_get(args, conf: cfg.Config) -> int:
    from connectors.tier.reader import GetStatus

    s = derive(conf)
    reader = open_reader(s, args.read_broker, args.topic)
    result = reader.get(args.topic, args.queue, args.offset, args.max)
    where = f"queue {args.topic}/{args.queue}"
    if result.status is GetStatus.NO_QUEUE:
        raise TierlogError(f"the tier at {s.paths.tier} has no {where}: `tierlog queues --topic {args.topic}` "
                           "lists its queues")
    if result.status is GetStatus.OFFSET_TOO_SMALL:
        raise TierlogError(f"offset {args.offset} of {where} is below the lowest retained offset {result.low} "
                           f"(retention or expiry removed it): start at {result.low}")
    if result.status is GetStatus.OFFSET_OVERFLOW_BADLY:
        raise TierlogError(f"offset {args.offset} of {where} is past its commit offset {result.commit}: "
                           f"the tier holds {result.low}..{result.commit - 1}")
    emit(_message_rows(result.messages, args.format, s), args.format,
         INSPECT_COLUMNS if args.format == "table" else None)
    log.info("%d message(s); next offset %d (commit offset %d)", result.messages.num_rows, result.next_offset,
             result.commit)
    return 0


def cmd_key(args, conf: cfg.Config) -> int:
    begin = parse_time(args.since) if args.since else None
    end = parse_time(args.until) if args.until else None
    s = derive(conf)
    table = open_reader(s, args.read_broker, args.topic).by_key(args.topic, args.key, begin, end)
    emit(_message_rows(table, args.format, s), args.format, INSPECT_COLUMNS if args.format == "table" else None)
    log.info("%d message(s) with key %r in topic %s in the tier", table.num_rows, args.key, args.topic)
    if args.latest:
        _print_latest(s, args.topic, args.key)
    return 0


def _print_latest(settings: Settings, topic: str, key: str) -> None:
    """The key's latest value from the local KV view, which is ahead of the tier's history."""
    import os

    if not os.path.isdir(settings.paths.kv):
        log.warning("no local KV view at %s (compaction runs with `tierlog run` on this host): "
                    "the newest message above is the latest the tier holds", settings.paths.kv)
        return
    with open_kv(settings) as kv:
        entry = kv.get(topic, key)
    if entry is None:
        log.info("latest (KV view): %s/%s has no value (never written, deleted or expired)", topic, key)
    else:
        log.info("latest (KV view): physical offset %d, queue %d offset %d, %d byte(s)", entry.phy_offset,
                 entry.queue_id, entry.queue_offset, len(entry.body))


def cmd_offset_for_time(args, conf: cfg.Config) -> int:
    ts = parse_time(args.timestamp)
    s = derive(conf)
    reader = open_reader(s, args.read_broker, args.topic)
    state = reader.committed_for_queue(args.topic, args.queue)
    if state.state_of((args.topic, args.queue)) is None:
        raise TierlogError(f"the tier at {s.paths.tier} has no queue {args.topic}/{args.queue}")
    offset = reader.offset_for_time(args.topic, args.queue, ts, args.boundary, state)
    emit([{"broker": state.log.broker, "topic": args.topic, "queue_id": args.queue, "timestamp": ms_to_iso(ts), "boundary": args.boundary,
           "offset": offset}], args.format)
    return 0


def cmd_queues(args, conf: cfg.Config) -> int:
    import dataclasses

    s = derive(conf)
    infos = open_reader(s, args.read_broker, args.topic).queue_infos(topic=args.topic)
    rows = [dataclasses.asdict(i) for i in infos[: args.limit]]
    if not emit(rows, args.format, ["broker", "topic", "queue_id", "low", "commit", "sealed", "segments", "bytes"]):
        log.info("the tier at %s holds no queue yet", s.paths.tier)
    return 0

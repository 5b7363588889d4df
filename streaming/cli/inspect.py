"""``tierlog commitlog inspect``: the records of the commitlog as they are on disk, or a summary per topic."""

from __future__ import annotations

import logging
import time
from typing import Iterator

from connectors.commitlog.errors import DeletedBeforeReadError
from connectors.commitlog.reader import directory_problem
from connectors.errors import ConfigError
from streaming import config as cfg
from streaming.cli.output import emit, ms_to_iso

log = logging.getLogger("tierlog")


INSPECT_COLUMNS = ["phy_offset", "topic", "queue_id", "queue_offset", "key", "tags", "op", "store_ts", "size", "body"]


def cmd_inspect(args, conf: cfg.Config) -> int:
    from streaming.settings import derive

    s = derive(conf)
    if args.from_queue_offset is not None and (args.topic is None or args.queue is None):
        raise ConfigError("inspect --from-queue-offset needs --topic and --queue")
    problem = directory_problem(s.paths.commitlog)  # the same words as run's and config check's
    if problem is not None:
        raise ConfigError(problem[1])
    with s.reader.open(on_corrupt="fail") as reader:
        if args.from_phy is not None:
            _check_start(reader, args.from_phy)
        if args.summary:
            emit(_topic_summary(reader, args, s.filters), args.format, SUMMARY_COLUMNS)
            return 0
        rows = _inspect_rows(reader, args, s.reader.key_property)
        emit(rows, args.format, INSPECT_COLUMNS if args.format == "table" else None)
    return 0


def _check_start(reader, offset: int) -> None:
    """``--from-phy`` must be where a record starts: a usage error names the records around it."""
    first, end = reader.first_offset(), reader.end_offset()
    if offset < first:
        # Not a usage error: the offset was real (a log line, a checkpoint) until retention deleted it.
        raise DeletedBeforeReadError(f"--from-phy {offset}: the commitlog files below physical offset {first} "
                                     f"were deleted before they were read (the broker's retention); start at "
                                     f"{first}, the first retained record, or later")
    if offset >= end:
        raise ConfigError(f"--from-phy {offset} is at or past the end of the commitlog's data, at {end} (the "
                          f"first retained record is at {first}); nothing is stored there yet")
    start, size = reader.record_at(offset)
    if start != offset:
        raise ConfigError(f"--from-phy {offset} is inside the record that starts at {start} ({size} bytes): "
                          f"records start at {start} and {start + size}; give one of those")


SUMMARY_COLUMNS = ["topic", "class", "messages", "not_dispatched", "bytes", "tier", "compaction", "mirror"]


def _topic_summary(reader, args, filters: dict) -> list[dict]:
    """Per topic: its class, messages (and transaction halves or rollbacks that never enter a
    queue), bytes, and whether each sink takes it under the effective [topics] settings."""
    import pyarrow as pa

    from connectors.commitlog.arrow import dispatched_mask
    from connectors.commitlog.topics import topic_class

    totals: dict[str, list[int]] = {}
    start, end = (reader.first_offset() if args.from_phy is None else args.from_phy), reader.end_offset()
    next_report = time.monotonic() + 5
    for batch in reader.record_batches(start, end, columns=["topic", "sysflag", "size", "phy_offset"]):
        table = pa.table({"topic": batch.column("topic"), "size": batch.column("size").cast(pa.int64()),
                          "entered": dispatched_mask(batch.column("sysflag")).cast(pa.int64())})
        grouped = table.group_by("topic").aggregate([("entered", "sum"), ("entered", "count"), ("size", "sum")])
        for topic, n_in, n, size in zip(*(grouped[c].to_pylist() for c in
                                          ("topic", "entered_sum", "entered_count", "size_sum"))):
            t = totals.setdefault(topic, [0, 0, 0])
            t[0], t[1], t[2] = t[0] + n_in, t[1] + n - n_in, t[2] + size
        if time.monotonic() >= next_report:
            log.info("summary: read %d of %d bytes", batch.column("phy_offset")[-1].as_py() - start, end - start)
            next_report = time.monotonic() + 5
    return [{"topic": topic, "class": topic_class(topic), "messages": m, "not_dispatched": nd, "bytes": b,
             **{sink: "yes" if f.accepts(topic) else "no" for sink, f in filters.items()}}
            for topic, (m, nd, b) in sorted(totals.items())]


def _inspect_rows(reader, args, key_property: str) -> Iterator[dict]:
    shown = 0
    for m in reader.messages(args.from_phy):
        if args.topic is not None and m.topic != args.topic:
            continue
        if args.queue is not None and m.queue_id != args.queue:
            continue
        if args.from_queue_offset is not None and m.queue_offset < args.from_queue_offset:
            continue
        yield {
            "topic": m.topic, "queue_id": m.queue_id, "queue_offset": m.queue_offset, "phy_offset": m.phy_offset,
            "msg_id": m.msg_id, "key": m.key(key_property), "tags": m.tags, "body": m.body,
            "properties": m.properties, "born_ts": m.born_ts, "store_ts": m.store_ts,
            "born_host": m.born_host, "store_host": m.store_host, "sysflag": m.sysflag, "flag": m.flag,
            "reconsume_times": m.reconsume_times, "op": m.op, "prepared_tx_offset": m.prepared_tx_offset,
            "size": m.size,
        } | ({"store_ts": ms_to_iso(m.store_ts)} if args.format == "table" else {})
        shown += 1
        if shown >= args.limit:
            return

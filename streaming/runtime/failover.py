"""Is ``commitlog.dir`` still the log the tier was made from?  The check behind failing over to
a replica.

A RocketMQ master and its replicas hold the same bytes at the same physical offsets, so when a
replica takes over, tierlog may go on from its commitlog exactly where the tier ended.  Every
batch record of the tier names its last record: physical offset, size and the CRC-32 of its
bytes (the stager's fingerprint, ``connectors.tier.staging.stage``).  On every start the commitlog must hold those same bytes
there; then each query goes on from its own checkpoint, its offsets meaning the same in either
log.  The check is one record's read, so it runs whether or not ``commitlog.dir`` changed.

It refuses, naming the offset, when the log

* ends before the tier's last record, or before where a query's checkpoint got: the replica is
  behind (wait until it has caught up, then start again);
* holds other bytes there: it is not this broker's log, or it is a replica that was behind the
  old master and has written other messages since (a lost tail).  Tiering it would skip or mix
  messages, so nothing is written.
"""

from __future__ import annotations

import logging
import zlib

from connectors.commitlog.errors import DeletedBeforeReadError
from connectors.commitlog.reader import CommitLogReader, ReaderOptions
from connectors.errors import TierlogError

log = logging.getLogger("tierlog.service")


class ReplicaMismatchError(TierlogError):
    """``commitlog.dir`` does not hold what the tier committed last (another log, or behind)."""

    exit_code = 5


def check_commitlog(options: ReaderOptions, last_record: dict | None, committed: dict[str, int],
                    moved_from: str | None = None) -> None:
    """Refuse (``ReplicaMismatchError``) unless the commitlog ``options`` name holds ``last_record``'s
    bytes and reaches every query's committed end (``committed``: query -> physical offset).
    ``moved_from``: the commitlog the checkpoints were made on, when it is another directory (a
    failover).  The walk reads as the queries do: it passes a record ``on_corrupt`` quarantines, and
    under ``on_missing = "skip"`` files deleted before a query read them are a gap the queries record
    and pass, not a refusal.

    What is read: the tier's last record, then the records from it up to the furthest query's
    end (what the queries are ahead of the tier by), never the log past them: a corrupt record
    there is the queries' to meet, after they have taken everything before it.
    """
    commitlog_dir, broker, on_missing = options.directory, options.broker, options.on_missing
    what = f"commitlog.dir {commitlog_dir!r}" + (f" (the checkpoints were made on {moved_from!r})" if moved_from else "")
    needed = {q: e for q, e in committed.items() if e is not None}
    with options.open(check_crc=False, on_missing="fail") as reader:
        start = None  # a record boundary the log is known to hold, to walk on from
        gap = False  # files a query has yet to read are gone, and on_missing = skip goes on past them
        if last_record is not None:
            phy, size = last_record["phy"], last_record["size"]
            needed["tiering"] = max(needed.get("tiering", 0), phy + size)
            data = reader.read_bytes(phy, size)
            files = reader.files()
            if data is None and files and phy < files[0].base:
                if moved_from:
                    raise ReplicaMismatchError(
                        f"{what} no longer holds physical offset {phy}, where the tier's last committed record is, "
                        "so it cannot be checked to be a replica of the same broker: point commitlog.dir at a "
                        "replica that still has that file"
                    )
                gap = _deleted_before_read(what, files, needed, on_missing)
                if not gap:
                    log.info("commitlog.dir no longer holds the tier's last committed record (physical offset %d): its "
                             "file was deleted after every query had read it (by `tierlog commitlog gc` or the "
                             "broker's retention, below the safepoint), as expected; not checked", phy)
            elif data is None or not any(data):  # not there yet: a replica catching up
                _behind(what, broker, _end(reader, phy), "tiering", phy + size)
            elif zlib.crc32(data) != last_record["crc32"]:
                raise ReplicaMismatchError(
                    f"{what} holds other bytes at physical offset {phy} ({size} bytes) than the record broker "
                    f"{broker!r}'s tier committed last there: it is not a copy of that broker's log, or a replica "
                    "that was behind the old master and has written other messages since (a lost tail). Nothing "
                    "was written; point commitlog.dir at a replica holding the tier's messages, or start a new "
                    "tier for this log"
                )
            else:
                start = phy
        if needed:
            gap = gap or _deleted_before_read(what, reader.files(), needed, on_missing)
            if gap:  # the queries go on from the oldest retained file
                needed = {q: max(e, reader.first_offset()) for q, e in needed.items()}
            target = max(needed.values())
            # Walked as a live log, not as a range known to be complete: a replica still catching up
            # ends in zeros (RocketMQ pre-allocates its files) before the target, which is "behind",
            # not corruption; the byte limit keeps the walk from reading past the target.
            end = reader.scan(start, max_bytes=target - start).end if start is not None else reader.end_offset()
            behind = {q: e for q, e in needed.items() if e > end}
            if behind:
                query, at = max(behind.items(), key=lambda kv: kv[1])
                _behind(what, broker, end, query, at)
    if moved_from and start is not None:
        log.warning("commitlog.dir moved from %s to %s: it holds the tier's last committed record at physical "
                    "offset %d byte for byte; going on from there", moved_from, commitlog_dir, start)


def _deleted_before_read(what: str, files, needed: dict[str, int], on_missing: str) -> bool:
    """Refuse when a file a query has yet to read is gone: everything from where the query goes on to
    the oldest retained file was deleted unread (the broker's retention outran tierlog).  Under
    ``on_missing = "skip"`` say so, and go on (True): the queries record the range as a gap."""
    if not files:
        return False
    query, resume = min(needed.items(), key=lambda kv: kv[1])
    first = files[0]
    if resume >= first.base:
        return False
    if on_missing == "skip":
        log.warning("%s: physical offsets %d to %d (%s bytes) were deleted before tierlog read them (the broker's "
                    "retention outran it); under source.on_missing = skip the queries record that range as a gap "
                    "and go on from %d. `tierlog status` reports it until `tierlog gap ack`",
                    what, resume, first.base, f"{first.base - resume:,}", first.base)
        return True
    raise DeletedBeforeReadError(
        f"{what}: physical offsets {resume} to {first.base} ({first.base - resume:,} bytes) were deleted before "
        f"tierlog read them. The {query} query goes on from {resume}, and the oldest retained file, {first.path}, "
        "starts above it: the broker's retention (fileReservedTime) outran tierlog, and the messages in that "
        "range are lost to it. Nothing was written. To go on from the oldest retained file, recording the range "
        "as a gap that `tierlog status` reports until `tierlog gap ack`, run `tierlog run --on-missing skip` (or "
        "set source.on_missing = \"skip\"); or restore the files from a replica first. Keep the broker's retention "
        "longer than tierlog can fall behind: `tierlog status` shows the headroom"
    )


def _end(reader: CommitLogReader, at_least: int) -> int:
    """The log's end, for the message; ``at_least`` when the walk to it fails."""
    try:
        return reader.end_offset()
    except TierlogError:
        return at_least


def _behind(what: str, broker: str, end: int, query: str, at: int) -> None:
    raise ReplicaMismatchError(
        f"{what} ends at physical offset {end}, but broker {broker!r}'s {query} query got to {at}: the log is "
        "behind. If it is a replica catching up, wait until it has passed that offset and start again; tierlog "
        "writes nothing until then"
    )

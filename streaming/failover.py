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

from connectors.commitlog.reader import CommitLogReader
from connectors.errors import TierlogError

log = logging.getLogger("tierlog.service")


class ReplicaMismatchError(TierlogError):
    """``commitlog.dir`` does not hold what the tier committed last (another log, or behind)."""


def check_commitlog(commitlog_dir: str, broker: str, last_record: dict | None, committed: dict[str, int],
                    moved_from: str | None = None, on_corrupt: str = "fail") -> None:
    """Refuse (``ReplicaMismatchError``) unless ``commitlog_dir`` holds ``last_record``'s bytes and
    reaches every query's committed end (``committed``: query -> physical offset).  ``moved_from``:
    the commitlog the checkpoints were made on, when it is another directory (a failover).
    ``on_corrupt``: ``commitlog.on_corrupt``, so a walk passes a quarantined record as the queries do.

    What is read: the tier's last record, then the records from it up to the furthest query's
    end (what the queries are ahead of the tier by), never the log past them: a corrupt record
    there is the queries' to meet, after they have taken everything before it.
    """
    what = f"commitlog.dir {commitlog_dir!r}" + (f" (the checkpoints were made on {moved_from!r})" if moved_from else "")
    needed = {q: e for q, e in committed.items() if e is not None}
    with CommitLogReader(commitlog_dir, on_corrupt=on_corrupt) as reader:
        start = None  # a record boundary the log is known to hold, to walk on from
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
                log.info("commitlog.dir no longer holds the tier's last committed record (physical offset %d): "
                         "its file was deleted below the safepoint; not checked", phy)
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

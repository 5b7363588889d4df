"""How far the broker's retention is from what tierlog still has to read: the headroom.

A broker deletes its oldest commitlog files first (RocketMQ's ``fileReservedTime``, 72 h by default,
or disk pressure), never the file it is writing.  tierlog still needs everything from its lowest
unread position (the safepoint: the lowest offset a query or sink goes on from).  The headroom is
what the broker can delete before it deletes a byte tierlog needs: the files below the one holding
that position, in bytes and in store time (how much older the oldest retained file's first message
is than that file's).  When the position is in the file being written, the broker cannot delete it:
``at_risk`` is False whatever the figures say.
"""

from __future__ import annotations

from dataclasses import dataclass

from connectors.commitlog.reader import CommitLogReader


@dataclass(frozen=True)
class Headroom:
    needed: int  # tierlog's lowest unread physical offset
    oldest: int  # where the oldest retained file starts
    bytes: int  # what the broker deletes before the file holding ``needed``
    seconds: float | None  # the same in store time; None when a file's first record cannot be read
    retained_bytes: int  # from the oldest retained file to the end of the log
    at_risk: bool  # the file holding ``needed`` is not the one being written: retention can reach it

    def below(self, fraction: float, seconds: float) -> bool:
        """Whether the headroom is under ``fraction`` of the retained bytes, or under ``seconds``."""
        if not self.at_risk:
            return False
        return self.bytes < fraction * self.retained_bytes or (self.seconds is not None and self.seconds < seconds)

    def warning(self) -> str:
        if self.needed < self.oldest:
            return (f"physical offsets {self.needed} to {self.oldest} were deleted before tierlog read them: the "
                    "broker's retention outran it (source.on_missing decides what happens next)")
        seconds = "" if self.seconds is None else f", {self.seconds / 3600:.1f} h of store time"
        return (f"the broker's retention is close to what tierlog has yet to read: {self.bytes:,} bytes{seconds} "
                f"of commitlog lie below the file holding physical offset {self.needed}, of "
                f"{self.retained_bytes:,} retained. Once retention deletes past it, those messages are lost to "
                "tierlog: let it catch up, or keep the broker's fileReservedTime longer")


def headroom(reader: CommitLogReader, needed: int, end: int | None = None) -> Headroom | None:
    """The headroom of ``reader``'s log for ``needed``; None for an empty log.  A ``needed`` below the
    oldest file is a negative headroom: those bytes are already gone.  ``end``: the log's end as a
    walk found it moments ago (the service passes the tiering query's), else walked to here."""
    files = reader.files()
    if not files:
        return None
    oldest = files[0]
    end = reader.end_offset() if end is None else end
    holding = next((f for f in reversed(files) if f.base <= needed), oldest)
    active = next((f for f in reversed(files) if f.base < end), oldest)  # the file being written
    seconds = None
    if needed >= oldest.base:
        first_ts, needed_ts = _first_store_ts(reader, oldest.base), _first_store_ts(reader, holding.base)
        if first_ts is not None and needed_ts is not None:
            seconds = max(0.0, (needed_ts - first_ts) / 1000)
    return Headroom(needed=needed, oldest=oldest.base, bytes=holding.base - oldest.base if needed >= oldest.base
                    else needed - oldest.base, seconds=seconds, retained_bytes=end - oldest.base,
                    at_risk=needed < oldest.base or holding.base < active.base)


def _first_store_ts(reader: CommitLogReader, base: int) -> int | None:
    try:
        return next((m.store_ts for m in reader.messages(base, max_records=1)), None)
    except Exception:  # noqa: BLE001 - a figure for a gauge: an unreadable first record leaves it unknown
        return None

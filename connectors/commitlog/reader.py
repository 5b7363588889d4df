"""Tail-safe reading of a commitlog directory.

The reader may run while a writer (tierlog's own, or a RocketMQ broker) is
appending.  Its contract:

* it returns only complete records; a record still being written (a torn
  tail) is not a message yet and is left for a later call;
* corrupt data (bad magic, impossible size, a CRC mismatch, a record that is
  not where its own PHYSICALOFFSET says) raises :class:`CorruptRecordError`
  naming the file and the physical offset; nothing is skipped, unless the
  reader was made with ``on_corrupt="quarantine"``: then it resumes at the
  next whole record (the same one for every reader of the same bytes) and
  lists the skipped range in ``quarantined``;
* physical offsets are the one address space of §3 and §8: ``scan`` and
  ``spans`` resume strictly at the offset they are given, which must be a
  record boundary, a blank marker or a file start.

Telling a torn tail from corruption: a bad record is a torn tail only when it
is the last thing in the log, i.e. nothing but zero bytes follows where it
ends and no later file holds data.  The last complete record is also checked
against its body CRC, because a broker copies records into its mapped file
front to back and a reader can catch the copy half done.  So a corrupt last
record of the log that could be such a copy is held back, not reported; once
anything is written after it, it is reported.  A record whose TOTALSIZE
disagrees with its own fields is reported at that record, not where the wrong
size led the walk (``tests/test_commitlog_properties.py`` checks every byte).

It is longer than most modules because the file walk, the roll between files,
the live end and corruption handling are one state machine over the same
cursor; split, each part would need the others' invariants restated.
"""

from __future__ import annotations

import bisect
import mmap
import os
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np

from connectors.brokers import DEFAULT_BROKER
from connectors.commitlog import format as fmt
from connectors.commitlog.boundaries import Boundaries, place_splits
from connectors.commitlog.errors import (CorruptRecordError, DeletedBeforeReadError, LogLayoutError,
                                         OffsetOutOfRangeError)

if TYPE_CHECKING:
    import pyarrow as pa

_FILE_NAME = re.compile(r"^\d{20}$")
_ZERO8 = bytes(8)
TAIL_WINDOW = 1 << 20  # bytes after a suspect record checked for later data
SETTLE_S = 1.0  # how long a suspect record on the live frontier must stay unchanged to be corruption
# Pages a walk leaves behind in its file before they are let go (``CommitLogReader._let_go_below``).
RELEASE_STEP = 16 << 20
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)  # Linux; elsewhere pages stay until the file is unmapped
ON_CORRUPT = ("fail", "quarantine")
ON_MISSING = ("fail", "skip")
# The reason a range deleted before it was read is quarantined with under on_missing = "skip": the
# mark of a gap (``is_gap``), which `tierlog status` reports until `tierlog gap ack`.
DELETED_UNREAD = "deleted before it was read (source.on_missing = skip)"


@dataclass(frozen=True)
class Quarantined:
    """A corrupt range ``[start, end)`` of physical offsets that a ``quarantine`` reader skipped."""

    file: str
    start: int
    end: int
    reason: str

    def to_json(self) -> dict:
        return {"file": self.file, "start_phy": self.start, "end_phy": self.end, "reason": self.reason}


@dataclass(frozen=True)
class MappedFile:
    """One file of the log: its start offset (from its name), path and length on disk."""

    base: int
    path: str
    length: int

    @property
    def end(self) -> int:
        return self.base + self.length


def directory_problem(path: str) -> tuple[str, str] | None:
    """Why ``path`` is not a commitlog directory to read (setting ``commitlog.dir``), or None: (kind,
    one line), kind ``missing``, ``file``, ``layout``, ``store`` (a broker's ``store/``, the parent
    of its commitlog) or ``empty``.  A missing or empty one is the likeliest mistake against a real
    broker, whose commitlog is ``store/commitlog``."""
    if not os.path.exists(path):
        return "missing", (f"commitlog.dir {path!r} does not exist: point it at the broker's store/commitlog, "
                           "or make one with `tierlog produce`")
    if not os.path.isdir(path):
        return "file", f"commitlog.dir {path!r} is not a directory"
    try:
        files = list_files(path)
    except LogLayoutError as exc:
        return "layout", f"commitlog.dir {path!r}: {exc}"
    if files:
        return None
    if os.path.isdir(os.path.join(path, "commitlog")):
        return "store", (f"commitlog.dir {path!r} holds no commitlog files, but a commitlog/ directory: it looks "
                         f"like a broker's store/; point commitlog.dir at {os.path.join(path, 'commitlog')!r}")
    return "empty", (f"commitlog.dir {path!r} holds no commitlog files (files named by their 20-digit offset, "
                     "like 00000000000000000000): point it at the broker's store/commitlog, or fill it with "
                     "`tierlog produce`")


def list_files(directory: str) -> list[MappedFile]:
    """The mapped files in ``directory``, in offset order, checked to be contiguous.

    Files whose names are not 20 digits (locks, checkpoints) are ignored.
    Raises :class:`LogLayoutError` when a name is not the end of its
    predecessor, so a missing or misnamed file is never read across.
    """
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    files = sorted(
        (MappedFile(int(e.name), e.path, e.stat().st_size) for e in entries if _FILE_NAME.match(e.name)),
        key=lambda f: f.base,
    )
    for prev, cur in zip(files, files[1:]):
        if cur.base != prev.end:
            raise LogLayoutError(
                f"commitlog file {cur.path} does not follow {prev.path}: a file of "
                f"{prev.length} bytes starting at {prev.base} should be followed by "
                f"{fmt.file_name(prev.end)}. A file is missing, misnamed or was resized."
            )
    return files


def _walk(buf, pos: int, limit: int, length: int, records_left: int, bytes_left: int, take_first: bool, span):
    """The hot loop: step over well-formed message headers from ``pos`` towards ``limit``.

    Appends each record to ``span`` and returns ``(pos, nbytes, limited)``:
    where it stopped, the bytes it stepped over, and whether a record or byte
    limit stopped it.  Anything that is not a plausible message header (blank,
    zeros, garbage) also stops it, for the caller to classify.
    """
    unpack = fmt._SIZE_MAGIC.unpack_from
    v1, v2, smallest = fmt.MAGIC_V1, fmt.MAGIC_V2, fmt.MIN_RECORD_SIZE
    cap = length - fmt.END_FILE_MIN_BLANK_LENGTH  # every record leaves 8 bytes in its file
    add_start, add_size = span.starts.append, span.sizes.append
    nbytes = 0
    stop_at = min(limit, cap)
    while pos < stop_at:
        if records_left == 0:
            return pos, nbytes, True
        size, magic = unpack(buf, pos)
        if (magic != v1 and magic != v2) or size < smallest or size > cap - pos:
            break
        if nbytes + size > bytes_left and not take_first:
            return pos, nbytes, True
        take_first = False
        add_start(pos)
        add_size(size)
        pos += size
        nbytes += size
        records_left -= 1
    return pos, nbytes, False


@dataclass
class Span:
    """Complete records found in one file: positions relative to ``file.base``."""

    file: MappedFile
    starts: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    end: int = 0  # physical offset where reading resumes after this span

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)


@dataclass(frozen=True)
class ScanResult:
    """What ``scan`` found: where to resume, how many records and bytes lie before it."""

    start: int
    end: int
    records: int
    nbytes: int
    # Record boundaries at least ``split_bytes`` apart, file starts included: where to cut partitions.
    splits: tuple[int, ...] = ()


def cut(start: int, splits: Sequence[int], end: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut at ``splits`` (a scan's), as ``(start, end)`` pieces, none empty."""
    cuts = [start, *splits, end]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


@dataclass(frozen=True)
class ReaderOptions:
    """How one broker's commitlog is read: the one object every reader of it is built from (the
    stagers, the source, the gap checks, the compaction and mirror handlers, the CLI), made once
    from the settings (``streaming.settings``).  ``open`` a reader with them, overriding a field
    only where a reader needs less (no CRC check for a header walk that decodes no body)."""

    directory: str
    check_crc: bool = True
    on_corrupt: str = "fail"
    broker: str = DEFAULT_BROKER
    key_property: str = "KEYS"  # for the Arrow rows' key column: pass it to ``record_batches``
    on_missing: str = "fail"

    def open(self, **overrides) -> "CommitLogReader":
        o = {"check_crc": self.check_crc, "on_corrupt": self.on_corrupt, "broker": self.broker,
             "on_missing": self.on_missing, **overrides}
        return CommitLogReader(self.directory, **o)


class CommitLogReader:
    """Reads complete records from a commitlog directory.  Not thread-safe; cheap to create."""

    def __init__(self, directory: str, *, check_crc: bool = True, on_corrupt: str = "fail",
                 broker: str = DEFAULT_BROKER, on_missing: str = "fail"):
        if on_corrupt not in ON_CORRUPT:
            raise ValueError(f"on_corrupt must be one of {ON_CORRUPT}, not {on_corrupt!r}")
        if on_missing not in ON_MISSING:
            raise ValueError(f"on_missing must be one of {ON_MISSING}, not {on_missing!r}")
        self.directory = directory
        self.on_missing = on_missing
        self.broker = broker  # the name every Arrow row carries
        self.check_crc = check_crc
        self.on_corrupt = on_corrupt
        self.quarantined: list[Quarantined] = []  # what this reader skipped, in the order it met them
        self._maps: dict[str, mmap.mmap] = {}
        self._released: dict[str, int] = {}  # per mapped file: its pages below this were let go
        self._frontier: int | None = None  # the last frontier a walk reached
        self._boundaries = Boundaries()  # the records the last walks found, for the next scan

    # ------------------------------------------------------------ files

    def files(self) -> list[MappedFile]:
        files = list_files(self.directory)
        # Let go of files gc deleted: while mapped, a deleted file keeps its disk space and its pages in
        # this process, for as long as the reader lives.
        present = {f.path for f in files}
        self._unmap([p for p in self._maps if p not in present])
        return files

    @property
    def frontier(self) -> int | None:
        """The log's end as this reader's last walk to it found it (no walk); None before one."""
        return self._frontier

    def first_offset(self) -> int:
        files = self.files()
        return files[0].base if files else 0

    def close(self) -> None:
        self._unmap(list(self._maps))

    def _unmap(self, paths: list[str]) -> None:
        for path in paths:
            self._released.pop(path, None)
            try:
                self._maps.pop(path).close()
            except BufferError:
                pass  # an Arrow or numpy view (a stager's bodies) still points into it; freed with the last view

    def __enter__(self) -> "CommitLogReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _map(self, f: MappedFile) -> mmap.mmap:
        mm = self._maps.get(f.path)
        if mm is None or len(mm) < f.length:
            if mm is not None:
                self._unmap([f.path])  # grown: mapped again; a view into the old mapping keeps it
            with open(f.path, "rb") as fh:
                mm = mmap.mmap(fh.fileno(), f.length, access=mmap.ACCESS_READ)
            self._maps[f.path] = mm
            self._released.pop(f.path, None)
        return mm

    def _let_go_below(self, files: list[MappedFile], idx: int | None, offset: int) -> None:
        """Let go of the mapped pages below ``offset``, where a walk starts (in ``files[idx]``, as
        ``_locate`` found it; None: at the log's end): files wholly below it are
        unmapped, and its own file's pages below it dropped from this process (``MADV_DONTNEED``),
        every ``RELEASE_STEP`` bytes.  The page cache keeps them; a later read maps them again.

        Why: a long-lived reader (the tiering query's lag, the service's headroom check, the source's
        planning) walks forward only, and each page it touched stayed in the process's resident
        memory until the broker deleted the file: a quiet broker's driver grew 13.5 MB a minute,
        twice the append rate, and a busy broker's retained commitlog would all be counted in it."""
        below = files if idx is None else files[:idx]
        self._unmap([f.path for f in below if f.path in self._maps])
        f = None if idx is None else files[idx]
        mm = None if f is None else self._maps.get(f.path)
        if mm is None or _DONTNEED is None:
            return
        upto = (offset - f.base) // mmap.PAGESIZE * mmap.PAGESIZE
        if upto - self._released.get(f.path, 0) >= RELEASE_STEP:
            mm.madvise(_DONTNEED, 0, upto)
            self._released[f.path] = upto

    # ------------------------------------------------------------ walking

    def _locate(self, files: list[MappedFile], offset: int) -> int | None:
        """Index of the file holding ``offset``; None when ``offset`` is the end of the last file."""
        if not files:
            if offset == 0:
                return None
            raise OffsetOutOfRangeError(f"physical offset {offset}: the commitlog {self.directory} is empty")
        if offset < files[0].base:
            raise DeletedBeforeReadError(
                f"physical offset {offset} is below the first retained commitlog file "
                f"{files[0].path}: those messages were deleted before they were read (the broker's retention "
                "outran tierlog). `tierlog run --on-missing skip` goes on from that file, recording the range as "
                "a gap that `tierlog status` reports until `tierlog gap ack`"
            )
        if offset >= files[-1].end:
            if offset == files[-1].end:
                return None  # the writer has not created the next file yet
            raise OffsetOutOfRangeError(
                f"physical offset {offset} is beyond the end of the commitlog ({files[-1].end}, "
                f"file {files[-1].path}): was the log replaced?"
            )
        return bisect.bisect_right([f.base for f in files], offset) - 1

    def _holds_data(self, f: MappedFile) -> bool:
        """False for a file a broker pre-created and has not written to yet (all zeros at its start)."""
        return f.length >= 8 and self._map(f)[:8] != _ZERO8

    def _later_data(self, files: list[MappedFile], idx: int) -> bool:
        """Does any file after ``files[idx]`` hold a record?"""
        return any(self._holds_data(f) for f in files[idx + 1 :])

    def _is_tail(self, files: list[MappedFile], idx: int, after: int) -> bool:
        """True when only zeros follow file position ``after``: in a window of the file, and in later files.

        The window (``TAIL_WINDOW``) bounds the cost of the check at the frontier,
        which runs on every poll; a zeroed region larger than it, followed by data,
        reads as the frontier and holds the reader there instead of skipping it.
        """
        f = files[idx]
        window = np.frombuffer(self._map(f), np.uint8, count=max(0, min(TAIL_WINDOW, f.length - after)), offset=min(after, f.length))
        return not window.any() and not self._later_data(files, idx)

    def _fail(self, f: MappedFile, pos: int, reason: str, size: int | None = None) -> CorruptRecordError:
        return CorruptRecordError(f.path, f.base + pos, reason, size)

    def _frontier_ok(self, f: MappedFile, pos: int) -> bool:
        """Is the last record before the frontier complete?  A broker copies it in front to back."""
        buf = self._map(f)
        try:
            # Whether it is whole, not whether its body inflates: a bad body is corruption, not a tail.
            m = fmt.decode(buf, pos, check_crc=True, expect_phy=f.base + pos, inflate=False)
        except fmt.RecordError:
            return False
        # The CRC covers only the body: check the bytes after it were copied too.  Serialized
        # properties always end in \x02 (§7), and a topic never ends in a NUL byte.
        last = buf[pos + m.size - 1]
        if m.properties or last:
            return last == 2
        return not m.topic or buf[pos + m.size - 3] != 0

    def spans(
        self,
        start: int,
        end: int | None = None,
        *,
        max_records: int | None = None,
        max_bytes: int | None = None,
        taken: tuple[int, int] = (0, 0),
    ) -> Iterator[Span]:
        """Yield spans of complete records from ``start`` up to ``end`` (or the frontier).

        With ``end`` the range is taken as known-complete (a previous scan found
        it) and must end on a record boundary.  ``max_records``/``max_bytes``
        stop early; at least one record is returned when any is available,
        unless ``taken`` (records, bytes) were taken towards the limits before ``start``.
        """
        files = self.files()
        if self.on_missing == "skip" and files and start < files[0].base:
            # Deleted before it was read: skipped like a quarantined range, so every reader of the
            # same bytes skips the same range and the tier records it (a gap).
            gap_end = files[0].base if end is None else min(files[0].base, end)
            self._quarantine(MappedFile(0, self.directory, 0), start, gap_end, DELETED_UNREAD)  # absolute offsets
            if gap_end == end:
                return
            start = files[0].base
        idx = self._locate(files, start)
        self._let_go_below(files, idx, start)
        records_left = max_records - taken[0] if max_records is not None else -1  # -1 never reaches 0
        bytes_left = max_bytes - taken[1] if max_bytes is not None else 1 << 62
        pos_abs = start
        while idx is not None:
            f = files[idx]
            pos = pos_abs - f.base
            limit = f.length if end is None else min(f.length, end - f.base)
            span = Span(f)
            while True:
                take_first = records_left == max_records if max_records is not None else bytes_left == max_bytes
                found = len(span.starts)
                pos, nbytes, limited = _walk(
                    self._map(f), pos, limit, f.length, records_left, bytes_left, take_first or max_bytes is None, span
                )
                records_left -= len(span.starts) - found
                bytes_left -= nbytes
                if limited:
                    stop = "limit"
                elif pos >= limit:
                    if pos > limit:
                        raise OffsetOutOfRangeError(
                            f"physical offset {end} is not a record boundary: the record at "
                            f"{f.base + span.starts[-1]} in {f.path} runs past it"
                        )
                    stop = "range"
                else:
                    try:
                        misread = self._missized(f, span.starts[-1], span.sizes[-1]) if span.starts else None
                        if misread is not None:
                            # The walk stepped by a corrupt TOTALSIZE: the fault is that record, not
                            # wherever the wrong size led.
                            span.sizes.pop()
                            pos = span.starts.pop()
                            raise self._fail(f, pos, misread)
                        stop = self._classify_stop(files, idx, pos, end is not None)
                    except CorruptRecordError as exc:
                        if self.on_corrupt != "quarantine":
                            raise
                        resume = self._resync(f, pos)
                        if resume > limit:
                            raise  # a range read as complete must end where the scan that found it resumed
                        self._quarantine(f, pos, resume, exc.reason)
                        pos = resume
                        if pos < f.length:
                            continue  # walk on from the next good record
                        stop = "blank" if idx + 1 < len(files) else "range"  # the rest of the file is gone
                break
            if stop == "tail" and span.starts and self._is_tail(files, idx, pos):
                if not self._frontier_ok(f, span.starts[-1]):
                    pos -= span.sizes.pop()
                    span.starts.pop()
            span.end = f.base + pos
            idx_next = None
            if stop == "blank" and (end is None or f.end < end) and idx + 1 < len(files):
                span.end = f.end
                idx_next = idx + 1
            if span.starts or span.end != pos_abs:
                yield span
            pos_abs = span.end
            idx = idx_next

    def _missized(self, f: MappedFile, pos: int, size: int) -> str | None:
        """Why the record at ``pos`` (the last one the walk stepped over, or the one it stopped at) is
        corrupt, when its TOTALSIZE disagrees with its own fields and those fields make a whole
        record; None otherwise.

        The walk trusts TOTALSIZE, so a corrupt one leads it into the middle of later records, or
        past the end of the log into zeros (where it would pass for a record still being written).
        A record a broker is still copying front to back disagrees with its fields too, while they
        are half written, but in one way only: its unwritten fields read as zero, so they imply a
        smaller size, and every byte from that size to TOTALSIZE, and the header after it, is still
        zero (it is the last record of the log).  A corrupt last record of the log that looks like
        that is held back as a tail (the module docstring says why).  Checked once per stop of the
        walk, not per record, so the walk's cost is unchanged.
        """
        buf = self._map(f)
        implied = fmt.implied_size(buf, pos)
        if implied is None or implied == size or pos + implied > f.length:
            return None
        if implied < size and not any(buf[pos + implied : min(f.length, pos + size + fmt.END_FILE_MIN_BLANK_LENGTH)]):
            return None  # a copy in progress (nothing follows it either), or indistinguishable from one
        record = bytearray(buf[pos : pos + implied])
        record[:4] = implied.to_bytes(4, "big")
        try:
            m = fmt.decode(record, 0, check_crc=True, expect_phy=f.base + pos, inflate=False)
        except fmt.RecordError:
            return None
        # As _frontier_ok: serialized properties end in \x02, and a topic never ends in a NUL byte.
        if not m.topic or m.topic.endswith("\x00") or (m.properties and record[-1] != 2):
            return None
        return f"TOTALSIZE {size} does not match its fields (expected {implied})"

    def _classify_stop(self, files: list[MappedFile], idx: int, pos: int, known_complete: bool) -> str:
        """Why the fast walk stopped at ``pos``: "blank", "tail" (the frontier), or raise corruption.

        On the live frontier a writer may be mid-append: its later bytes can be
        visible before the header at ``pos``.  So a suspect record there is
        corruption only if it looks the same after ``SETTLE_S``; if its bytes
        change meanwhile, it is the tail, and is read on a later call.

        It is looked at again at once and then every 20 ms: a writer that published between two
        reads of this check (zeros read at ``pos``, then its record's later bytes) makes a healthy
        frontier look corrupt for an instant.  Waiting out ``SETTLE_S`` for that held each query's
        planning for a whole second about every 20 s at 10k messages/s.
        """
        try:
            return self._classify_once(files, idx, pos, known_complete)
        except CorruptRecordError:
            if known_complete:
                raise
            f = files[idx]
            before = self._map(f)[pos : pos + 64]
            deadline = time.monotonic() + SETTLE_S
            while True:
                # Listed afresh (a file may have rolled or been collected meanwhile), so found again by name.
                fresh = list_files(self.directory)
                now = next((i for i, g in enumerate(fresh) if g.path == f.path), None)
                if now is None:
                    raise
                try:
                    return self._classify_once(fresh, now, pos, known_complete)
                except CorruptRecordError:
                    if time.monotonic() >= deadline:
                        raise
                if self._map(f)[pos : pos + 64] != before or fresh[-1].base != files[-1].base:
                    return "tail"
                time.sleep(0.02)

    def _classify_once(self, files: list[MappedFile], idx: int, pos: int, known_complete: bool) -> str:
        f = files[idx]
        if f.length - pos < 8:
            if idx == len(files) - 1 and not known_complete:
                return "tail"  # a file still growing
            raise self._fail(f, pos, f"{f.length - pos} bytes at the end of a file without a blank marker")
        size, magic = fmt.read_size_magic(self._map(f), pos)
        if magic == fmt.BLANK_MAGIC:
            if size != f.length - pos:
                raise self._fail(f, pos, f"blank marker claims {size} bytes but {f.length - pos} remain", size)
            return "blank"
        if size == 0:
            if known_complete or not self._is_tail(files, idx, pos):
                raise self._fail(f, pos, "zero bytes where a record should be, and data follows later")
            return "tail"
        if self._pending_append(f, pos, size, magic):
            if known_complete:
                raise self._fail(f, pos, "an append its writer never finished, inside a range read as complete", size)
            return "tail"  # its writer publishes it next, or zeroes it when it restarts
        plausible = fmt.MIN_RECORD_SIZE <= size <= f.length - pos
        if magic in (fmt.MAGIC_V1, fmt.MAGIC_V2) and size <= f.length - pos - fmt.END_FILE_MIN_BLANK_LENGTH and plausible:
            return "tail"  # published since the walk looked: the next call reads it
        misread = self._missized(f, pos, size) if plausible and magic in (fmt.MAGIC_V1, fmt.MAGIC_V2) else None
        if misread is not None:  # a TOTALSIZE that claims the records after it, up to where zeros begin
            raise self._fail(f, pos, misread, size)
        if not known_complete and self._is_tail(files, idx, pos + size if plausible else pos + 8):
            return "tail"
        if magic in (fmt.MAGIC_V1, fmt.MAGIC_V2):
            raise self._fail(f, pos, f"impossible TOTALSIZE {size} ({f.length - pos} bytes left in the file)", size)
        raise self._fail(f, pos, f"unknown magic code 0x{magic:08X}", size)

    def _resync(self, f: MappedFile, pos: int) -> int:
        """Where reading resumes past corruption at ``pos``: the first later position in ``f`` holding a
        whole record that says it lies there and whose body CRC matches; the file's length if none."""
        buf = self._map(f)
        best = f.length
        for magic in (fmt.MAGIC_V1, fmt.MAGIC_V2):
            needle = magic.to_bytes(4, "big")
            at = buf.find(needle, pos + 1 + fmt.POS_MAGIC)
            while at != -1 and at - fmt.POS_MAGIC < best:
                p = at - fmt.POS_MAGIC
                try:
                    m = fmt.decode(buf, p, check_crc=True, expect_phy=f.base + p)
                    if p + m.size <= f.length - fmt.END_FILE_MIN_BLANK_LENGTH:
                        best = p
                        break
                except fmt.RecordError:
                    pass
                at = buf.find(needle, at + 1)
        return best

    def _skip_corrupt(self, f: MappedFile, pos: int, size: int, reason: str) -> int:
        """Quarantine the record at ``pos`` that failed its checks after the walk stepped over it by its
        TOTALSIZE ``size``; where the good records after it begin.  A wrong TOTALSIZE that happens to
        land on a later record boundary steps over whole good records: those are read, not skipped."""
        resume = min(self._resync(f, pos), pos + size)
        self._quarantine(f, pos, resume, reason)
        return resume

    def _quarantine(self, f: MappedFile, start: int, end: int, reason: str) -> None:
        """Note a skipped range (file positions) once; one next to the last one extends it."""
        start, end = f.base + start, f.base + end
        if any(q.start <= start < q.end for q in self.quarantined):
            return  # met again by a second walk over the same range
        last = self.quarantined[-1] if self.quarantined else None
        if last is not None and last.file == f.path and last.end == start:
            self.quarantined[-1] = Quarantined(f.path, last.start, end, last.reason)
        else:
            self.quarantined.append(Quarantined(f.path, start, end, reason))

    def _pending_append(self, f: MappedFile, pos: int, size: int, magic: int) -> bool:
        """Is the record at ``pos`` an append its writer has not published yet?

        tierlog's writer first writes a batch with its first TOTALSIZE negated,
        then the real TOTALSIZE.  A producer killed in between leaves that
        pending record (its next start zeroes it).  The negated size must match
        the record's own fields and its stored offset its position, so
        corruption is never mistaken for it.
        """
        if size >= 0 or magic not in (fmt.MAGIC_V1, fmt.MAGIC_V2) or -size > f.length - pos:
            return False
        buf = self._map(f)
        return fmt.implied_size(buf, pos) == -size and fmt.stored_phy_offset(buf, pos) == f.base + pos

    def scan(
        self,
        start: int,
        end: int | None = None,
        *,
        max_records: int | None = None,
        max_bytes: int | None = None,
        split_bytes: int | None = None,
    ) -> ScanResult:
        """Walk record headers from ``start`` to ``end``, the frontier or a limit; no body is decoded.
        Records this reader walked before are not walked again (``connectors.commitlog.boundaries``)."""
        splits: list[int] = []
        records = nbytes = since_split = 0
        resume = start
        kept = self._boundaries.take(self._kept_path(start), start, end, max_records, max_bytes)
        if kept is not None:
            starts, sizes, go_on = kept
            since_split = place_splits(starts, sizes, 0, split_bytes, splits)
            records, nbytes = len(starts), int(sizes.sum())
            resume = start + nbytes
            if not go_on:
                return ScanResult(start, resume, records, nbytes, tuple(s for s in splits if start < s < resume))
        for span in self.spans(resume, end, max_records=max_records, max_bytes=max_bytes, taken=(records, nbytes)):
            if span.file.base > start and (not splits or splits[-1] != span.file.base):
                splits.append(span.file.base)
                since_split = 0
            starts = np.asarray(span.starts, dtype=np.int64) + span.file.base
            sizes = np.asarray(span.sizes, dtype=np.int64)
            since_split = place_splits(starts, sizes, since_split, split_bytes, splits)
            self._boundaries.add(span.file.path, starts, sizes)
            records += len(starts)
            nbytes += int(sizes.sum())
            resume = span.end
        if end is None and max_records is None and max_bytes is None:
            self._frontier = resume  # walked to the frontier: later polls start here
        return ScanResult(start, resume, records, nbytes, tuple(s for s in splits if start < s < resume))

    def _kept_path(self, offset: int) -> str | None:
        """The path of the file the kept boundaries are in, if they hold ``offset`` and the file is
        still there; what a walk from ``offset`` lets go of is let go of here too."""
        kept = self._boundaries
        if kept.path is None or not kept.first <= offset < kept.end:
            return None
        files = self.files()
        idx = self._locate(files, offset) if files and files[0].base <= offset < files[-1].end else None
        if idx is None or files[idx].path != kept.path or files[idx].end < kept.end:
            return None
        self._let_go_below(files, idx, offset)
        return kept.path

    def messages(
        self, start: int | None = None, end: int | None = None, *, max_records: int | None = None
    ) -> Iterator[fmt.Message]:
        """Decode messages one by one (the slow, simple path: CLI, oracle, recovery)."""
        start = self.first_offset() if start is None else start
        for span in self.spans(start, end, max_records=max_records):
            buf = self._map(span.file)
            for pos, size in zip(span.starts, span.sizes):
                try:
                    yield fmt.decode(buf, pos, check_crc=self.check_crc, expect_phy=span.file.base + pos)
                except fmt.RecordError as exc:
                    if self.on_corrupt != "quarantine":
                        raise self._fail(span.file, pos, exc.reason, exc.size) from None
                    resume = self._skip_corrupt(span.file, pos, size, exc.reason)
                    yield from self.messages(span.file.base + resume, span.file.base + pos + size)

    def record_batches(
        self,
        start: int,
        end: int | None = None,
        *,
        batch_rows: int = 16384,
        key_property: str = "KEYS",
        columns: "Sequence[str] | None" = None,
        body_views: bool = False,
    ) -> Iterator["pa.RecordBatch"]:
        """The Arrow fast path: records in ``[start, end)`` as batches of the message row.

        ``columns`` limits the batches to those columns of the row (all by default);
        ``body_views``: bodies as views into the mapped file (``arrow.decode_batch``).
        """
        for span in self.spans(start, end):
            buf = self._map(span.file)
            for i in range(0, len(span.starts), batch_rows):
                starts = np.asarray(span.starts[i : i + batch_rows], np.int64)
                yield from self._decode(span.file, buf, starts, span.sizes[i : i + batch_rows],
                                        dict(key_property=key_property, check_crc=self.check_crc, columns=columns,
                                             broker=self.broker, body_views=body_views))

    def _decode(self, f: MappedFile, buf, starts: np.ndarray, sizes: list[int], options: dict) -> Iterator["pa.RecordBatch"]:
        """``decode_batch`` of ``starts``; under quarantine, records failing a check are skipped and listed."""
        from connectors.commitlog.arrow import BatchDecodeError, decode_batch

        if not len(starts):
            return
        try:
            yield decode_batch(buf, starts, f.base, **options)
        except BatchDecodeError as exc:
            pos, size = int(starts[exc.index]), sizes[exc.index]
            if self.on_corrupt != "quarantine":
                raise self._fail(f, pos, exc.reason, size) from None
            yield from self._decode(f, buf, starts[: exc.index], sizes[: exc.index], options)
            resume = self._skip_corrupt(f, pos, size, exc.reason)
            for inner in self.spans(f.base + resume, f.base + pos + size):
                yield from self._decode(f, buf, np.asarray(inner.starts, np.int64), inner.sizes, options)
            yield from self._decode(f, buf, starts[exc.index + 1 :], sizes[exc.index + 1 :], options)

    def records_at(self, phy_offsets: "np.ndarray", columns: "Sequence[str]") -> "pa.Table":
        """``columns`` of the records at ``phy_offsets`` (any order, repeats allowed), in that order.

        Each record is re-checked where it lies (magic, size, stored physical
        offset), so a reference into a replaced or moved file fails loudly.
        """
        from connectors.commitlog.arrow import in_given_order

        return in_given_order(*self.records_as_stored(phy_offsets, columns))

    def records_as_stored(self, phy_offsets: "np.ndarray",
                          columns: "Sequence[str]") -> "tuple[pa.Table, np.ndarray]":
        """``records_at``'s records in physical order, and for each, where its offset stands in
        ``phy_offsets``: a caller that can take them in that order spares a copy of the bodies."""
        import pyarrow as pa

        from connectors.commitlog.arrow import BatchDecodeError, decode_batch, project_schema

        phys = np.asarray(phy_offsets, np.int64)
        if len(phys) == 0:
            return project_schema(columns).empty_table(), np.empty(0, np.int64)
        files = self.files()
        order = np.argsort(phys, kind="stable")
        sorted_phys = phys[order]
        file_idx = np.searchsorted([f.base for f in files], sorted_phys, side="right") - 1
        parts = []
        for idx in np.unique(file_idx):
            at = sorted_phys[file_idx == idx]
            if idx < 0 or at[-1] >= files[idx].end:
                bad = int(at[0] if idx < 0 else at[-1])
                raise OffsetOutOfRangeError(
                    f"physical offset {bad} is not in the commitlog {self.directory} any more: "
                    "was it deleted below the safepoint?"
                )
            f = files[idx]
            try:
                parts.append(decode_batch(self._map(f), at - f.base, f.base, columns=columns, broker=self.broker))
            except BatchDecodeError as exc:
                raise self._fail(f, int(at[exc.index] - f.base), exc.reason) from None
        return pa.Table.from_batches(parts), order

    def read_bytes(self, start: int, length: int) -> bytes | None:
        """The ``length`` bytes at physical offset ``start`` (a record's: they never span two
        files), or None when no file holds them all."""
        for f in self.files():
            if f.base <= start and start + length <= f.end:
                return bytes(self._map(f)[start - f.base : start - f.base + length])
        return None

    def record_at(self, offset: int) -> tuple[int, int] | None:
        """The (start, size) of the complete record that holds physical offset ``offset``, found by
        walking its file's record headers from the file's start; None when no record holds it (it
        is in no retained file, or at or past the frontier)."""
        files = self.files()
        if not files or not files[0].base <= offset < files[-1].end:
            return None
        for span in self.spans(files[self._locate(files, offset)].base):
            for pos, size in zip(span.starts, span.sizes):
                start = span.file.base + pos
                if start + size > offset:
                    return (start, size) if start <= offset else None
        return None

    def end_offset(self, hint: int | None = None) -> int:
        """The physical offset just past the last complete record (the frontier).

        The walk starts at the furthest known record boundary inside the last
        file: ``hint``, or the frontier this reader found before, so polling a
        long-lived reader costs only what was appended since.
        """
        files = self.files()
        if not files:
            return 0
        # A broker creates the next file before the current one is full (AllocateMappedFileService):
        # the frontier is in the last file that holds a record, not always in the last file.
        last = len(files) - 1
        while last > 0 and not self._holds_data(files[last]):
            last -= 1
        start = files[last].base
        for known in (hint, self._frontier):
            if known is not None and start < known <= files[-1].end:
                start = known
        return self.scan(start).end

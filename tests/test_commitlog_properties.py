"""Properties of the commitlog reader over every torn tail and every corrupt byte.

The expected messages are always the writer's (what ``CommitLogWriter.append_many`` returned, with
the offsets it gave them), never a replay.  Each example builds a small log of several 4 KiB files
and reads it on both paths: record by record (``messages``) and Arrow (``record_batches``).

*Torn tails*: the last append (its blank marker and its record, when it rolls to a new file) is cut
after any of its bytes, as a broker's front-to-back copy or a kill leaves it.  Nothing of it may be
read as a message, nothing before it may be lost, and then either the copy completes (the record is
read whole) or the writer restarts (it discards the torn bytes and appends where the log ended).

*Corruption*: one byte of one record is changed, for records in every class of position: the first
of the log, the first of a later file, the last before a file's blank marker, the blank marker
itself, one in the middle and the last of the log.  A change to a byte the format can check (size,
magic, body CRC and body, stored offset, the length fields) must be reported at exactly that
record, by both paths, and a quarantining reader must skip exactly that record and lose nothing
else.  A change to a byte the format cannot check (the CRC covers only the body, as in RocketMQ)
may only change that one record.  The last record of the log may instead be held back as a torn
tail: a reader cannot tell a corrupt last record from one being written.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from hypothesis import example, given, settings
from hypothesis import strategies as st

from connectors.commitlog import CommitLogReader, CommitLogWriter, CorruptRecordError, Message
from connectors.commitlog import format as fmt
from connectors.commitlog import reader as reader_module
from connectors.commitlog.arrow import MESSAGE_SCHEMA
from connectors.commitlog.writer import QUEUE_OFFSETS_FILE
from tests.oracle import message_row, normalize_arrow_row

FILE = 4096
EXAMPLES = 200  # each example is a few milliseconds: far more than the profile's default, at little cost


def _message(i: int, body: int) -> Message:
    return Message(topic=f"t{i % 3}", queue_id=i % 2, body=bytes([(i * 7 + j) % 251 for j in range(body)]),
                   properties={"KEYS": f"k{i % 5}", "UNIQ_KEY": f"U{i}"})


bodies = st.lists(st.one_of(st.integers(0, 40), st.integers(200, 1500)), min_size=6, max_size=24)


def _write(directory: str, sizes: list[int], start: int = 0) -> list[Message]:
    with CommitLogWriter(directory, file_size=FILE, fsync="never") as w:
        return w.append_many(_message(start + i, n) for i, n in enumerate(sizes))


def _path(directory: str, phy: int) -> str:
    return os.path.join(directory, fmt.file_name(phy - phy % FILE))


@contextmanager
def _no_settle():
    """No writer runs during these reads, so a suspect record need not be watched for a second
    (``SETTLE_S``) before it is judged: the judgement is the same, only sooner."""
    saved = reader_module.SETTLE_S
    reader_module.SETTLE_S = 0.0
    try:
        yield
    finally:
        reader_module.SETTLE_S = saved


def _read(directory: str, path: str, on_corrupt: str = "fail"):
    """(rows read before any error, the error or None, the reader's quarantined list)."""
    rows, error = [], None
    with CommitLogReader(directory, check_crc=True, on_corrupt=on_corrupt) as r:
        try:
            if path == "messages":
                for m in r.messages():
                    rows.append(message_row(m))
            else:
                for batch in r.record_batches(r.first_offset(), batch_rows=5):
                    table = pa.Table.from_batches([batch], MESSAGE_SCHEMA)
                    for col in ("born_ts", "store_ts"):  # as integers: a corrupt one may lie past datetime's range
                        at = table.schema.get_field_index(col)
                        table = table.set_column(at, col, pc.divide(table[col].cast(pa.int64()), 1000))
                    rows.extend(normalize_arrow_row(row) for row in table.to_pylist())
        except CorruptRecordError as exc:
            error = exc
        return rows, error, list(r.quarantined)


# ------------------------------------------------------------------ torn tails


@dataclass
class _Write:
    path: str
    pos: int
    data: bytes


def _last_append(directory: str, before_end: int, last: Message) -> list[_Write]:
    """The bytes the last append wrote, in the order a front-to-back copy puts them down."""
    writes = []
    if last.phy_offset != before_end:  # it rolled: the blank marker closed the old file first
        base = before_end - before_end % FILE
        writes.append(_Write(os.path.join(directory, fmt.file_name(base)), before_end - base,
                             fmt.blank_record(FILE - (before_end - base))))
    with open(_path(directory, last.phy_offset), "rb") as fh:
        fh.seek(last.phy_offset % FILE)
        writes.append(_Write(_path(directory, last.phy_offset), last.phy_offset % FILE, fh.read(last.size)))
    return writes


def _lay_down(writes: list[_Write], cut: int) -> None:
    """The first ``cut`` bytes of ``writes`` as written, every later byte zero."""
    for w in writes:
        keep = max(0, min(cut, len(w.data)))
        with open(w.path, "r+b") as fh:
            fh.seek(w.pos)
            fh.write(w.data[:keep] + bytes(len(w.data) - keep))
        cut -= len(w.data)


@settings(max_examples=EXAMPLES)
@given(sizes=bodies, last_body=st.integers(0, 2500), cut_at=st.floats(0, 1, exclude_max=True),
       new_file_exists=st.booleans(), then=st.sampled_from(["copy completes", "writer restarts"]))
def test_a_torn_last_append_is_never_a_message_and_loses_nothing_before_it(
        tmp_path_factory, sizes, last_body, cut_at, new_file_exists, then):
    directory = str(tmp_path_factory.mktemp("torn"))
    written = _write(directory, sizes)
    before_end = written[-1].phy_offset + written[-1].size
    with open(os.path.join(directory, QUEUE_OFFSETS_FILE)) as fh:
        checkpoint = json.load(fh)
    (last,) = _write(directory, [last_body], start=len(sizes))
    writes = _last_append(directory, before_end, last)
    total = sum(len(w.data) for w in writes)
    cut = int(cut_at * total)
    _lay_down(writes, cut)
    rolled = len(writes) == 2
    blank_whole = rolled and cut >= len(writes[0].data)
    if rolled and not blank_whole and not new_file_exists:
        os.remove(writes[1].path)  # a crash before the next file was created
    # The queue-offset checkpoint as it was at that moment: the writer records one at a roll, after
    # the blank marker, and at close.
    if blank_whole:
        checkpoint["offset"] = last.phy_offset
    with open(os.path.join(directory, QUEUE_OFFSETS_FILE), "w") as fh:
        json.dump(checkpoint, fh)

    expected = [message_row(m) for m in written]
    for path in ("messages", "arrow"):
        rows, error, _ = _read(directory, path)
        assert error is None and rows == expected, (path, cut, total)
    with CommitLogReader(directory) as r:
        assert r.scan(r.first_offset()).end <= last.phy_offset

    if then == "copy completes":
        if rolled and not os.path.exists(writes[1].path):
            with open(writes[1].path, "wb") as fh:
                fh.truncate(FILE)
        _lay_down(writes, total)
        expected.append(message_row(last))
    else:
        (again,) = _write(directory, [17], start=len(sizes) + 1)
        fits = before_end % FILE + again.size + fmt.END_FILE_MIN_BLANK_LENGTH <= FILE
        # Where the log ended, unless a whole blank marker closed that file or the record needs the next one.
        assert again.phy_offset == (last.phy_offset if blank_whole else before_end if fits
                                    else before_end - before_end % FILE + FILE), (cut, total)
        expected.append(message_row(again))
    for path in ("messages", "arrow"):
        rows, error, _ = _read(directory, path)
        assert error is None and rows == expected, (path, then, cut, total)


# ------------------------------------------------------------------ corruption

CLASSES = ("first of the log", "first of a later file", "last before a blank marker", "blank marker",
           "middle", "last of the log")


def _target(written: list[Message], kind: str, pick: int) -> tuple[int, int, int | None]:
    """(physical offset, size, index in ``written`` or None for a blank marker) of a ``kind`` target."""
    firsts = [i for i, m in enumerate(written) if i and m.phy_offset % FILE == 0]
    lasts = [i - 1 for i in firsts]
    if kind == "first of the log" or (kind in ("first of a later file", "last before a blank marker", "blank marker")
                                      and not firsts):
        i = 0
    elif kind == "first of a later file":
        i = firsts[pick % len(firsts)]
    elif kind == "last before a blank marker":
        i = lasts[pick % len(lasts)]
    elif kind == "blank marker":
        m = written[lasts[pick % len(lasts)]]
        return m.phy_offset + m.size, fmt.END_FILE_MIN_BLANK_LENGTH, None  # its size and magic; zeros follow
    elif kind == "middle":
        i = pick % len(written)
    else:
        i = len(written) - 1
    return written[i].phy_offset, written[i].size, i


def _fields(data: bytes, blank: bool) -> list[tuple[str, int, int, bool]]:
    """The record's fields as (name, first byte, end, whether the format checks it), empty ones left out.

    Bytes are picked a field at a time, so a four-byte TOTALSIZE is hit as often as a long body."""
    if blank:
        return [("blank TOTALSIZE", 0, 4, True), ("blank MAGICCODE", 4, 8, True)]
    sysflag = int.from_bytes(data[fmt.POS_SYSFLAG:fmt.POS_SYSFLAG + 4], "big", signed=True)
    born = fmt.host_width(sysflag, fmt.BORNHOST_V6_FLAG)
    store = fmt.host_width(sysflag, fmt.STOREHOST_V6_FLAG)
    at = fmt.POS_BORN_HOST
    layout = [("TOTALSIZE", 4, True), ("MAGICCODE", 4, True), ("BODYCRC", 4, None), ("QUEUEID", 4, False),
              ("FLAG", 4, False), ("QUEUEOFFSET", 8, False), ("PHYSICALOFFSET", 8, True), ("SYSFLAG", 4, False),
              ("BORNTIMESTAMP", 8, False)]
    fields, pos = [], 0
    for name, width, checked in layout:
        fields.append([name, pos, pos + width, checked])
        pos += width
    assert pos == at
    body_len_at = at + born + 8 + store + 4 + 8
    body_len = int.from_bytes(data[body_len_at:body_len_at + 4], "big", signed=True)
    topic_len_at = body_len_at + 4 + body_len
    topic_len = data[topic_len_at]  # v1 records: a one-byte topic length
    props_len_at = topic_len_at + 1 + topic_len
    fields += [["BORNHOST", at, at + born, False], ["STORETIMESTAMP", at + born, at + born + 8, False],
               ["STOREHOST", at + born + 8, at + born + 8 + store, False],
               ["RECONSUMETIMES", body_len_at - 12, body_len_at - 8, False],
               ["PREPAREDTRANSACTIONOFFSET", body_len_at - 8, body_len_at, False],
               ["BODYLENGTH", body_len_at, body_len_at + 4, True], ["BODY", body_len_at + 4, topic_len_at, True],
               ["TOPICLENGTH", topic_len_at, topic_len_at + 1, True], ["TOPIC", topic_len_at + 1, props_len_at, False],
               ["PROPERTIESLENGTH", props_len_at, props_len_at + 2, True], ["PROPERTIES", props_len_at + 2, len(data), False]]
    fields[2][3] = body_len > 0  # the CRC is checked only for a body
    return [(n, a, b, c) for n, a, b, c in fields if b > a]


@settings(max_examples=EXAMPLES)
@given(sizes=bodies, kind=st.sampled_from(CLASSES), pick=st.integers(0, 1000), field=st.integers(0, 63),
       where=st.floats(0, 1, exclude_max=True), flip=st.integers(1, 255))
def test_a_corrupt_byte_is_named_at_its_record_or_changes_only_that_record(
        tmp_path_factory, sizes, kind, pick, field, where, flip):
    directory = str(tmp_path_factory.mktemp("corrupt"))
    written = _write(directory, sizes)
    at, size, index = _target(written, kind, pick)
    path = _path(directory, at)
    with open(path, "r+b") as fh:
        fh.seek(at % FILE)
        data = fh.read(size)
    fields = _fields(data, index is None)
    name, first, end, must_be_found = fields[field % len(fields)]
    rel = first + int(where * (end - first))
    with open(path, "r+b") as fh:
        fh.seek(at % FILE + rel)
        fh.write(bytes([data[rel] ^ flip]))
    _assert_found_at_its_record_or_only_it_changed(directory, written, at, size, index, must_be_found,
                                                   (kind, name, rel, size))


def _assert_found_at_its_record_or_only_it_changed(directory, written, at, size, index, must_be_found, label):
    """Both paths, failing and quarantining, after the record (or blank marker) at ``at`` was damaged."""
    path = _path(directory, at)
    expected = [message_row(m) for m in written]
    last = index == len(written) - 1
    with _no_settle():
        outcomes = {p: _read(directory, p) for p in ("messages", "arrow")}
        quarantined = {p: _read(directory, p, "quarantine") for p in ("messages", "arrow")}
    for p, (rows, error, _) in outcomes.items():
        where_ = (p, *label)
        if error is not None:
            assert (error.offset, error.file) == (at, path), where_
            assert rows == expected[: len(rows)] and (index is None or len(rows) <= index), where_
        elif last and rows == expected[:-1]:
            pass  # held back as a record still being written
        else:
            assert not must_be_found, ("a checked byte changed unnoticed", where_)
            assert len(rows) == len(expected), where_
            assert [r for i, r in enumerate(rows) if i != index] == [r for i, r in enumerate(expected) if i != index]
            assert rows[index]["phy_offset"] == at, where_
    assert (outcomes["messages"][1] is None) == (outcomes["arrow"][1] is None), "the two paths disagree"

    for p, (rows, error, skipped) in quarantined.items():
        assert error is None, (p, error)
        if outcomes[p][1] is None:
            assert skipped == [] and rows == outcomes[p][0], p
            continue
        # Exactly the corrupt record (for the last record of a file, or its blank marker: the rest of that file).
        (q,) = skipped
        assert (q.file, q.start) == (path, at) and q.end in (at + size, at - at % FILE + FILE), (p, q)
        assert rows == [r for i, r in enumerate(expected) if i != index], p


@settings(max_examples=EXAMPLES)
@given(sizes=bodies, kind=st.sampled_from(CLASSES[:3] + CLASSES[4:]), pick=st.integers(0, 1000),
       change=st.integers(1, FILE), smaller=st.booleans())
# Found in CI: the first record's TOTALSIZE grown by exactly the next record's size lands on a record
# boundary, so the walk goes on; quarantine skipped that good next record along with the bad one.
@example(sizes=[0, 699, 0, 0, 0, 0], kind="first of the log", pick=0, change=812, smaller=False)
def test_a_wrong_totalsize_is_named_at_its_record_not_where_it_leads(tmp_path_factory, sizes, kind, pick, change,
                                                                       smaller):
    """The reader steps from record to record by TOTALSIZE, so a wrong one leads it into later records or
    past the end of the log: every wrong size, larger or smaller, is still reported at its own record."""
    directory = str(tmp_path_factory.mktemp("size"))
    written = _write(directory, sizes)
    at, size, index = _target(written, kind, pick)
    wrong = size - 1 - (change - 1) % (size - 1) if smaller else size + change
    with open(_path(directory, at), "r+b") as fh:
        fh.seek(at % FILE)
        fh.write(wrong.to_bytes(4, "big"))
    _assert_found_at_its_record_or_only_it_changed(directory, written, at, size, index, True, (kind, size, wrong))

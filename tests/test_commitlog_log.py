"""The commitlog directory: writer, tail-safe reader, Arrow fast path, corruption.

One file rather than several because most tests here write with the writer and read back on both
paths (record by record and Arrow), and share those fixtures.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from connectors.commitlog import (
    CommitLogReader,
    CommitLogWriter,
    CorruptRecordError,
    LogLayoutError,
    Message,
    OffsetOutOfRangeError,
    WriterLockedError,
)
from connectors.commitlog import format as fmt
from connectors.commitlog.arrow import MESSAGE_SCHEMA
from connectors.commitlog.reader import SETTLE_S
from tests.oracle import message_row, normalize_arrow_row, replay

FILE = 16 * 1024


def fill(directory: str, n: int, *, file_size: int = FILE, body: int = 100, start: int = 0) -> list[Message]:
    with CommitLogWriter(directory, file_size=file_size, fsync="never") as w:
        return w.append_many(
            Message(
                topic=f"t{i % 3}",
                queue_id=i % 4,
                body=bytes([i % 251]) * (body + i % 7),
                properties={"KEYS": f"k{i % 10} extra", "TAGS": "tag", "UNIQ_KEY": f"U{start + i}"},
            )
            for i in range(start, start + n)
        )


def arrow_rows(directory: str, start: int = 0, end: int | None = None) -> list[dict]:
    with CommitLogReader(directory, check_crc=True) as r:
        table = pa.Table.from_batches(list(r.record_batches(start, end, batch_rows=37)), schema=MESSAGE_SCHEMA)
    return [normalize_arrow_row(row) for row in table.to_pylist()]


# ------------------------------------------------------------------ writer and reader


def test_written_messages_read_back_identically_across_file_rolls(log_dir):
    written = fill(log_dir, 500)
    files = sorted(f for f in os.listdir(log_dir) if f.isdigit())
    assert len(files) > 3 and files[1] == fmt.file_name(FILE)
    assert all(os.path.getsize(os.path.join(log_dir, f)) == FILE for f in files)
    assert replay(log_dir) == [message_row(m) for m in written]
    assert arrow_rows(log_dir) == [message_row(m) for m in written]


def test_queue_offsets_are_dense_per_queue_and_survive_restart(log_dir):
    first = fill(log_dir, 100)
    os.remove(os.path.join(log_dir, ".queue_offsets.json"))  # force recovery by scanning
    second = fill(log_dir, 100, start=100)
    per_queue: dict = {}
    for m in first + second:
        per_queue.setdefault((m.topic, m.queue_id), []).append(m.queue_offset)
    assert all(offsets == list(range(len(offsets))) for offsets in per_queue.values())
    assert [r["queue_offset"] for r in replay(log_dir)] == [m.queue_offset for m in first + second]


def test_prepared_and_rollback_records_take_no_queue_offset(log_dir):
    with CommitLogWriter(log_dir, file_size=FILE) as w:
        a = w.append(Message(topic="t", body=b"a"))
        p = w.append(Message(topic="t", body=b"p", sysflag=fmt.TRANSACTION_PREPARED))
        b = w.append(Message(topic="t", body=b"b", sysflag=fmt.TRANSACTION_COMMIT))
    assert (a.queue_offset, p.queue_offset, b.queue_offset) == (0, 0, 1)


def test_second_writer_is_refused_with_the_holder(log_dir):
    with CommitLogWriter(log_dir, file_size=FILE):
        with pytest.raises(WriterLockedError, match=f"process {os.getpid()}") as exc:
            CommitLogWriter(log_dir, file_size=FILE)
        assert exc.value.retriable


def test_a_bad_message_in_a_batch_writes_nothing(log_dir):
    with CommitLogWriter(log_dir, file_size=FILE) as w:
        with pytest.raises(ValueError):
            w.append_many([Message(topic="t", body=b"ok"), Message(topic="t", properties={"K": "a\x01b"})])
        with pytest.raises(ValueError, match="NUL"):
            w.append_many([Message(topic="t", body=b"ok"), Message(topic="t\x00", body=b"nul")])
        assert w.append(Message(topic="t", body=b"x")).queue_offset == 0
    assert [r["body"] for r in replay(log_dir)] == [b"x"]


def test_message_larger_than_a_file_is_refused(log_dir):
    with CommitLogWriter(log_dir, file_size=FILE) as w, pytest.raises(ValueError, match="cannot fit"):
        w.append(Message(topic="t", body=b"x" * FILE))


def test_scan_limits_and_splits(log_dir):
    written = fill(log_dir, 300)
    with CommitLogReader(log_dir) as r:
        full = r.scan(0, split_bytes=4000)
        assert full.records == 300 and full.nbytes == sum(m.size for m in written)
        assert all(fmt.file_name(s) for s in full.splits) and FILE in full.splits
        assert r.scan(0, max_records=7).records == 7
        capped = r.scan(0, max_bytes=1000)
        assert capped.nbytes <= 1000 and capped.records == 1000 // written[0].size
        assert r.scan(0, max_bytes=1).records == 1  # always make progress
        mid = written[150].phy_offset
        assert [x["queue_offset"] for x in arrow_rows(log_dir, mid, full.end)] == [m.queue_offset for m in written[150:]]
        assert r.scan(full.end).records == 0


def test_offsets_out_of_range_are_named(log_dir):
    written = fill(log_dir, 300)
    with CommitLogReader(log_dir) as r:
        with pytest.raises(OffsetOutOfRangeError, match="beyond the end"):
            r.scan(10 * FILE)
        with pytest.raises(OffsetOutOfRangeError, match="not a record boundary"):
            list(r.spans(0, written[3].phy_offset + 1))
    os.remove(os.path.join(log_dir, fmt.file_name(0)))
    with CommitLogReader(log_dir) as r, pytest.raises(OffsetOutOfRangeError, match="below the first retained"):
        r.scan(0)


# ------------------------------------------------------------------ torn tails


def _frontier(log_dir: str) -> tuple[str, int, int]:
    with CommitLogReader(log_dir) as r:
        end = r.end_offset()
    base = end - end % FILE
    return os.path.join(log_dir, fmt.file_name(base)), end - base, end


@pytest.mark.parametrize("cut", [3, 4, 8, 40, 120, -1])
def test_torn_tail_is_not_a_message_yet(log_dir, cut):
    written = fill(log_dir, 20)
    path, pos, end = _frontier(log_dir)
    record = fmt.encode(Message(topic="t0", body=b"z" * 200, properties={"A": "b"}, phy_offset=end, store_ts=1))
    torn = record[: cut if cut > 0 else len(record) - 1]
    with open(path, "r+b") as fh:
        fh.seek(pos)
        fh.write(torn)
    assert replay(log_dir) == [message_row(m) for m in written]
    with CommitLogReader(log_dir) as r:
        assert r.scan(0).end == end
    # The writer discards the torn bytes and appends after the last complete record.
    more = fill(log_dir, 5, start=20)
    assert more[0].phy_offset == end
    assert replay(log_dir) == [message_row(m) for m in written + more]


def test_record_copied_front_to_back_is_held_until_complete(log_dir):
    """A broker copies a record into its mapped file front to back; half a body fails the CRC."""
    written = fill(log_dir, 10)
    path, pos, end = _frontier(log_dir)
    record = fmt.encode(Message(topic="t0", body=b"\x07" * 300, phy_offset=end, store_ts=1, born_ts=1))
    with open(path, "r+b") as fh:
        fh.seek(pos)
        fh.write(record[:200])  # header and part of the body, the rest still zero
    assert len(replay(log_dir)) == len(written)
    with open(path, "r+b") as fh:
        fh.seek(pos)
        fh.write(record)
    assert replay(log_dir)[-1]["body"] == b"\x07" * 300


def test_killed_producer_leaves_a_readable_log(log_dir, tmp_path):
    script = textwrap.dedent(
        f"""
        import os, signal
        from connectors.commitlog import CommitLogWriter, Message
        w = CommitLogWriter({log_dir!r}, file_size={FILE}, fsync="never")
        for i in range(300):
            w.append(Message(topic="t", queue_id=i % 2, body=b"b" * 150))
        os.kill(os.getpid(), signal.SIGKILL)  # no close(): no checkpoint of the last file
        """
    )
    subprocess.run([sys.executable, "-c", script], cwd=os.path.dirname(os.path.dirname(__file__)), check=False)
    rows = replay(log_dir)
    assert len(rows) == 300
    with CommitLogWriter(log_dir, file_size=FILE) as w:
        assert w.append(Message(topic="t", queue_id=0, body=b"x")).queue_offset == 150


# ------------------------------------------------------------------ corruption


# (where in the record, the bytes written there, what the reader must say)
CORRUPTIONS = [
    (4, b"\x00\x00\x00\x01", "unknown magic code"),
    (0, b"\x7f\x00\x00\x00", "impossible TOTALSIZE"),
    (100, b"\xff", "CRC mismatch"),
    (28, b"\x00" * 8, "stored physical offset"),
    (2, b"\x01", "does not match its fields"),  # TOTALSIZE 256 too big: the walk would land inside later records
]


def _corrupt(log_dir: str, index: int, rel: int, value: bytes) -> Message:
    written = fill(log_dir, 40)
    target = written[index]
    base = target.phy_offset - target.phy_offset % FILE
    with open(os.path.join(log_dir, fmt.file_name(base)), "r+b") as fh:
        fh.seek(target.phy_offset - base + rel)
        fh.write(value)
    return target


@pytest.mark.parametrize("rel,value,reason", CORRUPTIONS)
def test_corruption_stops_reading_and_names_file_and_offset(log_dir, rel, value, reason):
    target = _corrupt(log_dir, 17, rel, value)
    base = target.phy_offset - target.phy_offset % FILE
    for read in (lambda: replay(log_dir), lambda: arrow_rows(log_dir)):
        with pytest.raises(CorruptRecordError, match=reason) as exc:
            read()
        assert exc.value.offset == target.phy_offset
        assert exc.value.file == os.path.join(log_dir, fmt.file_name(base))
        assert f"physical offset {target.phy_offset}" in str(exc.value)


def test_zeroed_region_before_later_data_is_corruption(log_dir):
    target = _corrupt(log_dir, 5, 0, b"\x00" * 8)
    with pytest.raises(CorruptRecordError, match="zero bytes where a record should be") as exc:
        replay(log_dir)
    assert exc.value.offset == target.phy_offset


def test_a_suspect_frontier_is_judged_in_its_own_file_when_gc_deletes_files_meanwhile(log_dir):
    """The soak found it: the re-check after ``SETTLE_S`` listed the files again but kept the old index,
    so gc deleting the first file meanwhile gave an IndexError that stopped the service (or judged
    another file).  Zeros before later data in the last file stay corruption, named in their file."""
    written = fill(log_dir, 300)
    last_base = written[-1].phy_offset - written[-1].phy_offset % FILE
    victim = next(m for m in written if m.phy_offset >= last_base)  # the first record of the last file
    assert victim is not written[-1]
    path = os.path.join(log_dir, fmt.file_name(last_base))
    with open(path, "r+b") as fh:
        fh.seek(victim.phy_offset - last_base)
        fh.write(bytes(victim.size))
    first = os.path.join(log_dir, fmt.file_name(0))
    collector = threading.Timer(SETTLE_S / 3, os.unlink, [first])  # `commitlog gc`, during the re-check
    with CommitLogReader(log_dir) as r:
        collector.start()
        with pytest.raises(CorruptRecordError, match="zero bytes where a record should be") as exc:
            r.scan(victim.phy_offset)
        collector.join()
    assert not os.path.exists(first)
    assert (exc.value.file, exc.value.offset) == (path, victim.phy_offset)


def test_a_frontier_that_looks_corrupt_for_an_instant_is_read_without_waiting(log_dir, monkeypatch):
    """A writer that publishes between two reads of the frontier check (zeros read where its record
    starts, then the record's later bytes) makes a healthy frontier look corrupt for an instant.
    Waiting out ``SETTLE_S`` for that held every query's planning for a second about every 20 s at
    10k messages/s (the freshness benchmark's tail).  The race injected: the check's first look
    fails as it did then; the reader looks again at once, and never sleeps."""
    from connectors.commitlog import reader as reader_module

    written = fill(log_dir, 50)
    real, raced, slept = CommitLogReader._classify_once, [], []

    def racing(self, files, idx, pos, known_complete):
        if not raced and not known_complete:
            raced.append(files[idx].base + pos)
            raise self._fail(files[idx], pos, "zero bytes where a record should be, and data follows later")
        return real(self, files, idx, pos, known_complete)

    monkeypatch.setattr(CommitLogReader, "_classify_once", racing)
    monkeypatch.setattr(reader_module.time, "sleep", slept.append)
    with CommitLogReader(log_dir) as r:
        end = r.end_offset()
    assert raced == [end] == [written[-1].phy_offset + written[-1].size]
    assert slept == []


def test_swapped_files_are_detected(log_dir):
    fill(log_dir, 300)
    a, b = (os.path.join(log_dir, fmt.file_name(i * FILE)) for i in (1, 2))
    os.rename(a, a + ".x")
    os.rename(b, a)
    os.rename(a + ".x", b)
    with pytest.raises(CorruptRecordError, match="stored physical offset") as exc:
        replay(log_dir)
    assert exc.value.file == a


def test_missing_or_truncated_file_is_a_layout_error(log_dir):
    fill(log_dir, 300)
    os.truncate(os.path.join(log_dir, fmt.file_name(FILE)), FILE // 2)
    with pytest.raises(LogLayoutError, match=fmt.file_name(2 * FILE)):
        replay(log_dir)


# ------------------------------------------------------------------ property-based round trip

names = st.text(alphabet=st.characters(blacklist_characters="\x01\x02", blacklist_categories=("Cs",)), min_size=1, max_size=10)
messages = st.lists(
    st.builds(
        Message,
        topic=st.text(alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)),
                      min_size=1, max_size=140),
        body=st.one_of(st.binary(max_size=300), st.binary(min_size=3000, max_size=6000)),
        queue_id=st.integers(0, 7),
        properties=st.dictionaries(names, names, max_size=5),
        born_host=st.sampled_from(["10.0.0.1:1", "[2001:db8::7]:65535", "127.0.0.1:0"]),
        store_host=st.sampled_from(["10.9.9.9:10911", "[::1]:10911"]),
        born_ts=st.integers(1, 2**41),
        flag=st.integers(-(2**31), 2**31 - 1),
        reconsume_times=st.integers(0, 16),
    ),
    min_size=1,
    max_size=40,
)


@given(batch=messages, file_size=st.sampled_from([8192, 16384, 65536]))
def test_random_messages_round_trip_through_files(tmp_path_factory, batch, file_size):
    directory = str(tmp_path_factory.mktemp("rt"))
    with CommitLogWriter(directory, file_size=file_size, fsync="never") as w:
        written = w.append_many(batch)
    expected = [message_row(m) for m in written]
    assert replay(directory) == expected
    assert arrow_rows(directory) == expected


def test_a_long_lived_reader_tracks_the_frontier_as_the_log_grows(log_dir):
    fill(log_dir, 50)
    with CommitLogReader(log_dir) as r:
        first = r.end_offset()
        for round_ in range(1, 4):  # each poll walks on from the frontier it remembered
            more = fill(log_dir, 120, start=50 * round_)
            assert r.end_offset() == more[-1].phy_offset + more[-1].size > first
            with CommitLogReader(log_dir) as fresh:
                assert fresh.end_offset() == r.end_offset()


def test_a_long_lived_reader_lets_go_of_files_gc_deleted(log_dir):
    """A deleted file stays on disk and resident while mapped: the service's readers live for days."""
    fill(log_dir, 600)
    with CommitLogReader(log_dir) as r:
        files = r.files()
        assert len(files) >= 3
        r.scan(files[0].base, r.end_offset())  # maps every file
        os.unlink(files[0].path)
        os.unlink(files[1].path)
        assert r.end_offset() > 0  # the next poll lists the directory again
        with open(f"/proc/{os.getpid()}/maps") as fh:
            held = [line for line in fh if log_dir in line and "(deleted)" in line]
        assert held == []


def _resident_kb(directory: str) -> dict[str, int]:
    """The kernel's count of this process's resident pages of each mapped file of ``directory``."""
    out: dict[str, int] = {}
    path = None
    with open(f"/proc/{os.getpid()}/smaps") as fh:
        for line in fh:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line
                path = head[5] if len(head) >= 6 and head[5].startswith(directory) else None
            elif path and head[0] == "Rss:":
                out[path] = out.get(path, 0) + int(head[1])
    return out


def test_a_long_lived_reader_lets_go_of_the_pages_it_walked_past(log_dir):
    """The service's readers walk forward for months; what they walked past must not stay resident
    in the process (it did: the driver grew by twice the append rate, until the broker deleted
    files).  The oracle is the kernel's own count of resident pages per mapping."""
    from connectors.commitlog.reader import RELEASE_STEP

    size = 2 * RELEASE_STEP + (1 << 20)
    written = fill(log_dir, 11 * size // 4 // 4100, file_size=size, body=4000)  # two files and three quarters
    with CommitLogReader(log_dir) as r:
        files = r.files()
        assert len(files) == 3
        end = r.end_offset()
        r.scan(files[0].base, end)  # touches a header in every page of every file
        walked = _resident_kb(log_dir)
        assert len(walked) == 3 and min(walked.values()) > RELEASE_STEP // 1024
        at = r.scan(files[2].base, max_bytes=RELEASE_STEP + (64 << 10)).end
        assert at - files[2].base > RELEASE_STEP
        assert r.scan(at, end).end == end  # a later walk, from past the last file's first 16 MiB
        left = _resident_kb(log_dir)
        assert set(left) == {files[2].path}, "files wholly walked past are unmapped"
        assert left[files[2].path] <= (end - at) // 1024 + 2048, "the pages below the walk's start are dropped"
        rows = sum(b.num_rows for b in r.record_batches(files[0].base, end))  # and all of it reads again
        assert rows == len(written)


def test_producer_killed_between_its_two_writes_leaves_a_pending_tail(log_dir, tmp_path):
    """The writer's torn_append crash point: a batch written with its first TOTALSIZE still pending.

    Readers wait at it (no corruption error, nothing read past it), and the
    restarted writer zeroes it and appends there, with the queue offsets the
    lost batch would have taken.
    """
    script = textwrap.dedent(
        f"""
        from connectors.commitlog import CommitLogWriter, Message
        w = CommitLogWriter({log_dir!r}, file_size={FILE}, fsync="never")
        for i in range(40):
            w.append_many([Message(topic="t", queue_id=0, body=b"b%d" % i), Message(topic="t", queue_id=1, body=b"c")])
        """
    )
    faults = tmp_path / "faults"
    faults.mkdir()
    env = {**os.environ, "TIERLOG_FAULT": "torn_append:25", "TIERLOG_FAULT_DIR": str(faults)}
    done = subprocess.run([sys.executable, "-c", script], cwd=os.path.dirname(os.path.dirname(__file__)), env=env)
    assert done.returncode == -signal.SIGKILL
    rows = replay(log_dir)
    assert [r["body"] for r in rows if r["queue_id"] == 0] == [b"b%d" % i for i in range(24)]
    with CommitLogReader(log_dir) as r:
        end = r.scan(0).end
        time.sleep(SETTLE_S * 1.5)
        assert r.scan(0).end == end  # still waiting there, never an error
    with CommitLogWriter(log_dir, file_size=FILE) as w:
        assert w.offset == end
        assert w.append(Message(topic="t", queue_id=0, body=b"again")).queue_offset == 24
    assert [r["body"] for r in replay(log_dir)][-1] == b"again"


def test_a_pending_size_that_does_not_match_its_record_is_corruption(log_dir):
    target = _corrupt(log_dir, 7, 0, b"\xff\xff\xff\xf0")  # -16: negative, but not this record's size
    with pytest.raises(CorruptRecordError) as exc:
        replay(log_dir)
    assert exc.value.offset == target.phy_offset


# ------------------------------------------------------------------ malformed properties and keys


def test_malformed_properties_and_keys_read_the_same_on_both_paths(log_dir):
    """Non-UTF-8 bytes in a property (a broker stores whatever a client sent), a value holding what
    looks like separators, and a KEYS property of 5,000 keys: the Arrow fast path and the one-record
    decoder agree, the key is the first word, and nothing is skipped."""
    huge_keys = " ".join(f"k{i}" for i in range(5000))  # 28 KB, under the 32 KB properties limit
    msgs = [
        Message(topic="t", body=b"a", properties={"KEYS": "PLACEHOLDER", "X": "v"}),
        Message(topic="t", body=b"b", properties={"KEYS": huge_keys}),
        Message(topic="t", body=b"c", properties={"KEYS": "k=1;a:b", "Y": "\u00e9\u4e2d"}),
    ]
    with CommitLogWriter(log_dir, file_size=1 << 20, fsync="never") as w:
        written = w.append_many(msgs)
    path = os.path.join(log_dir, fmt.file_name(0))
    with open(path, "r+b") as fh:
        data = bytearray(fh.read())
        at = data.index(b"PLACEHOLDER")
        data[at : at + 11] = b"\xff\xfeBAD\xc3(\x80\x00ok"  # invalid UTF-8, and a NUL, in place
        fh.seek(0)
        fh.write(data)
    oracle = replay(log_dir)
    assert [r["phy_offset"] for r in oracle] == [m.phy_offset for m in written]
    assert arrow_rows(log_dir) == oracle
    assert oracle[0]["key"] == "\ufffd\ufffdBAD\ufffd(\ufffd\x00ok"  # replaced, never dropped
    assert oracle[1]["key"] == "k0" and len(oracle[1]["properties"]["KEYS"]) == len(huge_keys)
    assert oracle[2]["key"] == "k=1;a:b" and oracle[2]["properties"]["Y"] == "\u00e9\u4e2d"


@pytest.mark.parametrize("rel,value,reason", CORRUPTIONS)
def test_quarantine_skips_exactly_the_corrupt_record_and_lists_it(log_dir, rel, value, reason):
    intact = [message_row(m) for m in fill(log_dir + "-copy", 40)]
    target = _corrupt(log_dir, 17, rel, value)
    expected = [r for r in intact if r["phy_offset"] != target.phy_offset]
    base = target.phy_offset - target.phy_offset % FILE
    for read in ("messages", "arrow"):
        with CommitLogReader(log_dir, check_crc=True, on_corrupt="quarantine") as r:
            if read == "messages":
                rows = [message_row(m) for m in r.messages()]
            else:
                table = pa.Table.from_batches(list(r.record_batches(0, r.end_offset(), batch_rows=7)),
                                              schema=MESSAGE_SCHEMA)
                rows = [normalize_arrow_row(row) for row in table.to_pylist()]
            assert [x["phy_offset"] for x in rows] == [x["phy_offset"] for x in expected]
            assert len(r.quarantined) == 1, r.quarantined
            q = r.quarantined[0]
            assert (q.file, q.start, q.end) == (os.path.join(log_dir, fmt.file_name(base)), target.phy_offset,
                                                target.phy_offset + target.size)
            assert reason.split()[0].lower() in q.reason.lower()


# ------------------------------------------------------------------ what a real broker writes
# Found by tests/test_rocketmq_broker.py on RocketMQ 5.5's own commitlog, and pinned here with our writer.


def test_a_broker_pre_creates_the_next_file_and_the_frontier_stays_in_the_last_one_with_data(log_dir):
    """RocketMQ's AllocateMappedFileService creates the next mapped file, all zeros, before the
    current one is full; the end of the log is still where the data ends."""
    written = fill(log_dir, 60)
    last = sorted(f for f in os.listdir(log_dir) if f.isdigit())[-1]
    with open(os.path.join(log_dir, fmt.file_name(int(last) + FILE)), "wb") as f:
        f.truncate(FILE)
    end = written[-1].phy_offset + written[-1].size
    with CommitLogReader(log_dir, check_crc=True) as r:
        assert r.end_offset() == end
        table = pa.Table.from_batches(list(r.record_batches(0, r.end_offset())), schema=MESSAGE_SCHEMA)
    assert table.num_rows == len(written)
    assert replay(log_dir) == [message_row(m) for m in written]


@pytest.mark.parametrize("codec, flag", [("zlib", 0x300), ("zlib", 0x0), ("lz4", 0x100), ("zstd", 0x200)])
def test_a_compressed_body_reads_as_the_producer_sent_it(log_dir, codec, flag):
    """The Java client compresses bodies over 4 KiB (sysflag bit 0, codec in bits 8-10; 0 is a
    pre-5.0 client's zlib).  Both decoders inflate it and clear bit 0, as the consumer's client does."""
    from connectors.commitlog.compression import compress

    payload = b"order line " * 1000
    with CommitLogWriter(log_dir, file_size=FILE * 4, fsync="never") as w:
        stored = w.append_many([Message(topic="t", body=compress(payload, codec), sysflag=flag | 0x1),
                                Message(topic="t", body=b"plain", sysflag=flag)])
    assert stored[0].size < len(payload)
    got = replay(log_dir)
    assert [(r["body"], r["sysflag"]) for r in got] == [(payload, flag), (b"plain", flag)]
    assert [(r["body"], r["sysflag"]) for r in arrow_rows(log_dir)] == [(payload, flag), (b"plain", flag)]


def test_a_body_that_does_not_inflate_stops_reading_at_its_offset(log_dir):
    with CommitLogWriter(log_dir, file_size=FILE, fsync="never") as w:
        ok, bad = w.append_many([Message(topic="t", body=b"fine"), Message(topic="t", body=b"not zlib", sysflag=0x301)])
    for read in (replay, arrow_rows):
        with pytest.raises(CorruptRecordError, match="flagged zlib-compressed does not inflate") as exc:
            read(log_dir)
        assert exc.value.offset == bad.phy_offset

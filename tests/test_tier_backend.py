"""One backend suite, run against posix and against S3 over HTTP (moto's server or MinIO)."""

from __future__ import annotations

import os
import threading

import boto3
import pytest

from connectors.tier.location import open_backend
from connectors.tier.errors import AccessDenied, BucketNotFound, InvalidObjectName, ObjectNotFound
from connectors.tier.s3 import S3Backend


def test_put_read_size_list_delete(tier_location):
    b = open_backend(tier_location)
    b.put("a/x.bin", b"hello world")
    b.put("a/y.bin", b"")
    b.put("b/z.bin", b"zz")
    assert b.read("a/x.bin") == b"hello world"
    assert b.read("a/x.bin", 6) == b"world" and b.read("a/x.bin", 0, 5) == b"hello"
    assert b.read("a/x.bin", 3, 0) == b""
    assert b.size("a/x.bin") == 11 and b.size("a/y.bin") == 0
    assert [(o.name, o.size) for o in b.list("a/")] == [("a/x.bin", 11), ("a/y.bin", 0)]
    assert [o.name for o in b.list()] == ["a/x.bin", "a/y.bin", "b/z.bin"]
    b.put("a/x.bin", b"replaced")
    assert b.read("a/x.bin") == b"replaced"
    b.delete("a/x.bin")
    b.delete("a/x.bin")  # deleting twice is fine
    assert not b.exists("a/x.bin") and b.exists("b/z.bin")
    with pytest.raises(ObjectNotFound, match="a/x.bin"):
        b.read("a/x.bin")
    with pytest.raises(ObjectNotFound):
        b.size("nope")


def test_open_input_reads_ranges_and_names_a_missing_object(tier_location):
    b = open_backend(tier_location)
    data = bytes(range(256)) * 4096  # 1 MiB: larger than a buffered read
    b.put("o/data.bin", data)
    f = b.open_input("o/data.bin")
    f.seek(1000)
    assert f.read(10) == data[1000:1010]
    f.seek(-5, 2)
    assert f.read() == data[-5:] and f.tell() == len(data)
    f.seek(0)
    assert f.read() == data
    with pytest.raises(ObjectNotFound, match="o/none.bin"):
        b.open_input("o/none.bin").read(1)


def test_read_whole_gives_every_byte_and_names_a_missing_object(tier_location):
    b = open_backend(tier_location)
    data = bytes(range(256)) * 4096
    b.put("o/data.bin", data)
    whole = b.read_whole("o/data.bin")
    assert whole.size() == len(data) and whole.read() == data
    if not tier_location.startswith("s3://"):
        b.delete("o/data.bin")  # a memory map: a file deleted while mapped stays readable through it
        whole.seek(0)
        assert whole.read() == data
    with pytest.raises(ObjectNotFound, match="o/none.bin"):
        b.read_whole("o/none.bin")


@pytest.mark.parametrize("name", ["../evil", "/abs/path", "a/../../b", "a//b", "nul\x00x", "", "a/./b", "sp ace"])
def test_hostile_names_are_refused(tier_location, name):
    b = open_backend(tier_location)
    with pytest.raises(InvalidObjectName):
        b.put(name, b"x")


def test_a_topic_too_long_for_the_store_is_refused_by_name_and_fits_s3(tier_location):
    """RocketMQ's retry and dead-letter topics may have 255 characters; escaped, the '%'s take three
    bytes each, which is more than the 255 a posix file name holds, and well within an S3 key."""
    from connectors.tier.layout import Names

    b = open_backend(tier_location)
    name = Names("broker-a").segment("%DLQ%" + "g" * 250, 0, 0)
    if tier_location.startswith("s3://"):
        b.put(name, b"x")
        assert b.read(name) == b"x" and [o.name for o in b.list("topic=")] == [name]
        with pytest.raises(InvalidObjectName, match="1205 bytes, more than the .* S3 key"):
            b.put("/".join(["x" * 200] * 6), b"x")
    else:
        with pytest.raises(InvalidObjectName, match="265 bytes, more than the 255 .*S3 tier"):
            b.put(name, b"x")
        assert list(b.list()) == []


def test_readers_never_see_a_partial_object(tier_location):
    b = open_backend(tier_location)
    versions = [bytes([i]) * (3 << 20) for i in range(1, 5)]
    b.put("big.bin", versions[0])
    seen, stop, errors, reads_during_puts = set(), threading.Event(), [], [0]
    putting = threading.Event()

    def reader():
        try:
            while not stop.is_set():
                data = b.read("big.bin")
                seen.add((len(data), data[:1], data[-1:]))
                if putting.is_set():
                    reads_during_puts[0] += 1
        except Exception as exc:  # noqa: BLE001 - raised in the test below
            errors.append(exc)

    t = threading.Thread(target=reader)
    t.start()
    putting.set()
    for _round in range(3):  # enough overwrites that the reader reads during several of them
        for v in versions[1:] + versions[:1]:
            b.put("big.bin", v)
    putting.clear()
    stop.set()
    t.join()
    assert not errors, errors
    assert reads_during_puts[0] >= 2, "the reader must have read while the object was being overwritten"
    assert len({head for _, head, _ in seen}) >= 2  # it saw more than one version
    assert all(size == 3 << 20 and head == tail for size, head, tail in seen)


def test_posix_puts_leave_no_temporary_files(tmp_path):
    b = open_backend(str(tmp_path / "t"))
    for i in range(5):
        b.put(f"d/{i}", b"x" * i)
    assert sorted(os.listdir(tmp_path / "t" / "d")) == ["0", "1", "2", "3", "4"]


@pytest.mark.parametrize("extra", [0, 1, 4095, 4097, (8 << 20) + 12345])
def test_posix_large_objects_bypass_the_page_cache_and_keep_every_byte(tmp_path, monkeypatch, extra):
    """Objects of DIRECT_MIN_BYTES and more are written with O_DIRECT through an aligned buffer, the
    last chunk padded and cut back: every byte and the exact length come back, at sizes that end on
    and off the alignment and the buffer's chunks."""
    from connectors.tier import posix

    flags = []
    real = posix._direct
    monkeypatch.setattr(posix, "_direct", lambda fd, on: flags.append(on) or real(fd, on))
    data = os.urandom(posix.DIRECT_MIN_BYTES + extra)
    b = open_backend(str(tmp_path / "t"))
    b.put("seg/big", data)
    b.put("seg/small", data[:1000])
    assert flags == [True]  # the large object asked for O_DIRECT once; the small one did not
    assert b.size("seg/big") == len(data)
    assert b.read("seg/big") == data
    assert b.read("seg/small") == data[:1000]
    assert sorted(os.listdir(tmp_path / "t" / "seg")) == ["big", "small"]


def test_posix_writes_buffered_where_the_filesystem_refuses_o_direct(tmp_path, monkeypatch):
    import fcntl

    from connectors.tier import posix

    real = fcntl.fcntl

    def refuse(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(22, "Invalid argument")  # as tmpfs before Linux 6.6
        return real(fd, cmd, arg)

    monkeypatch.setattr(fcntl, "fcntl", refuse)
    data = os.urandom(posix.DIRECT_MIN_BYTES + 7)
    b = open_backend(str(tmp_path / "t"))
    b.put("seg/big", data)
    assert b.read("seg/big") == data


def test_s3_multipart_upload_is_used_for_large_objects(s3_location):
    b = S3Backend(s3_location, multipart_threshold=5 << 20, multipart_chunksize=5 << 20)
    calls = []
    b.client.meta.events.register("before-call.s3.CreateMultipartUpload", lambda **kw: calls.append("mpu"))
    data = os.urandom(11 << 20)
    b.put("large.bin", data)
    assert calls == ["mpu"] and b.read("large.bin") == data


def test_s3_missing_bucket_is_named(s3_endpoint):
    """(Denied access, which is what bad credentials get, is `test_s3_access_denied_is_named`.)"""
    b = S3Backend("s3://no-such-bucket-xyz/p", retry_deadline_s=1)
    with pytest.raises(BucketNotFound, match="no-such-bucket-xyz"):
        b.check()
    with pytest.raises(BucketNotFound, match="no-such-bucket-xyz"):
        b.put("x", b"1")


def test_s3_retries_5xx_and_timeouts_without_loss(s3_location):
    """Injected 500s, 503 SlowDowns and read timeouts: every object still lands, intact."""
    from botocore.awsrequest import AWSResponse
    from botocore.exceptions import ReadTimeoutError

    # botocore gives up at once here, so that tierlog's own retry loop is what is tested.
    b = S3Backend(s3_location, retry_deadline_s=60, botocore_attempts=1, retry_mode="standard")
    counter = {"n": 0}

    class Raw:
        def __init__(self, body):
            self._body = body

        def stream(self, **_):
            yield self._body

    def inject(request, **_):
        counter["n"] += 1
        n = counter["n"]
        if n % 3 == 1:
            return AWSResponse(request.url, 500, {}, Raw(b"<Error><Code>InternalError</Code></Error>"))
        if n % 3 == 2:
            return AWSResponse(request.url, 503, {}, Raw(b"<Error><Code>SlowDown</Code></Error>"))
        if n % 7 == 0:
            raise ReadTimeoutError(endpoint_url=request.url)
        return None

    b.client.meta.events.register("before-send.s3", inject)
    payloads = {f"obj/{i}": os.urandom(1000 + i) for i in range(6)}
    for name, data in payloads.items():
        b.put(name, data)
    for name, data in payloads.items():
        assert b.read(name) == data
    assert counter["n"] > 3 * len(payloads)  # the faults were really hit
    b.client.meta.events.unregister("before-send.s3", inject)
    clean = S3Backend(s3_location)
    assert {o.name: clean.read(o.name) for o in clean.list("obj/")} == payloads


def test_s3_reads_an_answer_cut_in_transit_again(s3_location):
    """A GET whose body arrives empty (a proxy or a connection cut it), so its checksum does not
    match, is read again, not taken for a broken tier (the chaos run's S3 proxy found this)."""
    from botocore.awsrequest import AWSResponse

    b = S3Backend(s3_location, retry_deadline_s=60, botocore_attempts=1, retry_mode="standard")
    b.put("obj/cut", b"x" * 5000)
    head = b.client.head_object(Bucket=b.bucket, Key=b.prefix + "obj/cut", ChecksumMode="ENABLED")
    cut = {"n": 0}

    class Empty:
        def stream(self, **_):
            yield b""

        def read(self, *_args, **_kw):
            return b""

    def inject(request, **_):
        if request.method == "GET" and cut["n"] < 2:
            cut["n"] += 1
            headers = {k: v for k, v in head["ResponseMetadata"]["HTTPHeaders"].items()
                       if k.startswith("x-amz-checksum") or k in ("etag", "content-type")}
            return AWSResponse(request.url, 200, {**headers, "content-length": "0"}, Empty())
        return None

    b.client.meta.events.register("before-send.s3", inject)
    assert b.read("obj/cut") == b"x" * 5000
    assert cut["n"] == 2, "no cut answer was served"
    b.client.meta.events.unregister("before-send.s3", inject)


def test_s3_access_denied_is_named(s3_location):
    client = boto3.client("s3")
    bucket = s3_location.split("/")[2]
    b = S3Backend(s3_location, retry_deadline_s=1)

    def deny(request, **_):
        from botocore.awsrequest import AWSResponse

        class Raw:
            def stream(self, **_):
                yield b"<Error><Code>AccessDenied</Code><Message>no</Message></Error>"

        return AWSResponse(request.url, 403, {}, Raw())

    b.client.meta.events.register("before-send.s3", deny)
    with pytest.raises(AccessDenied, match=bucket):
        b.put("x", b"1")
    assert client.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0


def test_staging_row_groups_are_cut_at_queue_boundaries():
    import pyarrow as pa
    import pyarrow.parquet as pq

    from connectors.commitlog.arrow import MESSAGE_SCHEMA
    from connectors.tier import layout

    runs = [("a", 0, 3000), ("a", 1, 10), ("a", 2, 20), ("b", 0, 1500), ("b", 1, 40_000), ("c", 0, 5)]
    rows = [{"topic": t, "queue_id": q, "queue_offset": i, "phy_offset": n, "body": b"x"}
            for n, (t, q, i) in enumerate((t, q, i) for t, q, count in runs for i in range(count))]
    table = pa.Table.from_pylist(rows, schema=MESSAGE_SCHEMA)
    source = pq.ParquetFile(pa.BufferReader(layout.to_staging_parquet(table)))
    assert source.read().equals(table)
    groups = [source.read_row_group(i, columns=["topic", "queue_id"]) for i in range(source.num_row_groups)]
    queues_per_group = [sorted(set(zip(g["topic"].to_pylist(), g["queue_id"].to_pylist()))) for g in groups]
    assert queues_per_group[0] == [("a", 0)]  # a long run has groups of its own
    assert [("a", 1), ("a", 2), ("b", 0)] in queues_per_group  # short runs share one
    assert all(q == [("b", 1)] for q in queues_per_group[2:-1]) and queues_per_group[-1] == [("c", 0)]
    assert max(g.num_rows for g in groups) <= layout.ROW_GROUP_ROWS


@pytest.mark.parametrize("body", [100, 2000, 16384, 3 << 20])
def test_row_groups_hold_about_row_group_bytes_of_bodies(body):
    """A point read decodes a whole row group, so large bodies make groups of fewer rows: a
    segment's and a staging object's groups hold at most ROW_GROUP_ROWS rows and, where the bodies
    are large, about ROW_GROUP_BYTES of them; every row is kept."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from connectors.commitlog.arrow import MESSAGE_SCHEMA
    from connectors.tier import layout

    rows = min(40_000, (64 << 20) // body)
    table = pa.Table.from_pylist([{"topic": "a", "queue_id": 0, "queue_offset": i, "phy_offset": i,
                                   "body": b"x" * body} for i in range(rows)], schema=MESSAGE_SCHEMA)
    for data in (layout.to_parquet(table), layout.to_staging_parquet(table)):
        source = pq.ParquetFile(pa.BufferReader(data))
        assert source.read(columns=["queue_offset"])["queue_offset"].to_pylist() == list(range(rows))
        sizes = [source.metadata.row_group(i).num_rows for i in range(source.num_row_groups)]
        expected = max(1, min(layout.ROW_GROUP_ROWS, layout.ROW_GROUP_BYTES // body))
        assert max(sizes) == expected, sizes
        assert max(sizes) * body <= max(body, layout.ROW_GROUP_BYTES)


def test_posix_waits_out_a_full_disk_and_loses_nothing(tmp_path, monkeypatch, caplog):
    """ENOSPC (injected: a size-limited mount needs root) is retried until space comes back."""
    from connectors.tier.posix import PosixBackend

    flag = tmp_path / "disk-full"
    flag.touch()
    monkeypatch.setenv("TIERLOG_FAULT_DISK_FULL", str(flag))
    backend = PosixBackend(str(tmp_path / "tier"), retry_deadline_s=60)
    threading.Timer(1.5, flag.unlink).start()
    backend.put("a/b.parquet", b"x" * 1000)
    assert backend.read("a/b.parquet") == b"x" * 1000
    assert any("is full" in r.getMessage() for r in caplog.records)
    assert [n for n in os.listdir(tmp_path / "tier" / "a")] == ["b.parquet"]  # no temporary file left behind
    flag.touch()
    with pytest.raises(Exception, match="is full") as exc:
        PosixBackend(str(tmp_path / "tier"), retry_deadline_s=0.5).put("a/c.parquet", b"y")
    assert exc.value.retriable

"""The Arrow fast path: decode many records into one ``pyarrow.RecordBatch``.

After a header walk has found where each record starts, every fixed field is
gathered for all records at once with numpy, and variable fields (body, topic,
properties) are cut out as Arrow binary views and copied in C++.  No Python
object is made per field; the only per-record Python work is the header walk
and, when asked, the CRC check.

The batch has the message row (``MESSAGE_SCHEMA``: docs/architecture.md, *The commitlog source*), plus
``prepared_tx_offset`` and ``size`` so a stored record can be rebuilt exactly, and ``broker``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from connectors.brokers import DEFAULT_BROKER
from connectors.commitlog import compression
from connectors.commitlog import format as fmt
from connectors.faults import note_decoded

MESSAGE_SCHEMA = pa.schema(
    [
        ("topic", pa.string()),
        ("queue_id", pa.int32()),
        ("queue_offset", pa.int64()),
        ("phy_offset", pa.int64()),
        ("msg_id", pa.string()),
        ("key", pa.string()),
        ("tags", pa.string()),
        ("body", pa.binary()),
        ("properties", pa.map_(pa.string(), pa.string())),
        ("born_ts", pa.timestamp("us", tz="UTC")),
        ("store_ts", pa.timestamp("us", tz="UTC")),
        ("born_host", pa.string()),
        ("store_host", pa.string()),
        ("sysflag", pa.int32()),
        ("flag", pa.int32()),
        ("reconsume_times", pa.int32()),
        ("op", pa.string()),
        ("prepared_tx_offset", pa.int64()),
        ("size", pa.int32()),
        ("broker", pa.string()),
    ]
)

# The same row as a Spark DDL string; tests check the two agree.
MESSAGE_DDL = (
    "topic string, queue_id int, queue_offset bigint, phy_offset bigint, msg_id string, key string, "
    "tags string, body binary, properties map<string,string>, born_ts timestamp, store_ts timestamp, "
    "born_host string, store_host string, sysflag int, flag int, reconsume_times int, op string, "
    "prepared_tx_offset bigint, size int, broker string"
)

_DDL_BY_NAME = {part.split(" ", 1)[0]: part for part in MESSAGE_DDL.split(", ")}


def project_schema(columns: Sequence[str]) -> pa.Schema:
    """The message schema limited to ``columns``, in the order given; unknown names raise ValueError."""
    unknown = [c for c in columns if c not in _DDL_BY_NAME]
    if unknown or not columns:
        raise ValueError(
            f"unknown message column(s) {', '.join(unknown) or '(none given)'}; "
            f"the message row has: {', '.join(MESSAGE_SCHEMA.names)}"
        )
    return pa.schema([MESSAGE_SCHEMA.field(c) for c in columns])


def project_ddl(columns: Sequence[str]) -> str:
    project_schema(columns)
    return ", ".join(_DDL_BY_NAME[c] for c in columns)


_HEAD_BLOCK = 112  # bytes from a record's start that hold every field before the body (both hosts IPv6: 108 + 4)


class BatchDecodeError(ValueError):
    """Record ``index`` of the batch failed a check; ``reason`` says which."""

    def __init__(self, index: int, reason: str):
        super().__init__(reason)
        self.index, self.reason = index, reason


def _gather(u8: np.ndarray, at: np.ndarray, width: int) -> np.ndarray:
    """Bytes ``[at, at + width)`` of every record as an (n, width) array.

    Rows are copied out of a sliding-window view of the buffer, so no index
    matrix is built.  Positions closer than ``width`` to the end of the buffer
    (only possible for a tiny last record) read zeros past the end.
    """
    if len(u8) < width:
        u8 = np.concatenate([u8, np.zeros(width, np.uint8)])
    windows = np.lib.stride_tricks.sliding_window_view(u8, width)
    last = len(windows) - 1
    if len(at) and at.max() <= last:
        return windows[at]
    out = windows[np.minimum(at, last)]
    for i in np.flatnonzero(at > last):
        tail = u8[at[i] :]
        out[i] = 0
        out[i, : len(tail)] = tail
    return out


def _be(u8: np.ndarray, at: np.ndarray, dtype: str) -> np.ndarray:
    """Big-endian integers of ``dtype`` ('i2', 'i4', 'u4', 'i8') at each position."""
    return _field(_gather(u8, at, int(dtype[1])), 0, dtype)


def _field(head: np.ndarray, rel, dtype: str) -> np.ndarray:
    """A big-endian field at column ``rel`` (one int, or one per row) of a gathered header block."""
    width = int(dtype[1])
    if isinstance(rel, np.ndarray):
        cols = np.take_along_axis(head, rel[:, None] + np.arange(width), axis=1)
    else:
        cols = np.ascontiguousarray(head[:, rel : rel + width])
    return cols.view(">" + dtype).reshape(-1).astype(dtype)


def _slices(buffer: pa.Buffer, u8: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
            *, copy: bool = True) -> pa.Array:
    """A binary array of ``buffer[start:start+length]`` per record, copied once, in C++.

    Built as Arrow binary views (16 bytes each: length, then inline data up to
    12 bytes, or a prefix plus the offset into ``buffer``) and cast to binary;
    ``copy=False`` returns the views themselves, which keep ``buffer`` alive.
    """
    n = len(starts)
    views = np.zeros((n, 16), np.uint8)
    views[:, 0:4] = lengths.astype("<i4").view(np.uint8).reshape(n, 4)
    short = lengths <= 12
    for j in range(12):
        rows = np.flatnonzero(short & (lengths > j))
        views[rows, 4 + j] = u8[starts[rows] + j]
    long_rows = np.flatnonzero(~short)
    views[long_rows, 4:8] = _gather(u8, starts[long_rows], 4)
    views[long_rows, 12:16] = starts[long_rows].astype("<i4").view(np.uint8).reshape(-1, 4)
    arr = pa.Array.from_buffers(pa.binary_view(), n, [None, pa.py_buffer(views), buffer])
    return arr.cast(pa.binary()) if copy else arr


def _to_string(arr: pa.Array) -> pa.Array:
    """UTF-8 strings; invalid bytes become U+FFFD, as Java's ``new String(bytes, UTF_8)`` does."""
    try:
        return arr.cast(pa.string())
    except pa.ArrowInvalid:
        return pa.array([None if b is None else b.decode("utf-8", "replace") for b in arr.to_pylist()], pa.string())


def _hosts(head: np.ndarray, rel, width) -> pa.Array:
    """Host fields as ``ip:port`` strings; formatted once per distinct host, not per row."""
    n = len(head)
    width = np.broadcast_to(np.asarray(width), (n,))
    if isinstance(rel, np.ndarray):
        raw = np.take_along_axis(head, rel[:, None] + np.arange(20), axis=1)
    else:
        raw = head[:, rel : rel + 20].copy()
    raw[width == 8, 8:] = 0  # bytes past an IPv4 host belong to the next field
    keys = np.concatenate([raw, width[:, None].astype(np.uint8)], axis=1)
    keys = np.ascontiguousarray(keys).view(np.dtype((np.void, 21))).reshape(-1)
    uniq, inverse = np.unique(keys, return_inverse=True)
    names = [fmt.decode_host(bytes(k)[: bytes(k)[20]]) for k in uniq]
    return pa.array(names, pa.string()).take(pa.array(inverse.reshape(-1)))


def _properties(props: pa.Array) -> pa.MapArray:
    """``name\\x01value\\x02...`` strings to map<string,string>, dropping what RocketMQ drops."""
    n = len(props)
    segments = pc.split_pattern(props, "\x02")
    parent = pc.list_parent_indices(segments).to_numpy()
    pairs = pc.split_pattern(pc.list_flatten(segments), "\x01", max_splits=1)
    is_pair = np.flatnonzero(pc.equal(pc.list_value_length(pairs), 2).to_numpy(zero_copy_only=False))
    pairs = pairs.take(pa.array(is_pair))
    names, values = pc.list_element(pairs, 0), pc.list_element(pairs, 1)
    nonempty = pc.and_(pc.greater(pc.binary_length(names), 0), pc.greater(pc.binary_length(values), 0))
    keep = is_pair[nonempty.to_numpy(zero_copy_only=False)]
    counts = np.bincount(parent[keep], minlength=n)
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum(counts, out=offsets[1:])
    return pa.MapArray.from_arrays(
        pa.array(offsets), names.filter(nonempty), values.filter(nonempty), type=MESSAGE_SCHEMA.field("properties").type
    )


def _first_key(props: pa.MapArray, key_property: str) -> pa.Array:
    value = pc.map_lookup(props, key_property, "last")
    first = pc.list_element(pc.split_pattern(value, " ", max_splits=1), 0)
    return pc.if_else(pc.equal(first, ""), pa.scalar(None, pa.string()), first)


def _check_body_crcs(mv: memoryview, body_at: np.ndarray, body_len: np.ndarray, crc: np.ndarray) -> None:
    """Raise :class:`BatchDecodeError` at the first record whose body does not match its CRC.

    One CRC call a record is unavoidable; the loop runs over Python ints, not numpy scalars, whose
    indexing cost more than the CRC's own time (``./dev bench decode``).  The CRC is
    ``format.body_crc``, the one definition of §6's mask: calling it costs little more than
    inlining it."""
    for i, (at, length, expected) in enumerate(zip(body_at.tolist(), body_len.tolist(), crc.tolist())):
        if length and fmt.body_crc(mv[at : at + length]) != expected:
            raise BatchDecodeError(i, "body CRC mismatch")


def decode_batch(
    data: bytes,
    starts: np.ndarray,
    base_offset: int,
    *,
    key_property: str = "KEYS",
    check_crc: bool = False,
    columns: Sequence[str] | None = None,
    broker: str = DEFAULT_BROKER,
    body_views: bool = False,
) -> pa.RecordBatch:
    """Decode the records at ``starts`` (positions in ``data``) into one batch.

    ``base_offset`` is the physical offset of ``data[0]``; every record's
    stored PHYSICALOFFSET must equal it plus the record's position.  Raises
    :class:`BatchDecodeError` naming the first record that fails a check.
    ``columns`` (names of the message row, in any order) limits the output to
    those columns; the checks run whatever is selected.  ``broker`` is the name every row carries
    (the log itself does not hold it: see ``connectors.brokers``).

    ``body_views``: the ``body`` column as Arrow binary views into ``data`` (``binary_view``), not
    copied.  For a caller that reorders the rows before it writes them (the stager): the bodies are
    then copied once, in their new order, where a gather behind the copy moved them twice.
    """
    n = len(starts)
    if n == 0:
        return pa.RecordBatch.from_pylist([], schema=MESSAGE_SCHEMA if columns is None else project_schema(columns))
    u8 = np.frombuffer(data, np.uint8)
    buffer = pa.py_buffer(data)
    at = np.asarray(starts, np.int64)
    head = _gather(u8, at, _HEAD_BLOCK)  # one gather for every field before the body
    size = _field(head, 0, "i4")
    magic = _field(head, fmt.POS_MAGIC, "u4")
    sysflag = _field(head, fmt.POS_SYSFLAG, "i4")
    if (sysflag & (fmt.BORNHOST_V6_FLAG | fmt.STOREHOST_V6_FLAG)).any():
        bh = np.where(sysflag & fmt.BORNHOST_V6_FLAG, 20, 8)
        sh = np.where(sysflag & fmt.STOREHOST_V6_FLAG, 20, 8)
    else:
        bh = sh = 8  # all IPv4: every field sits at the same column
    store_ts_rel = fmt.POS_BORN_HOST + bh
    store_host_rel = store_ts_rel + 8
    reconsume_rel = store_host_rel + sh
    body_len = _field(head, reconsume_rel + 12, "i4").astype(np.int64)
    body_at = at + reconsume_rel + 16
    v2 = magic == fmt.MAGIC_V2
    topic_len_at = body_at + np.clip(body_len, 0, None)
    topic_len = np.where(v2, _be(u8, topic_len_at, "i2"), _gather(u8, topic_len_at, 1)[:, 0]).astype(np.int64)
    topic_at = topic_len_at + np.where(v2, 2, 1)
    props_len_at = topic_at + np.clip(topic_len, 0, None)
    props_len = _be(u8, props_len_at, "i2").astype(np.int64)
    props_at = props_len_at + 2
    phy = _field(head, fmt.POS_PHY_OFFSET, "i8")

    expected = 74 + bh + sh + np.where(v2, 2, 1) + body_len + topic_len + props_len
    checks = [
        (~np.isin(magic, [fmt.MAGIC_V1, fmt.MAGIC_V2]), "unknown magic code"),
        ((body_len < 0) | (topic_len < 0) | (props_len < 0) | (expected != size), "TOTALSIZE does not match its fields"),
        (phy != base_offset + at, "stored physical offset is not the record's position"),
    ]
    for bad, reason in checks:
        if bad.any():
            raise BatchDecodeError(int(np.argmax(bad)), reason)
    crc = _field(head, fmt.POS_BODY_CRC, "i4")
    if check_crc:
        _check_body_crcs(memoryview(data), body_at, body_len, crc)
    note_decoded(base_offset + int(at[0]), base_offset + int(at[-1] + size[-1]), n, check_crc)

    body = _slices(buffer, u8, body_at, body_len, copy=not body_views)
    if (sysflag & fmt.COMPRESSED_FLAG).any():
        body = _inflated(body.cast(pa.binary()), sysflag).cast(body.type)  # every batch of one type
        sysflag = sysflag & ~fmt.COMPRESSED_FLAG
    topic = _to_string(_slices(buffer, u8, topic_at, topic_len))
    props = _properties(_to_string(_slices(buffer, u8, props_at, props_len)))
    ts = pa.timestamp("us", tz="UTC")

    def msg_id() -> pa.Array:
        uniq = pc.map_lookup(props, "UNIQ_KEY", "last")
        if not uniq.null_count:
            return uniq
        return pc.coalesce(uniq, _offset_msg_ids(u8, at + store_host_rel, sh, phy, uniq))

    def op() -> pa.Array:
        kv_op = pc.map_lookup(props, "KV_OP", "last")
        return pc.if_else(pc.fill_null(pc.equal(kv_op, "DELETE"), False), "delete", "put")

    # Built on demand, so a query that selects a few columns does not pay for the rest.
    builders = {
        "topic": lambda: topic,
        "queue_id": lambda: pa.array(_field(head, fmt.POS_QUEUE_ID, "i4")),
        "queue_offset": lambda: pa.array(_field(head, fmt.POS_QUEUE_OFFSET, "i8")),
        "phy_offset": lambda: pa.array(phy),
        "msg_id": msg_id,
        "key": lambda: _first_key(props, key_property),
        "tags": lambda: pc.map_lookup(props, "TAGS", "last"),
        "body": lambda: body,
        "properties": lambda: props,
        "born_ts": lambda: pa.array(_field(head, fmt.POS_BORN_TS, "i8") * 1000).cast(ts),
        "store_ts": lambda: pa.array(_field(head, store_ts_rel, "i8") * 1000).cast(ts),
        "born_host": lambda: _hosts(head, fmt.POS_BORN_HOST, bh),
        "store_host": lambda: _hosts(head, store_host_rel, sh),
        "sysflag": lambda: pa.array(sysflag),
        "flag": lambda: pa.array(_field(head, fmt.POS_FLAG, "i4")),
        "reconsume_times": lambda: pa.array(_field(head, reconsume_rel, "i4")),
        "op": op,
        "prepared_tx_offset": lambda: pa.array(_field(head, reconsume_rel + 4, "i8")),
        "size": lambda: pa.array(size),
        "broker": lambda: pa.repeat(pa.scalar(broker, pa.string()), n),
    }
    schema = MESSAGE_SCHEMA if columns is None else project_schema(columns)
    if "body" in schema.names and body.type != schema.field("body").type:
        schema = schema.set(schema.get_field_index("body"), schema.field("body").with_type(body.type))
    return pa.RecordBatch.from_arrays([builders[f.name]() for f in schema], schema=schema)


def _inflated(body: pa.Array, sysflag: np.ndarray) -> pa.Array:
    """``body`` with the compressed ones inflated (see ``compression``)."""
    rows = np.flatnonzero(sysflag & fmt.COMPRESSED_FLAG)
    out = []
    for i in rows:
        try:
            out.append(compression.decompress(body[int(i)].as_py(), int(sysflag[i])))
        except compression.BodyCompressionError as exc:
            raise BatchDecodeError(int(i), str(exc)) from exc
    mask = np.zeros(len(body), dtype=bool)
    mask[rows] = True
    return pc.replace_with_mask(body, pa.array(mask), pa.array(out, body.type))


# Two uppercase hex digits for every byte value, as ``bytes.hex().upper()`` writes them.
_HEX = np.frombuffer(b"".join(b"%02X" % i for i in range(256)), np.uint8).reshape(256, 2)


def _offset_msg_ids(u8, host_at, width, phy, uniq: pa.Array) -> pa.Array:
    """§8 offsetMsgId (hex of store host + physical offset, as ``format.offset_msg_id``) for rows
    with no UNIQ_KEY; null for the others.

    Why on whole columns: a broker's own clients set UNIQ_KEY, but messages from other writers
    (and the benchmarks' generator) do not, and a Python call a row was a sizeable part of the
    driver's staging of small messages (``./dev bench stage --driver --no-uniq-key``,
    docs/benchmarks.md)."""
    missing = uniq.is_null().to_numpy(zero_copy_only=False)
    width = np.broadcast_to(np.asarray(width, np.int64), (len(phy),))
    host_at = np.broadcast_to(np.asarray(host_at, np.int64), (len(phy),))
    offsets = np.zeros(len(phy) + 1, np.int32)
    np.cumsum(np.where(missing, 2 * (width + 8), 0), out=offsets[1:])
    text = np.empty(int(offsets[-1]), np.uint8)
    for w in np.unique(width[missing]).tolist():  # 8 bytes for IPv4 hosts, 20 for IPv6
        rows = np.flatnonzero(missing & (width == w))
        raw = np.empty((len(rows), w + 8), np.uint8)
        raw[:, :w] = u8[host_at[rows, None] + np.arange(w)]
        raw[:, w:] = np.asarray(phy)[rows].astype(">i8").view(np.uint8).reshape(-1, 8)
        text[offsets[rows, None] + np.arange(2 * (w + 8))] = _HEX[raw].reshape(len(rows), -1)
    valid = pa.array(missing).buffers()[1]
    return pa.Array.from_buffers(pa.string(), len(phy), [valid, pa.py_buffer(offsets), pa.py_buffer(text)])


def dispatched_mask(sysflag) -> pa.Array:
    """True for records that entered a queue: not a transaction, or its COMMIT (PREPARED and
    ROLLBACK records never do, §8)."""
    tx = pc.bit_wise_and(sysflag, fmt.TRANSACTION_MASK)
    return pc.or_(pc.equal(tx, fmt.TRANSACTION_NOT_TYPE), pc.equal(tx, fmt.TRANSACTION_COMMIT))


def dispatched_only(table):
    """``table`` (or a record batch) without the records that never entered a queue."""
    keep = dispatched_mask(table["sysflag"])
    return table if pc.all(keep).as_py() else table.filter(keep)


def epoch_ms_array(column) -> pa.Array:
    """Store times as an int64 array of epoch milliseconds, from an Arrow timestamp or integer column."""
    if not pa.types.is_timestamp(column.type):
        return column
    unit = column.type.unit
    column = pc.cast(column, pa.int64())
    if unit == "ms":
        return column
    return pc.multiply(column, 1000) if unit == "s" else pc.divide(column, {"us": 1000, "ns": 1_000_000}[unit])


def epoch_ms(column) -> list[int]:
    """Store times as epoch milliseconds, from an Arrow timestamp or integer column."""
    return epoch_ms_array(column).to_pylist()


class BodyViews:
    """Bodies carried as their 16-byte Arrow views while rows are filtered and reordered, then
    copied once, in their final order (``decode_batch(body_views=True)``'s batches).

    Why: reordering binary bodies copies every body behind the gather, after the decode's own
    copy, and pyarrow (26) has no take or filter for ``binary_view`` itself.  So the views travel
    as a ``binary(16)`` column, which Arrow reorders as plain 16-byte values, while this object
    keeps the bytes they point into (the mapped log): the stager's sort then moves 16 bytes a row
    (``bench/bench_stage.py``'s phases)."""

    TYPE = pa.binary(16)

    def __init__(self):
        self.buffers: list[pa.Buffer] = []

    def hold(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """``batch`` with its ``binary_view`` body as ``TYPE``, the bytes behind it kept here."""
        i = batch.schema.get_field_index("body")
        body = batch.column(i)
        if body.null_count:
            raise ValueError("a body is null: decode_batch never makes one")
        _validity, views_buf, *data = body.buffers()
        n = len(body)
        views = np.frombuffer(views_buf, np.uint8)[body.offset * 16 : (body.offset + n) * 16].reshape(n, 16).copy()
        if self.buffers:  # a view names its bytes by buffer index: renumbered past those held already
            long_rows = views[:, 0:4].copy().view("<i4").reshape(-1) > 12
            index = views[long_rows, 8:12].copy().view("<i4").reshape(-1) + len(self.buffers)
            views[long_rows, 8:12] = index.astype("<i4").view(np.uint8).reshape(-1, 4)
        self.buffers.extend(data)
        held = pa.FixedSizeBinaryArray.from_buffers(self.TYPE, n, [None, pa.py_buffer(views)])
        return batch.set_column(i, pa.field("body", self.TYPE), held)

    def bodies(self, table: pa.Table) -> pa.Table:
        """``table`` (from held batches, filtered and reordered) with its bodies as ``binary``: one copy."""
        i = table.schema.get_field_index("body")
        held = table.column(i).combine_chunks()
        n = len(held)
        views = held.buffers()[1][held.offset * 16 : (held.offset + n) * 16]
        body = pa.Array.from_buffers(pa.binary_view(), n, [None, views, *self.buffers]).cast(pa.binary())
        return table.set_column(i, MESSAGE_SCHEMA.field("body"), body)


def in_given_order(records: pa.Table, at: np.ndarray) -> pa.Table:
    """``records`` (as a ``records_as_stored`` gave them, with ``at``) in the order their offsets
    were asked in: the ``records_at`` of both readers.  Offsets asked in stored order (the KV
    writer's reads are) are left where they lie: a take copies every body of them."""
    if np.array_equal(at, np.arange(len(at))):
        return records
    return records.take(pa.array(np.argsort(at, kind="stable")))

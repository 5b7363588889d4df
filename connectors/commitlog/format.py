"""RocketMQ commitlog records: constants, and encode/decode of one record.

Pure functions over bytes, written to ``docs/commitlog-format.md`` (section
numbers below refer to it).  Nothing here touches a file.
"""

from __future__ import annotations

import ipaddress
import struct
import zlib
from dataclasses import dataclass, field

from connectors.commitlog import compression

# §2 magic codes, as unsigned 32-bit values (what ">I" unpacks).
MAGIC_V1 = 0xDAA320A7
MAGIC_V2 = 0xDAA320AB
BLANK_MAGIC = 0xCBD43194

# §5 system flags.
COMPRESSED_FLAG = 0x1
MULTI_TAGS_FLAG = 0x2
TRANSACTION_MASK = 0xC
TRANSACTION_NOT_TYPE = 0x0
TRANSACTION_PREPARED = 0x4
TRANSACTION_COMMIT = 0x8
TRANSACTION_ROLLBACK = 0xC
BORNHOST_V6_FLAG = 0x10
STOREHOST_V6_FLAG = 0x20

# §9: every record leaves at least this many bytes free in its file.
END_FILE_MIN_BLANK_LENGTH = 8
DEFAULT_FILE_SIZE = 1 << 30

# §7 property separators and the properties' length limit.
NAME_VALUE_SEPARATOR = "\x01"
PROPERTY_SEPARATOR = "\x02"
MAX_PROPERTIES_BYTES = 32767
MAX_TOPIC_BYTES_V1 = 127
MAX_TOPIC_BYTES_V2 = 32767

# Positions that never move (§4): everything up to and including the born host.
POS_MAGIC = 4
POS_BODY_CRC = 8
POS_QUEUE_ID = 12
POS_FLAG = 16
POS_QUEUE_OFFSET = 20
POS_PHY_OFFSET = 28
POS_SYSFLAG = 36
POS_BORN_TS = 40
POS_BORN_HOST = 48

# The smallest possible record: v4 hosts, empty body, V1, empty topic and properties.
MIN_RECORD_SIZE = 74 + 8 + 8 + 1

_HEAD = struct.Struct(">iIiiiqqiq")  # size .. born timestamp (48 bytes)
_I32 = struct.Struct(">i")
_U32 = struct.Struct(">I")
_I64 = struct.Struct(">q")
_I16 = struct.Struct(">h")
_SIZE_MAGIC = struct.Struct(">iI")
_UNSIZED_HEAD = struct.Struct(">Iiiiqqi")  # magic .. sysflag, for a record whose TOTALSIZE is not written


def body_crc(body: bytes) -> int:
    """§6: java.util.zip.CRC32 of the stored body, masked to 31 bits."""
    return zlib.crc32(body) & 0x7FFFFFFF


def host_width(sysflag: int, v6_flag: int) -> int:
    """Bytes a host field takes: 4-byte IPv4 or 16-byte IPv6 address, plus a 4-byte port."""
    return 20 if sysflag & v6_flag else 8


def record_size(body_len: int, topic_len: int, props_len: int, sysflag: int, v2: bool) -> int:
    """§4.1 ``calMsgLength``: TOTALSIZE from the variable parts."""
    bh = host_width(sysflag, BORNHOST_V6_FLAG)
    sh = host_width(sysflag, STOREHOST_V6_FLAG)
    return 74 + bh + sh + (2 if v2 else 1) + body_len + topic_len + props_len


# ---------------------------------------------------------------- properties (§7)


def properties_to_string(props: dict[str, str]) -> str:
    """Serialize as ``name\\x01value\\x02`` per entry, skipping None values."""
    parts = []
    for name, value in props.items():
        if value is None:
            continue
        for text in (name, value):
            if NAME_VALUE_SEPARATOR in text or PROPERTY_SEPARATOR in text:
                raise ValueError(
                    f"property {name!r}: names and values may not contain \\x01 or \\x02 "
                    "(RocketMQ's serialization has no escaping)"
                )
        parts.append(f"{name}{NAME_VALUE_SEPARATOR}{value}{PROPERTY_SEPARATOR}")
    return "".join(parts)


def string_to_properties(text: str) -> dict[str, str]:
    """Parse like ``MessageDecoder.string2messageProperties``.

    Segments without a separator, a name or a value are dropped, exactly as the
    broker and every RocketMQ client drop them; the raw bytes stay in the log.
    """
    props: dict[str, str] = {}
    for segment in text.split(PROPERTY_SEPARATOR):
        name, sep, value = segment.partition(NAME_VALUE_SEPARATOR)
        if sep and name and value:
            props[name] = value
    return props


# ---------------------------------------------------------------- hosts


def encode_host(host: str) -> tuple[bytes, bool]:
    """``"1.2.3.4:80"`` or ``"[::1]:80"`` to address bytes + big-endian port; True for IPv6."""
    addr, _, port = host.rpartition(":")
    if not addr or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"host {host!r} is not ADDRESS:PORT")
    ip = ipaddress.ip_address(addr.strip("[]"))
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # Java stores ::ffff:a.b.c.d as an Inet4Address (§4 notes)
    return ip.packed + _I32.pack(int(port)), ip.version == 6


def decode_host(raw: bytes) -> str:
    ip = ipaddress.ip_address(bytes(raw[:-4]))
    port = _I32.unpack_from(raw, len(raw) - 4)[0]
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def offset_msg_id(store_host_raw: bytes, phy_offset: int) -> str:
    """§8 the broker's message id: store host address + port + physical offset, in hex."""
    return (bytes(store_host_raw) + _I64.pack(phy_offset)).hex().upper()


# ---------------------------------------------------------------- messages


@dataclass(slots=True)
class Message:
    """One stored message, field for field as §4 lays it out.

    ``born_host`` and ``store_host`` are ``"a.b.c.d:port"`` or ``"[v6]:port"``.
    ``body_crc`` is filled in on decode; on encode it is always recomputed, as
    the broker does.
    """

    topic: str
    body: bytes = b""
    queue_id: int = 0
    properties: dict[str, str] = field(default_factory=dict)
    queue_offset: int = 0
    phy_offset: int = 0
    born_ts: int = 0
    born_host: str = "127.0.0.1:0"
    store_ts: int = 0
    store_host: str = "127.0.0.1:10911"
    sysflag: int = 0
    flag: int = 0
    reconsume_times: int = 0
    prepared_tx_offset: int = 0
    body_crc: int = 0
    size: int = 0
    v2: bool | None = None

    @property
    def tags(self) -> str | None:
        return self.properties.get("TAGS")

    def key(self, key_property: str = "KEYS") -> str | None:
        """The first space-separated entry of the key property (RocketMQ's KEYS)."""
        value = self.properties.get(key_property)
        if not value:
            return None
        return value.split(" ", 1)[0] or None

    @property
    def msg_id(self) -> str:
        """The client id (UNIQ_KEY) when the producer set one, else the broker's offsetMsgId."""
        uniq = self.properties.get("UNIQ_KEY")
        if uniq:
            return uniq
        raw, _ = encode_host(self.store_host)
        return offset_msg_id(raw, self.phy_offset)

    @property
    def op(self) -> str:
        return "delete" if self.properties.get("KV_OP") == "DELETE" else "put"

    @property
    def dispatched(self) -> bool:
        """§8: PREPARED and ROLLBACK records never reach a ConsumeQueue."""
        return self.sysflag & TRANSACTION_MASK in (TRANSACTION_NOT_TYPE, TRANSACTION_COMMIT)


def encode(msg: Message) -> bytes:
    """Encode one record exactly as ``MessageExtEncoder`` does (§4).

    The V2 magic is chosen when the topic is longer than 127 bytes
    (``autoMessageVersionOnTopicLen``) unless ``msg.v2`` forces a version.
    IPv6 host flags are derived from the host strings, as the broker ORs them in.
    """
    topic = msg.topic.encode("utf-8")
    v2 = len(topic) > MAX_TOPIC_BYTES_V1 if msg.v2 is None else msg.v2
    if len(topic) > (MAX_TOPIC_BYTES_V2 if v2 else MAX_TOPIC_BYTES_V1):
        raise ValueError(f"topic is {len(topic)} bytes, too long for magic {'V2' if v2 else 'V1'}")
    props = properties_to_string(msg.properties).encode("utf-8")
    if len(props) > MAX_PROPERTIES_BYTES:
        raise ValueError(f"properties are {len(props)} bytes; the limit is {MAX_PROPERTIES_BYTES}")
    born, born_v6 = encode_host(msg.born_host)
    store, store_v6 = encode_host(msg.store_host)
    sysflag = msg.sysflag & ~(BORNHOST_V6_FLAG | STOREHOST_V6_FLAG)
    sysflag |= (BORNHOST_V6_FLAG if born_v6 else 0) | (STOREHOST_V6_FLAG if store_v6 else 0)
    body = bytes(msg.body)
    size = record_size(len(body), len(topic), len(props), sysflag, v2)
    return b"".join(
        (
            _HEAD.pack(
                size,
                MAGIC_V2 if v2 else MAGIC_V1,
                body_crc(body),
                msg.queue_id,
                msg.flag,
                msg.queue_offset,
                msg.phy_offset,
                sysflag,
                msg.born_ts,
            ),
            born,
            _I64.pack(msg.store_ts),
            store,
            _I32.pack(msg.reconsume_times),
            _I64.pack(msg.prepared_tx_offset),
            _I32.pack(len(body)),
            body,
            _I16.pack(len(topic)) if v2 else bytes((len(topic),)),
            topic,
            _I16.pack(len(props)),
            props,
        )
    )


class RecordError(ValueError):
    """A record's bytes do not form a valid message; ``reason`` says which check failed."""

    def __init__(self, reason: str, size: int | None = None):
        super().__init__(reason)
        self.reason = reason
        self.size = size


def read_size_magic(buf, pos: int) -> tuple[int, int]:
    """TOTALSIZE (signed) and MAGICCODE (unsigned) at ``pos``."""
    return _SIZE_MAGIC.unpack_from(buf, pos)


def stored_phy_offset(buf, pos: int) -> int:
    """The PHYSICALOFFSET field of the record at ``pos``: where the writer put it."""
    return _I64.unpack_from(buf, pos + POS_PHY_OFFSET)[0]


def implied_size(buf, pos: int) -> int | None:
    """The TOTALSIZE a record's own fields imply, read without its TOTALSIZE; None if they cannot be read.

    tierlog's writer writes an append with its first TOTALSIZE negated and
    publishes it last, so an append cut short (a producer killed between its
    two writes) leaves a pending size: a reader checks it against this.
    """
    try:
        magic, _crc, _qid, _flag, _qoff, _phy, sysflag = _UNSIZED_HEAD.unpack_from(buf, pos + POS_MAGIC)
        if magic not in (MAGIC_V1, MAGIC_V2):
            return None
        p = pos + POS_BORN_HOST + host_width(sysflag, BORNHOST_V6_FLAG) + 8 + host_width(sysflag, STOREHOST_V6_FLAG)
        (body_len,) = _I32.unpack_from(buf, p + 12)
        p += 16 + max(body_len, 0)
        v2 = magic == MAGIC_V2
        topic_len = _I16.unpack_from(buf, p)[0] if v2 else buf[p]
        p += (2 if v2 else 1) + topic_len
        (props_len,) = _I16.unpack_from(buf, p)
    except (struct.error, IndexError):
        return None
    if body_len < 0 or topic_len < 0 or props_len < 0:
        return None
    return record_size(body_len, topic_len, props_len, sysflag, v2)


def decode(buf, pos: int = 0, *, check_crc: bool = False, expect_phy: int | None = None, inflate: bool = True) -> Message:
    """Decode the message record that starts at ``buf[pos]``.

    Checks what the broker checks on recovery: the magic, that TOTALSIZE equals
    the §4.1 formula and fits in ``buf``; with ``check_crc`` the body CRC; and,
    when ``expect_phy`` is given, that the stored PHYSICALOFFSET is where the
    record really lies (a moved or renamed file fails this).  A compressed body
    is inflated and its flag cleared (``compression``) unless ``inflate`` is false.
    Raises :class:`RecordError`.
    """
    if len(buf) - pos < MIN_RECORD_SIZE:
        raise RecordError("record header is truncated")
    size, magic, crc, queue_id, flag, queue_offset, phy, sysflag, born_ts = _HEAD.unpack_from(buf, pos)
    if magic not in (MAGIC_V1, MAGIC_V2):
        raise RecordError(f"unknown magic code 0x{magic:08X}", size)
    if size < MIN_RECORD_SIZE or size > len(buf) - pos:
        raise RecordError(f"impossible TOTALSIZE {size}", size)
    end = pos + size
    p = pos + POS_BORN_HOST
    bh = host_width(sysflag, BORNHOST_V6_FLAG)
    sh = host_width(sysflag, STOREHOST_V6_FLAG)
    if pos + 72 + bh + sh > end:  # through the body length field
        raise RecordError(f"TOTALSIZE {size} is smaller than the fixed fields", size)
    born_raw = bytes(buf[p : p + bh])
    p += bh
    (store_ts,) = _I64.unpack_from(buf, p)
    p += 8
    store_raw = bytes(buf[p : p + sh])
    p += sh
    (reconsume,) = _I32.unpack_from(buf, p)
    (prepared,) = _I64.unpack_from(buf, p + 4)
    (body_len,) = _I32.unpack_from(buf, p + 12)
    p += 16
    v2 = magic == MAGIC_V2
    if body_len < 0 or p + body_len + (2 if v2 else 1) + 2 > end:
        raise RecordError(f"body length {body_len} does not fit TOTALSIZE {size}", size)
    body = bytes(buf[p : p + body_len])
    p += body_len
    if v2:
        (topic_len,) = _I16.unpack_from(buf, p)
        p += 2
    else:
        topic_len = buf[p]
        p += 1
    topic_bytes = bytes(buf[p : p + topic_len])
    p += topic_len
    if p + 2 > end:
        raise RecordError(f"topic length {topic_len} does not fit TOTALSIZE {size}", size)
    (props_len,) = _I16.unpack_from(buf, p)
    p += 2
    props_bytes = bytes(buf[p : p + max(props_len, 0)])
    expected = record_size(body_len, topic_len, max(props_len, 0), sysflag, v2)
    if topic_len < 0 or props_len < 0 or expected != size:
        raise RecordError(f"TOTALSIZE {size} does not match its fields (expected {expected})", size)
    if check_crc and body_len > 0 and body_crc(body) != crc:
        raise RecordError(f"body CRC mismatch: stored {crc}, computed {body_crc(body)}", size)
    if expect_phy is not None and phy != expect_phy:
        raise RecordError(f"stored physical offset {phy} is not the record's position {expect_phy}", size)
    if inflate and sysflag & COMPRESSED_FLAG:  # as the consumer's client does: inflate, clear the flag
        try:
            body = compression.decompress(body, sysflag)
        except compression.BodyCompressionError as exc:
            raise RecordError(str(exc), size) from exc
        sysflag &= ~COMPRESSED_FLAG
    return Message(
        topic=topic_bytes.decode("utf-8", "replace"),
        body=body,
        queue_id=queue_id,
        properties=string_to_properties(props_bytes.decode("utf-8", "replace")) if props_len > 0 else {},
        queue_offset=queue_offset,
        phy_offset=phy,
        born_ts=born_ts,
        born_host=decode_host(born_raw),
        store_ts=store_ts,
        store_host=decode_host(store_raw),
        sysflag=sysflag,
        flag=flag,
        reconsume_times=reconsume,
        prepared_tx_offset=prepared,
        body_crc=crc,
        size=size,
        v2=v2,
    )


def blank_record(remaining: int) -> bytes:
    """§9 end-of-file marker: int32 bytes-left-in-file, then the blank magic."""
    return _SIZE_MAGIC.pack(remaining, BLANK_MAGIC)


def file_name(offset: int) -> str:
    """§3 a mapped file is named by its start offset, 20 digits."""
    return f"{offset:020d}"

"""The chaos oracle at soak scale: every message as (position, CRC-32 of its whole row), not as a row.

A 30-minute soak produces millions of messages; holding each as a Python dict
(``tests.oracle.replay``) took 19 GB.  Here one pass over the commitlog keeps,
per message, its physical offset and a CRC-32 of everything the sink must
carry (in arrays: 12 bytes a message), and only the latest value per key as a
dict.  Each sink is read the same way, a page or a record at a time, and
compared position by position; a differing CRC means a differing field.

The fingerprints are over the same fields the small tests compare whole
(``tests.tiering_helpers.tier_rows``, ``tests.kafka_helpers.mirror_oracle``,
``tests.kv_helpers.view_contents``), so a check here is that check, hashed.
"""

from __future__ import annotations

import zlib
from array import array
from dataclasses import dataclass, field

import numpy as np

from connectors.commitlog.reader import CommitLogReader
from connectors.kafka.records import key_partition
from connectors.kafka.sink import position_of
from connectors.tier.reader import TierReader
from streaming import config as cfg
from tests.kafka_helpers import iter_topic, mirror_place, mirror_record
from tests.oracle import message_row, normalize_arrow_row

PAGE = 50_000  # tier messages per read: ~15 MB of bodies at the soak's sizes


def crc(value) -> int:
    """CRC-32 of ``repr(value)``: equal values give equal CRCs (dicts with their items sorted)."""
    return zlib.crc32(repr(value).encode())


def row_digest(row: dict) -> int:
    """One message row (``tests.oracle.message_row`` or a normalized tier row), every field."""
    return crc(sorted((k, sorted(v.items()) if isinstance(v, dict) else v) for k, v in row.items()))


def record_digest(key: bytes | None, value: bytes | None, headers) -> int:
    """One Kafka record as ``mirror_oracle`` describes it: key, value and headers in order."""
    return crc((key, value, [(k, v) for k, v in headers]))


def body_digest(body: bytes | None) -> int | None:
    return None if body is None else zlib.crc32(body)


@dataclass
class Positions:
    """Positions in the order a sink holds them, each with its digest."""
    phy: array = field(default_factory=lambda: array("q"))
    digest: array = field(default_factory=lambda: array("I"))

    def add(self, phy: int, digest: int) -> None:
        self.phy.append(phy)
        self.digest.append(digest)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return np.frombuffer(self.phy, dtype=np.int64), np.frombuffer(self.digest, dtype=np.uint32)

    def __len__(self) -> int:
        return len(self.phy)


@dataclass
class Latest:
    """The latest message of one key: what the KV view and the compacted changelog must hold."""
    phy: int
    queue_id: int
    queue_offset: int
    store_ts: int
    deleted: bool
    body: int  # its CRC-32


@dataclass
class Expected:
    """What the sinks must hold, from one pass over the commitlog."""
    log: Positions = field(default_factory=Positions)  # every message, physical order (the tier)
    mirror: dict[tuple[str, int], Positions] = field(default_factory=dict)  # (Kafka topic, partition)
    queue_ends: dict[tuple[str, int], int] = field(default_factory=dict)  # next queue offset
    latest: dict[tuple[str, str], Latest] = field(default_factory=dict)  # deletes included
    end: int = 0  # where the log ends
    uniq: Positions = field(default_factory=Positions)  # every message's CRC-32 of its UNIQ_KEY


def expected(directory: str, kafka: cfg.KafkaConfig) -> Expected:
    """Replay ``directory`` with the plain decoder (``tests.oracle``), keeping digests only."""
    out = Expected()
    with CommitLogReader(directory, check_crc=True) as reader:
        for m in reader.messages():
            row = message_row(m)
            out.log.add(m.phy_offset, row_digest(row))
            out.uniq.add(m.phy_offset, zlib.crc32(m.properties.get("UNIQ_KEY", "").encode()))
            out.end = max(out.end, m.phy_offset + m.size)
            if not m.dispatched:  # PREPARED and ROLLBACK never enter a queue
                continue
            out.queue_ends[(m.topic, m.queue_id)] = m.queue_offset + 1
            out.mirror.setdefault(mirror_place(kafka, row), Positions()).add(m.phy_offset,
                                                                              record_digest(*mirror_record(row)))
            key = row["key"]
            if key is not None:
                out.latest[(m.topic, key)] = Latest(m.phy_offset, m.queue_id, m.queue_offset, m.store_ts,
                                                    m.op == "delete", zlib.crc32(m.body))
    return out


def tier(location: str) -> Positions:
    """Every committed tier message, sorted by position, a page of each queue at a time."""
    reader = TierReader(location)
    state = reader.committed()
    out = Positions()
    for topic, queue_id in reader.queues(state):
        offset = state.queues[(topic, queue_id)].low
        while True:
            page = reader.get(topic, queue_id, offset, PAGE, committed=state)
            if page.messages.num_rows == 0:
                break
            for row in page.messages.to_pylist():
                out.add(row["phy_offset"], row_digest(normalize_arrow_row(row)))
            offset = page.next_offset
    phy, digest = out.arrays()
    order = np.argsort(phy, kind="stable")
    return Positions(array("q", phy[order].tobytes()), array("I", digest[order].tobytes()))


def mirror(conf: cfg.Config, topics: list[str], timeout_s: float) -> dict[tuple[str, int], Positions]:
    """Every mirror record, per (Kafka topic, partition), in offset order."""
    out: dict[tuple[str, int], Positions] = {}
    for source in topics:
        topic = conf.kafka.mirror_topic.replace("{topic}", source)
        for p, r in iter_topic(conf.kafka.bootstrap, topic, timeout_s):
            out.setdefault((topic, p), Positions()).add(position_of(r.headers), record_digest(r.key, r.value, r.headers))
    return out


@dataclass
class Changelog:
    records: int = 0
    resent: int = 0  # records whose (topic, key, position) came before
    misplaced: int = 0  # keys in a partition the default partitioner does not give them
    compacted: dict[tuple[str, str], int | None] = field(default_factory=dict)  # last value's CRC, None: tombstone
    positions: dict[tuple[str, str], int] = field(default_factory=dict)  # each key's last record's position


def changelog(conf: cfg.Config, topics: list[str], timeout_s: float) -> Changelog:
    """The changelog topics read to their ends, compacted as Kafka's log cleaner would leave them."""
    out = Changelog()
    seen = array("q")  # hash of (topic, key, position): 8 bytes a record instead of a tuple
    for source in topics:
        topic = conf.kafka.changelog_topic.replace("{topic}", source)
        for p, r in iter_topic(conf.kafka.bootstrap, topic, timeout_s):
            out.records += 1
            out.misplaced += key_partition(r.key, conf.kafka.partitions) != p
            key = r.key.decode()
            seen.append(hash((source, key, position_of(r.headers))))
            out.compacted[(source, key)] = body_digest(r.value)
            out.positions[(source, key)] = position_of(r.headers)
    out.resent = len(seen) - len(np.unique(np.frombuffer(seen, dtype=np.int64)))
    return out


def changelog_expected(want: Expected) -> dict[tuple[str, str], int | None]:
    return {k: None if v.deleted else v.body for k, v in want.latest.items()}


def changelog_differences(have: Changelog, want: Expected, examples: int = 5) -> str:
    """How the compacted changelog differs from the replay's latest value per key, with a few keys
    and their positions (``""`` if it does not): a failure that says only "differs" cannot be told
    from a short read, a lost record or a stale one."""
    expected = changelog_expected(want)
    missing = sorted(set(expected) - set(have.compacted))
    extra = sorted(set(have.compacted) - set(expected))
    stale = sorted(k for k in set(expected) & set(have.compacted) if expected[k] != have.compacted[k])
    if not (missing or extra or stale):
        return ""

    def show(keys):
        return ", ".join(f"{t}/{k} (want phy {want.latest[(t, k)].phy if (t, k) in want.latest else None}, "
                         f"changelog phy {have.positions.get((t, k))})" for t, k in keys[:examples])

    return (f"{len(missing)} key(s) missing [{show(missing)}], {len(extra)} extra [{show(extra)}], "
            f"{len(stale)} with another value [{show(stale)}], of {len(expected)} keys in {have.records} records")


def kv_differences(entries, want: Expected) -> int:
    """Keys whose KV view entry (``KVView.entries()``) differs from the latest live value of the replay."""
    live = {k: v for k, v in want.latest.items() if not v.deleted}
    differing = 0
    for topic, e in entries:
        if e is None:
            continue
        v = live.pop((topic, e.key), None)
        if v is None or (e.phy_offset, e.queue_id, e.queue_offset, e.store_ts, zlib.crc32(e.body)) != (
                v.phy, v.queue_id, v.queue_offset, v.store_ts, v.body):
            differing += 1
    return differing + len(live)

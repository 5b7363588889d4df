"""The test oracle: the plain Python view of what a commitlog holds.

What was written comes from the writers' own ledger (``tests.ledger``) wherever
the tests' writers wrote the whole log; the replay through ``CommitLogReader``
(the simple one-record decoder, ``format.decode``, pinned by the golden vector of
docs/commitlog-format.md) is then checked against it, and used alone only where
another writer (a RocketMQ broker, a subprocess) wrote.  Never the Arrow fast
path or Spark, so those can be compared against it.
"""

from __future__ import annotations

import os

from connectors.brokers import DEFAULT_BROKER
from connectors.commitlog.format import Message
from connectors.commitlog.reader import CommitLogReader


def message_row(m: Message, key_property: str = "KEYS", broker: str = DEFAULT_BROKER) -> dict:
    """One message of ``broker``'s log as the message row of ``arrow.MESSAGE_SCHEMA`` (timestamps
    as epoch ms)."""
    return {
        "topic": m.topic,
        "queue_id": m.queue_id,
        "queue_offset": m.queue_offset,
        "phy_offset": m.phy_offset,
        "msg_id": m.msg_id,
        "key": m.key(key_property),
        "tags": m.tags,
        "body": m.body,
        "properties": dict(m.properties),
        "born_ts": m.born_ts,
        "store_ts": m.store_ts,
        "born_host": m.born_host,
        "store_host": m.store_host,
        "sysflag": m.sysflag,
        "flag": m.flag,
        "reconsume_times": m.reconsume_times,
        "op": m.op,
        "prepared_tx_offset": m.prepared_tx_offset,
        "size": m.size,
        "broker": broker,
    }


def entered_a_queue(row: dict) -> bool:
    """RocketMQ's rule, written out here rather than shared with the product: a PREPARED (0x4) or
    ROLLBACK (0xC) transaction record never reaches a consume queue; a plain message (0x0) and a
    COMMIT (0x8) do."""
    return row["sysflag"] & 0xC in (0x0, 0x8)


def replay(directory: str, start: int | None = None, end: int | None = None, broker: str = DEFAULT_BROKER) -> list[dict]:
    """Every complete message in the log, in physical order, as message rows of ``broker``."""
    with CommitLogReader(directory, check_crc=True) as reader:
        return [message_row(m, broker=broker) for m in reader.messages(start, end)]


def normalize_arrow_row(row: dict) -> dict:
    """An Arrow/Spark row in the oracle's shape: map as dict, timestamps as epoch ms."""
    out = dict(row)
    props = out["properties"]
    out["properties"] = dict(props.items() if isinstance(props, dict) else props)
    for col in ("born_ts", "store_ts"):
        ts = out[col]
        out[col] = ts if isinstance(ts, int) else round(ts.timestamp() * 1000)
    out["body"] = bytes(out["body"])
    return out


_CHECKED: dict[tuple, list[Message]] = {}


def written_messages(directory: str) -> list[Message]:
    """What the writers appended to ``directory`` (``tests.ledger``), checked against a replay
    through the reader; the replay alone where the ledger cannot know it all.

    A log checked before and not changed since (the same files, sizes and modification times, and
    the same ledger) is not replayed again: a test asks for it several times, and a million-message
    replay takes seconds."""
    from tests import ledger

    files = tuple((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in sorted(os.scandir(directory), key=lambda e: e.name))
    stored = ledger.stored(directory)
    seen = (os.path.realpath(directory), files, None if stored is None else len(stored))
    if seen not in _CHECKED:
        _CHECKED.clear()  # one log at a time: a test's logs are not asked for again by the next test
        _CHECKED[seen] = _written_messages(directory)
    return _CHECKED[seen]


def written_rows(directory: str, broker: str = DEFAULT_BROKER) -> list[dict]:
    """``written_messages`` as message rows of ``broker``: the oracle a test compares with."""
    return [message_row(m, broker=broker) for m in written_messages(directory)]


def _written_messages(directory: str) -> list[Message]:
    from tests import ledger

    with CommitLogReader(directory, check_crc=True) as reader:
        replayed = list(reader.messages())
    written = ledger.stored(directory)
    if written is None:
        return replayed
    first = replayed[0].phy_offset if replayed else None  # `commitlog gc` may have deleted older files
    tail = [m for m in written if first is not None and m.phy_offset >= first]
    assert [message_row(m) for m in replayed] == [message_row(m) for m in tail], \
        "replaying the commitlog through CommitLogReader differs from what the writer appended"
    return written


def view_fields(m: Message) -> dict:
    """What the KV view holds of a key whose latest message is ``m``."""
    return {"body": m.body, "phy_offset": m.phy_offset, "queue_id": m.queue_id, "queue_offset": m.queue_offset,
            "store_ts": m.store_ts, "deleted": m.op == "delete"}


def latest_per_key(directory: str, ttl: dict | None = None, now_ms: int | None = None,
                   with_tombstones: bool = False) -> dict:
    """The KV view a plain replay gives: (topic, key) -> its latest message's fields.

    Latest by physical offset; keyless messages and PREPARED/ROLLBACK records
    take no part; deletes remove the key (or, ``with_tombstones``, stay with
    ``deleted`` True); with ``ttl`` ({topic or "*": seconds}), keys whose latest
    put is older than the TTL at ``now_ms`` are gone.
    """
    latest: dict = {}
    for m in written_messages(directory):
        key = m.key("KEYS")
        if key is None or not m.dispatched:
            continue
        latest[(m.topic, key)] = view_fields(m)
    out = {}
    for (topic, key), v in latest.items():
        seconds = None if not ttl else ttl.get(topic, ttl.get("*"))
        expired = seconds is not None and v["store_ts"] + seconds * 1000 <= now_ms
        if with_tombstones or not (v["deleted"] or expired):
            out[(topic, key)] = v
    return out

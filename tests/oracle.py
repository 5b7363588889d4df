"""The test oracle: the plain Python view of what a commitlog holds.

Built on the simple one-record decoder (``format.decode``, itself pinned by the
golden vector of COMMITLOG_FORMAT.md §4.2), never on the Arrow fast path or
on Spark, so those can be compared against it.
"""

from __future__ import annotations

from connectors.commitlog.format import Message
from connectors.commitlog.reader import CommitLogReader


def message_row(m: Message, key_property: str = "KEYS") -> dict:
    """One message as the message row of DESIGN.md (timestamps as epoch ms)."""
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
    }


def replay(directory: str, start: int | None = None, end: int | None = None) -> list[dict]:
    """Every complete message in the log, in physical order, as message rows."""
    with CommitLogReader(directory, check_crc=True) as reader:
        return [message_row(m) for m in reader.messages(start, end)]


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

"""Object names in a tier, and the Parquet form of its objects.

    _log/<seq, 20 digits>.json                      commit records (what is visible)
    _log/<seq, 20 digits>.checkpoint.json           the whole committed state at <seq>
    _staging/<first physical offset, 20 digits>.parquet
                                                    one micro-batch part, every queue, sorted
    topic=<topic>/queue=<queue>/<base queue offset, 20 digits>.parquet
                                                    a sealed queue-dimension segment

Names starting with ``_`` are hidden from Spark's and DuckDB's directory
listings, so ``spark.read.parquet(tier)`` sees exactly the sealed segments.
Topic names are escaped like Hive partition values (Spark un-escapes them).
"""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq

from connectors.commitlog.arrow import MESSAGE_SCHEMA

LOG_PREFIX = "_log/"
STAGING_PREFIX = "_staging/"
SORT_KEYS = [("topic", "ascending"), ("queue_id", "ascending"), ("queue_offset", "ascending")]
ROW_GROUP_ROWS = 64 * 1024
COMPRESSION = "zstd"

# Hive's escapePathName set, plus space and control characters.
_ESCAPE = set('"#%\'*/:=?\\{[]^ ') | {chr(c) for c in range(0x20)} | {"\x7f"}


def escape_topic(topic: str) -> str:
    return "".join(f"%{ord(c):02X}" if c in _ESCAPE else c for c in topic)


def unescape_topic(text: str) -> str:
    out, i = [], 0
    while i < len(text):
        if text[i] == "%" and i + 2 < len(text) and all(c in "0123456789ABCDEFabcdef" for c in text[i + 1 : i + 3]):
            out.append(chr(int(text[i + 1 : i + 3], 16)))
            i += 3
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def segment_name(topic: str, queue_id: int, base_offset: int) -> str:
    return f"topic={escape_topic(topic)}/queue={queue_id}/{base_offset:020d}.parquet"


def staging_name(first_phy_offset: int) -> str:
    return f"{STAGING_PREFIX}{first_phy_offset:020d}.parquet"


def log_name(seq: int) -> str:
    return f"{LOG_PREFIX}{seq:020d}.json"


def checkpoint_name(seq: int) -> str:
    return f"{LOG_PREFIX}{seq:020d}.checkpoint.json"


def parse_log_name(name: str) -> tuple[int, bool] | None:
    """``(seq, is_checkpoint)`` for a commit-log object name, else None."""
    base = name[len(LOG_PREFIX) :]
    stem, _, rest = base.partition(".")
    if not stem.isdigit() or rest not in ("json", "checkpoint.json"):
        return None
    return int(stem), rest == "checkpoint.json"


def to_parquet(table: pa.Table) -> bytes:
    """Serialize rows of the message schema, zstd, in row groups of ``ROW_GROUP_ROWS``."""
    sink = io.BytesIO()
    pq.write_table(
        table.cast(MESSAGE_SCHEMA),
        sink,
        compression=COMPRESSION,
        row_group_size=ROW_GROUP_ROWS,
        write_statistics=True,
        use_dictionary=["topic", "key", "tags", "born_host", "store_host", "op"],
    )
    return sink.getvalue()


def from_parquet(data: bytes, filters=None) -> pa.Table:
    return pq.read_table(pa.BufferReader(data), schema=MESSAGE_SCHEMA, filters=filters)


def read_rows(data: bytes, filters, columns: list[str] | None = None) -> pa.Table:
    """Rows of one object that pass ``filters`` (row groups are skipped by their statistics)."""
    return pq.read_table(pa.BufferReader(data), schema=MESSAGE_SCHEMA, filters=filters, columns=columns)


def sort_rows(table: pa.Table) -> pa.Table:
    return table.sort_by(SORT_KEYS)

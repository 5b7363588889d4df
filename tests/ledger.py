"""The writers' own ledger: every message the tests' writers appended, with the physical and queue
offsets the writer gave it, kept by the writing side.

The end-to-end comparisons (``tiering_helpers.assert_tier_equals_commitlog``,
``kv_helpers.assert_all_equal_oracle``) take what was written from here, not from a replay
through ``CommitLogReader``: the source and every sink read with that reader, so a message it
dropped or held back at a file roll or at the live end would be missing from product and replay
alike.  The replay is checked against the ledger as one more reader.

A directory the ledger has no record of (``tierlog produce`` in a subprocess, a RocketMQ broker)
falls back to the replay; one that another writer appended to besides the ledger's fails the
replay check, so a test cannot mix the two unnoticed.
"""

from __future__ import annotations

import os

from connectors.commitlog.format import Message
from connectors.commitlog.writer import CommitLogWriter

_STORED: dict[str, list[Message]] = {}


def _key(directory: str) -> str:
    return os.path.realpath(directory)


def append(writer: CommitLogWriter, messages) -> list[Message]:
    """``writer.append_many(messages)``, recorded in the ledger of the writer's directory."""
    stored = writer.append_many(list(messages))
    _STORED.setdefault(_key(writer.directory), []).extend(stored)
    return stored


def stored(directory: str) -> list[Message] | None:
    """Every message the ledger saw appended to ``directory``, in physical order; None when it
    recorded nothing there."""
    key = _key(directory)
    return sorted(_STORED[key], key=lambda m: m.phy_offset) if key in _STORED else None

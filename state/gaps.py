"""Gaps: commitlog ranges the broker deleted before tierlog read them, passed under
``source.on_missing = "skip"``.

A gap is recorded as the readers skip it, like a quarantined range (the tier's commit record, the
metadata store, ``status``), with the reason ``DELETED_UNREAD``.  It is never silent: ``tierlog
status`` exits non-zero while any gap is not acknowledged, until an operator runs ``tierlog gap
ack``.  The acknowledgements live in a small JSON file beside the stores, not in the metadata
store, because ``gap ack`` runs while ``tierlog run`` holds that store's lock.
"""

from __future__ import annotations

import json
import os
import time

from connectors.commitlog.reader import DELETED_UNREAD

ACKS_FILE = "gap-acks.json"


def gaps(quarantined: list[dict]) -> list[dict]:
    """The gaps among the metadata store's quarantined ranges, in offset order."""
    return [q for q in quarantined if q.get("reason") == DELETED_UNREAD]


def acknowledged(state_dir: str) -> dict[str, float]:
    """Start offset (as a string) -> when it was acknowledged."""
    try:
        with open(os.path.join(state_dir, ACKS_FILE)) as fh:
            return json.load(fh)
    except FileNotFoundError:
        return {}


def unacknowledged(state_dir: str, quarantined: list[dict]) -> list[dict]:
    acks = acknowledged(state_dir)
    return [g for g in gaps(quarantined) if str(g["start_phy"]) not in acks]


def acknowledge(state_dir: str, found: list[dict]) -> list[dict]:
    """Acknowledge every gap in ``found`` not acknowledged yet; returns those."""
    acks = acknowledged(state_dir)
    new = [g for g in found if str(g["start_phy"]) not in acks]
    if new:
        acks.update({str(g["start_phy"]): time.time() for g in new})
        path = os.path.join(state_dir, ACKS_FILE)
        tmp = path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(acks, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    return new

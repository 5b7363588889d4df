"""The tier's commit records: the three kinds a writer appends to ``_log/broker=<b>/<seq>.json``.

Each is a JSON object; these types say which fields each kind has, and the builders are the only
places that make one.  ``TierLog.append`` adds ``v`` (the layout), ``seq`` and ``time_ms``;
``connectors.tier.manifest.check_record`` refuses a record of another layout or an unknown kind
before it is written or applied.
"""

from __future__ import annotations

from typing import Literal, NotRequired, TypedDict, Union


class LastRecord(TypedDict):
    """The commitlog record a batch ended with: where, how long, the CRC-32 of its bytes."""

    phy: int
    size: int
    crc32: int


class BatchRecord(TypedDict):
    """A micro-batch made visible: its staging objects, the commitlog range it covered."""

    type: Literal["batch"]
    batch_id: int
    source_start: int
    source_end: int
    staging: list[dict]  # StagingObject.to_json()
    last_record: LastRecord
    quarantined: NotRequired[list[dict]]  # commitlog ranges skipped under on_corrupt = quarantine
    filtered: NotRequired[dict]  # {"tier": topic class -> messages the tier's filter left out} (older records: every sink's)


class SealRecord(TypedDict):
    """Segments sealed, and the staging objects no queue needs any more."""

    type: Literal["seal"]
    segments: list[dict]  # Segment.to_json()
    retire: list[str]


class ExpireRecord(TypedDict):
    """Segments past retention, deleted after the grace."""

    type: Literal["expire"]
    segments: list[dict]


CommitRecord = Union[BatchRecord, SealRecord, ExpireRecord]


def batch_record(batch_id: int, source_start: int, source_end: int, staging: list[dict], last_record: LastRecord,
                 quarantined: list[dict] | None = None, filtered: dict | None = None) -> BatchRecord:
    record: BatchRecord = {"type": "batch", "batch_id": batch_id, "source_start": source_start,
                           "source_end": source_end, "staging": staging, "last_record": last_record}
    if quarantined:
        record["quarantined"] = quarantined  # in the tier too, so the record outlives the metadata store
    if filtered:
        record["filtered"] = filtered  # so a metadata store that missed this record counts it on catch-up
    return record


def seal_record(segments: list[dict], retire: list[str]) -> SealRecord:
    return {"type": "seal", "segments": segments, "retire": retire}


def expire_record(segments: list[dict]) -> ExpireRecord:
    return {"type": "expire", "segments": segments}

"""Typed errors of the tier package."""

from __future__ import annotations

from connectors.errors import TierlogError


class TierError(TierlogError):
    """Base of the tier errors."""


class ObjectNotFound(TierError):
    """The named object does not exist (any more)."""


class BucketNotFound(TierError):
    """The S3 bucket named in ``tier.location`` does not exist."""


class AccessDenied(TierError):
    """The credentials may not read or write the bucket or prefix."""


class TransientTierError(TierError):
    """Throttling, a 5xx or a timeout that outlasted the retries; trying later can succeed."""

    retriable = True


class InvalidObjectName(TierError):
    """An object name that would escape the tier root or cannot be stored."""


class TierRecordError(TierError):
    """The tier's commit records are inconsistent: a gap in sequence numbers, or an unreadable record.
    (Named apart from ``connectors.errors.TierlogError``, the root of every tierlog error.)"""


class NotFoundInTier(TierError):
    """A read named what the tier does not hold: no tier at the location, or no such topic."""

    @classmethod
    def topic(cls, topic: str, where: str, topics: list[str]) -> "NotFoundInTier":
        """No ``topic`` in ``where`` (the tier at X, the KV view at Y, ...), naming the topics there are."""
        there = f"topics: {', '.join(topics)}" if topics else "it holds no topic yet"
        return cls(f"no topic {topic!r} in {where}; {there}")

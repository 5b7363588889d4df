"""The backend a tier location names: ``s3://bucket/prefix`` or a directory."""

from __future__ import annotations

from connectors.tier.backend import Backend
from connectors.tier.copies import LocalCopies
from connectors.tier.posix import PosixBackend


def open_backend(location: str, *, create: bool = True, copies=None) -> Backend:
    """A backend for ``location``: ``s3://bucket/prefix`` or a directory path; ``create=False``
    (readers) never makes the directory; ``copies`` (a ``connectors.tier.copies.CopySettings``):
    keep local copies of the staging objects an S3 tier's consumers read back."""
    if location.startswith("s3://"):
        from connectors.tier.s3 import S3Backend  # boto3 loads only for an S3 tier

        if copies is not None and copies.max_bytes > 0:
            return LocalCopies(S3Backend(location), copies)
        return S3Backend(location)
    return PosixBackend(location, create=create)

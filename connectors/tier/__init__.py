"""The tier: storage backends (posix, S3), the segment layout and commit log, and readers."""

from connectors.tier.backend import Backend, ObjectInfo, open_backend

__all__ = ["Backend", "ObjectInfo", "open_backend"]

"""Typed errors of the commitlog package. Each names the file and physical offset."""

from __future__ import annotations

from connectors.errors import TierlogError


class CommitLogError(TierlogError):
    """Base of the commitlog errors."""


class CorruptRecordError(CommitLogError):
    """A record that cannot be a message: bad magic, impossible size, CRC mismatch, misplaced.

    Exit code 3.

    Corruption is never skipped silently: reading stops here.  ``file`` is the
    mapped file's path, ``offset`` the record's physical offset, ``size`` the
    TOTALSIZE it claims (None when unreadable).
    """

    exit_code = 3

    def __init__(self, file: str, offset: int, reason: str, size: int | None = None):
        self.file, self.offset, self.reason, self.size = file, offset, reason, size
        super().__init__(
            f"corrupt commitlog record in {file} at physical offset {offset}: {reason}. "
            "Reading stops here; inspect it with `tierlog inspect --from-phy "
            f"{offset} --limit 1`, and restore the file from a replica or move the "
            "damaged range aside before restarting."
        )

    def __reduce__(self):  # rebuilt from its fields where a staging process raised it
        return type(self), (self.file, self.offset, self.reason, self.size)


class LogLayoutError(CommitLogError):
    """The directory's mapped files are misnamed, missing or of unequal sizes."""


class OffsetOutOfRangeError(CommitLogError):
    """A physical offset below the first retained file or beyond the end of the log."""


class DeletedBeforeReadError(OffsetOutOfRangeError):
    """Commitlog files were deleted (the broker's retention, say) before tierlog read them: the
    messages in them are lost to tierlog.  Exit code 4."""

    exit_code = 4


class WriterLockedError(CommitLogError):
    """Another writer holds the commitlog's lock.  ``retriable``: it may be released."""

    retriable = True

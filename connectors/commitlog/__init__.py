"""The on-disk RocketMQ commitlog: record format, tail-safe reader, embedded writer."""

from connectors.commitlog.errors import (
    CommitLogError,
    CorruptRecordError,
    LogLayoutError,
    OffsetOutOfRangeError,
    WriterLockedError,
)
from connectors.commitlog.format import Message, decode, encode
from connectors.commitlog.reader import CommitLogReader, ScanResult
from connectors.commitlog.writer import CommitLogWriter

__all__ = [
    "CommitLogError",
    "CommitLogReader",
    "CommitLogWriter",
    "CorruptRecordError",
    "LogLayoutError",
    "Message",
    "OffsetOutOfRangeError",
    "ScanResult",
    "WriterLockedError",
    "decode",
    "encode",
]

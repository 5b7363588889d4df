"""Compressed message bodies, as RocketMQ's Java client writes them.

A producer compresses a body over ``compressMsgBodyOverHowmuch`` (4 KiB by default) and sets
sysflag bit 0; bits 8-10 name the codec (RocketMQ 5: 1 LZ4, 2 ZSTD, 3 ZLIB; 0, from clients
before 5.0, is zlib).  The broker stores the compressed bytes and the consumer's client
inflates them and clears bit 0.  tierlog's decoders do the same, so the tier, the KV view and
the mirror carry the producer's body; the stored size stays in ``size`` and the body CRC is
checked over the stored bytes.
"""

from __future__ import annotations

import zlib

CODEC_MASK = 0x700
CODECS = {0: "zlib", 1: "lz4", 2: "zstd", 3: "zlib"}


class BodyCompressionError(ValueError):
    """A body flagged compressed that its codec cannot inflate (or an unknown codec)."""


def codec(sysflag: int) -> str:
    code = (sysflag & CODEC_MASK) >> 8
    name = CODECS.get(code)
    if name is None:
        raise BodyCompressionError(f"unknown compression type {code} in sysflag 0x{sysflag:x}")
    return name


def compress(body: bytes, name: str = "zlib") -> bytes:
    """What the Java client stores for ``body`` with codec ``name`` (for writers and tests)."""
    if name == "zlib":
        return zlib.compress(body, 5)
    if name == "lz4":
        import lz4.frame

        return lz4.frame.compress(body)
    import zstandard

    return zstandard.ZstdCompressor(level=3).compress(body)


def decompress(body: bytes, sysflag: int) -> bytes:
    """The producer's body of a record whose sysflag has bit 0 set.  Raises
    :class:`BodyCompressionError` when the bytes are not what the flag says."""
    name = codec(sysflag)
    try:
        if name == "zlib":
            return zlib.decompress(body)
        if name == "lz4":
            import lz4.frame

            return lz4.frame.decompress(body)
        import zstandard

        # The Java client writes a streaming frame that may not state its content size.
        return zstandard.ZstdDecompressor().decompressobj().decompress(body)
    except Exception as exc:  # noqa: BLE001 - each codec raises its own error type
        raise BodyCompressionError(f"body flagged {name}-compressed does not inflate: {exc}") from exc


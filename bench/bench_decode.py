"""Decode benchmark: the Arrow fast path against a plain sequential read of the same files.

    python -m bench.bench_decode [--mb 512] [--body 1024] [--dir DIR]

Writes a commitlog of 1 KB messages (kept in DIR if given, for re-runs), then
measures on one core, in rounds whose order alternates (``--rounds``, median
reported):

* raw read: exactly the bytes that hold messages, read sequentially in 1 MiB
  chunks (the baseline; pre-sized files end in zeros the decoder never touches,
  and the baseline does not touch them either);
* decode: ``CommitLogReader.record_batches`` (header walk + Arrow batch), with
  and without the body CRC check;

both with the files in the page cache (warm) and evicted before each run
(cold, ``posix_fadvise(DONTNEED)``).  Ratios are what to compare: the machine
is shared and noisy.  Targets (issue 2): decode ≥ 25% of raw read speed and
≥ 300k msgs/s on one core.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

from bench.common import alternating, drop_cache, pin_to_one_core, report
from connectors.commitlog.reader import CommitLogReader
from connectors.commitlog.workload import Workload, append_in_chunks
from connectors.commitlog.writer import CommitLogWriter


def build_log(directory: str, mb: int, body: int) -> None:
    count = mb * (1 << 20) // (body + 150)
    w = Workload(messages=count, topics=4, queues=64, keys=100_000, body_size=body, seed=7)
    with CommitLogWriter(directory, file_size=256 << 20, fsync="never") as writer:
        append_in_chunks(writer, w.generate())


def raw_read(ranges: list[tuple[str, int]]) -> int:
    """Read the first ``length`` bytes of each ``(path, length)``; returns the bytes read."""
    total = 0
    for path, length in ranges:
        with open(path, "rb", buffering=0) as fh:
            left = length
            while left and (chunk := fh.read(min(1 << 20, left))):
                total += len(chunk)
                left -= len(chunk)
    return total


def decode(directory: str, check_crc: bool) -> int:
    with CommitLogReader(directory, check_crc=check_crc) as reader:
        return sum(b.num_rows for b in reader.record_batches(reader.first_offset()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=512, help="commitlog size in MiB (default 512)")
    ap.add_argument("--body", type=int, default=1024, help="body bytes (default 1024)")
    ap.add_argument("--dir", help="keep the generated commitlog here")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, order alternating (default 3)")
    args = ap.parse_args()
    directory = args.dir or tempfile.mkdtemp(prefix="tierlog-bench-")
    if not os.path.exists(os.path.join(directory, "00000000000000000000")):
        build_log(directory, args.mb, args.body)
    cpu = pin_to_one_core()
    with CommitLogReader(directory) as reader:
        scan = reader.scan(reader.first_offset())
        files = reader.files()
    paths = [f.path for f in files]
    # Each file up to where the messages end: the decoder's bytes, no zero-filled tail.
    ranges = [(f.path, max(0, min(scan.end, f.base + os.path.getsize(f.path)) - max(scan.start, f.base)))
              for f in files]
    data_bytes = sum(n for _, n in ranges)
    out = {"benchmark": "decode", "cpu": cpu, "messages": scan.records, "message_bytes": scan.nbytes,
           "data_bytes": data_bytes, "body_size": args.body, "files": len(paths), "rounds": args.rounds}
    for cache in ("warm", "cold"):
        before = (lambda: drop_cache(paths)) if cache == "cold" else None
        if cache == "warm":
            raw_read(ranges)
        runs = alternating({"raw": lambda: raw_read(ranges), "decode": lambda: decode(directory, False),
                            "decode_crc": lambda: decode(directory, True)}, args.rounds, before)
        assert runs["raw"]["result"] == data_bytes
        raw_rate = data_bytes / runs["raw"]["median_s"]
        row = {"raw_read_MBps": round(raw_rate / 1e6, 1), "raw_rounds_s": runs["raw"]["rounds_s"]}
        for tag in ("decode", "decode_crc"):
            d = runs[tag]
            assert d["result"] == scan.records
            rate = data_bytes / d["median_s"]  # the same bytes as the baseline
            row[f"{tag}_msgs_per_s"] = round(scan.records / d["median_s"])
            row[f"{tag}_MBps"] = round(rate / 1e6, 1)
            row[f"{tag}_vs_raw"] = round(rate / raw_rate, 3)
            row[f"{tag}_rounds_s"] = d["rounds_s"]
        out[cache] = row
    out["targets"] = {"decode_vs_raw": 0.25, "msgs_per_s": 300_000}
    report(out)
    if not args.dir:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()

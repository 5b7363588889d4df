"""A batch planner's header walks over a growing log: `./dev bench scan`.

    ./dev bench scan [--batches 12] [--batch-messages 50000] [--body 1024] [--rounds 3]

What the commitlog source does for each batch it plans, and the driver's tiering query for the
batch it expects next: walk the log's new headers to its frontier (``end_offset``), then cut the
batch from its start (``scan`` with ``max_bytes`` and ``split_bytes``).  The log grows by
``--batch-messages`` before each batch (appended off the clock), so each walk to the frontier sees
what a trigger's worth of appends left.  Measured: the CPU of the two calls, per record planned.

Baseline in the same run: the reader as it was before it kept the boundaries it walked
(``connectors.commitlog.boundaries``): every scan walks, and its cut into partitions is a step of
Python a record.  Both plan the same log at each step, in alternating order; rounds alternate
which goes first; every round's batches must agree exactly.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from bench.common import report
from connectors.commitlog import CommitLogReader, CommitLogWriter, Message
from connectors.commitlog.reader import ScanResult

SPLIT_BYTES = 32 << 20
BATCH_BYTES = 64 << 20


class _Forgets:
    path = None
    first = end = 0

    def take(self, *args):
        return None

    def add(self, *args):
        pass


class WalksEveryTime(CommitLogReader):
    """The reader before it kept boundaries: the scan's loop of that code, over a walk each time."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._boundaries = _Forgets()

    def scan(self, start, end=None, *, max_records=None, max_bytes=None, split_bytes=None):
        records = nbytes = 0
        stop, end = end, start
        splits: list[int] = []
        since_split = 0
        for span in self.spans(start, stop, max_records=max_records, max_bytes=max_bytes):
            if span.file.base > start and (not splits or splits[-1] != span.file.base):
                splits.append(span.file.base)
                since_split = 0
            for pos, size in zip(span.starts, span.sizes):
                if split_bytes and since_split >= split_bytes:
                    splits.append(span.file.base + pos)
                    since_split = 0
                since_split += size
            records += len(span.starts)
            nbytes += sum(span.sizes)
            end = span.end
        if stop is None and max_records is None and max_bytes is None:
            self._frontier = end
        return ScanResult(start, end, records, nbytes, tuple(s for s in splits if start < s < end))


def plan(reader: CommitLogReader, begin: int) -> ScanResult:
    reader.end_offset()
    return reader.scan(begin, max_bytes=BATCH_BYTES, split_bytes=SPLIT_BYTES)


def one_round(batches: int, per_batch: int, body: int, new_first: bool) -> dict:
    cpu = {"kept": 0.0, "walks_every_time": 0.0}
    planned = 0
    with tempfile.TemporaryDirectory(prefix="tierlog-bench-scan-") as directory:
        readers = {"kept": CommitLogReader(directory), "walks_every_time": WalksEveryTime(directory)}
        begins = dict.fromkeys(readers, 0)
        payload = bytes(range(256)) * (body // 256) + bytes(body % 256)
        with CommitLogWriter(directory, file_size=1 << 30, fsync="never") as writer:
            for b in range(batches):
                writer.append_many(Message(topic="topic-0", queue_id=i % 64, body=payload,
                                           properties={"KEYS": f"k{i:08d}"}) for i in range(per_batch))
                order = list(readers) if (b % 2 == 0) == new_first else list(readers)[::-1]
                results = {}
                for name in order:
                    t = time.process_time()
                    results[name] = plan(readers[name], begins[name])
                    cpu[name] += time.process_time() - t
                assert results["kept"] == results["walks_every_time"], results
                planned += results["kept"].records
                begins = dict.fromkeys(readers, results["kept"].end)
        for r in readers.values():
            r.close()
    return {name: seconds / planned * 1e6 for name, seconds in cpu.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--batch-messages", type=int, default=50_000)
    ap.add_argument("--body", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rounds = [one_round(args.batches, args.batch_messages, args.body, r % 2 == 0) for r in range(args.rounds)]
    kept = [r["kept"] for r in rounds]
    base = [r["walks_every_time"] for r in rounds]
    report({"benchmark": "scan", "batches": args.batches, "batch_messages": args.batch_messages, "body": args.body,
            "rounds": args.rounds,
            "method": "per batch: the log grows by batch_messages (off the clock), then end_offset and a scan "
                      f"from the batch's start (max_bytes {BATCH_BYTES >> 20} MiB, split_bytes {SPLIT_BYTES >> 20} "
                      "MiB); CPU of the two calls per record planned; baseline: the reader before it kept "
                      "the boundaries it walked, on the same log at each step, order alternating",
            "kept_us_per_record": [round(x, 3) for x in kept],
            "walks_every_time_us_per_record (baseline)": [round(x, 3) for x in base],
            "median_kept": round(statistics.median(kept), 3),
            "median_baseline": round(statistics.median(base), 3),
            "ratio": round(statistics.median(kept) / statistics.median(base), 3)})


if __name__ == "__main__":
    main()

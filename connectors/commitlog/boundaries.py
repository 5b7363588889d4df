"""Record boundaries a reader has walked, kept so that its next scan of the same bytes is a few
numpy calls instead of a second walk; and the cut of a run of records into partitions.

Why: each process that plans batches walks every new record header twice.  The commitlog
source walks to the frontier (Spark's progress, the follow cap), then from a batch's start to
cut it; the driver's tiering query does the same for the batch it expects next and for the lag
it logs.  A walk is a loop of Python over every header, a cost per record that grows with the
rate (``./dev bench scan``).  Kept here, the second walk of each process is gone.

What is kept: one run of consecutive complete records of one file, as ``scan`` returned them
(after its checks of the tail and of sizes that disagree with their record), at most
``CAPACITY`` records, the newest.  A boundary a walk found complete does not move: the log is
append-only.  A scan that walks on past the run starts its walk at the run's last record: a walk
cut short by a limit did not check that record's size against its fields, and a walk that stops
after a record checks it.
"""

from __future__ import annotations

import numpy as np

CAPACITY = 1 << 19  # records; about 8 MB, 0.5 GB of 1 KiB messages


class Boundaries:
    """The run of records kept for one reader: ``[first, end)`` of the file at ``path``."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self.path: str | None = None
        self.first = self.end = 0
        self._chunks: list[tuple[np.ndarray, np.ndarray]] = []  # absolute starts, sizes; in order
        self._count = 0

    def clear(self) -> None:
        self.path, self.first, self.end, self._chunks, self._count = None, 0, 0, [], 0

    def add(self, path: str, starts: np.ndarray, sizes: np.ndarray) -> None:
        """Keep records a walk found in the file at ``path`` (absolute ``starts``, ascending).  Records
        that meet the run kept so far on its boundaries join it; others start a new run, so what is
        kept stays one run whatever a walk was started at."""
        if not len(starts):
            return
        if len(starts) > 1 and not np.array_equal(starts[1:], starts[:-1] + sizes[:-1]):
            self.clear()  # a quarantined range inside: not one run
            return
        first, end = int(starts[0]), int(starts[-1] + sizes[-1])
        below, above = starts < self.first, starts >= self.end
        if (path != self.path or first > self.end or end < self.first
                or (below.any() and int(starts[below][-1] + sizes[below][-1]) != self.first)
                or (end > self.end and not (above.any() and int(starts[above][0]) == self.end))):
            self.path, self.first, self.end, self._chunks, self._count = path, first, end, [(starts, sizes)], len(starts)
        else:
            if below.any():
                self._chunks.insert(0, (starts[below], sizes[below]))
                self._count += int(below.sum())
                self.first = first
            if end > self.end:
                self._chunks.append((starts[above], sizes[above]))
                self._count += int(above.sum())
                self.end = end
        if self._count > self.capacity:
            kept_starts, kept_sizes = self._joined()
            self._chunks = [(kept_starts[-self.capacity:], kept_sizes[-self.capacity:])]
            self._count, self.first = self.capacity, int(self._chunks[0][0][0])

    def _joined(self) -> tuple[np.ndarray, np.ndarray]:
        if len(self._chunks) > 1:
            self._chunks = [(np.concatenate([c[0] for c in self._chunks]), np.concatenate([c[1] for c in self._chunks]))]
        return self._chunks[0]

    def take(self, path: str, start: int, end: int | None, max_records: int | None,
             max_bytes: int | None) -> tuple[np.ndarray, np.ndarray, bool] | None:
        """The kept records a scan from ``start`` takes under its limits (at least one, as a scan
        takes), and whether the scan goes on walking after them (then from the run's last record,
        which is no longer kept); None when ``start`` is not a kept boundary, or ``end`` falls
        inside the run off a boundary (a walk then says what is wrong)."""
        if path != self.path or not self.first <= start < self.end:
            return None
        starts, sizes = self._joined()
        i = int(np.searchsorted(starts, start))
        if i == len(starts) or starts[i] != start:
            return None
        starts, sizes = starts[i:], sizes[i:]
        self._chunks, self._count, self.first = [(starts, sizes)], len(starts), start  # earlier ones are behind it
        n, go_on = len(starts), end is None or end > self.end
        if not go_on:
            n = int(np.searchsorted(starts + sizes, end, side="right"))
            if end != (starts[n - 1] + sizes[n - 1] if n else start):
                return None
        if max_records is not None and max_records < n:
            n, go_on = max_records, False
        if max_bytes is not None:
            fits = max(1, int(np.searchsorted(np.cumsum(sizes[:n]), max_bytes, side="right")))
            if fits < n:
                n, go_on = fits, False
        if go_on:
            n -= 1
            if not n:
                return None
            self._chunks, self._count, self.end = [(starts[:n], sizes[:n])], n, int(starts[n - 1] + sizes[n - 1])
        return starts[:n], sizes[:n], go_on


def place_splits(starts: np.ndarray, sizes: np.ndarray, since: int, split_bytes: int | None,
                 out: list[int]) -> int:
    """Append to ``out`` where a run of records is cut into partitions of about ``split_bytes``:
    before each record once the bytes since the last cut (``since`` at the run's start) reach
    ``split_bytes``.  Returns the bytes since the last cut at the run's end.

    Why not a loop: it was a step of Python a record, as dear as the walk itself."""
    if not len(sizes):
        return since
    total = int(sizes.sum())
    if not split_bytes:
        return since + total
    before = np.cumsum(sizes) - sizes  # the run's bytes before each record
    j, offset = 0, since  # bytes since the cut before record i (i >= j): offset + before[i] - before[j]
    while True:
        i = max(j, int(np.searchsorted(before, split_bytes - offset + before[j], side="left")))
        if i >= len(sizes):
            return offset + total - int(before[j])
        out.append(int(starts[i]))
        j, offset = i, 0

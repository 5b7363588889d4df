"""A batch of Kafka records as columns: what a sink hands its producer in one call.

Why columns: the mirror sends every message of a tier batch, and a record built as Python objects
(its key, value and a list of header tuples) cost most of the sending thread's time.  The native
producer reads these columns' Arrow buffers straight into librdkafka; the other producers turn
the rows they send into Python objects (``python_rows``), as the sinks did before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

# The properties as Kafka headers want them: values as bytes (a cast of the same buffers).
HEADERS_TYPE = pa.map_(pa.string(), pa.binary())


@dataclass(frozen=True)
class Records:
    """Row i is a record to ``topics[topic[i]]``, partition ``partition[i]``, with key ``key[i]``
    (null: none), value ``value[value_rows[i]]`` (``value_rows`` None: ``value[i]``; null: a
    tombstone), timestamp ``timestamp[i]`` (epoch ms; 0: now), and as headers first row i's
    ``pairs`` (a map array of names to values; None: none), then each ``(name, column)`` of
    ``headers`` with ``column[i]`` as its value.  ``position[i]`` is its source position
    (``connectors.kafka.sink``).

    Arrow columns are binary or string arrays, chunked or not, or dictionary arrays of them (a
    value shared by many rows: the broker's name, the source topic).  The numpy columns are
    ``int64``."""

    topics: tuple[str, ...]
    topic: np.ndarray
    partition: np.ndarray
    key: pa.Array | pa.ChunkedArray
    value: pa.Array | pa.ChunkedArray
    timestamp: np.ndarray
    position: np.ndarray
    headers: tuple[tuple[str, pa.Array], ...] = ()
    pairs: pa.MapArray | None = None
    value_rows: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.position)

    def select(self, rows: np.ndarray) -> Records:
        """These records' ``rows``, in that order (the values stay where they are)."""
        index = pa.array(rows, pa.int64())
        return Records(
            topics=self.topics, topic=self.topic[rows], partition=self.partition[rows], key=self.key.take(index),
            value=self.value, value_rows=rows if self.value_rows is None else self.value_rows[rows],
            timestamp=self.timestamp[rows], position=self.position[rows],
            headers=tuple((name, column.take(index)) for name, column in self.headers),
            pairs=None if self.pairs is None else self.pairs.take(index))

    def value_sizes(self) -> np.ndarray:
        """Each row's value in bytes (0 for a null)."""
        sizes = pc.fill_null(pc.binary_length(self.value), 0)
        sizes = (sizes.to_numpy() if isinstance(sizes, pa.Array) else sizes.to_numpy()).astype(np.int64)
        return sizes if self.value_rows is None else sizes[self.value_rows]

    def python_rows(self, rows: np.ndarray):
        """``(topic, partition, key, value, headers, position, timestamp)`` of each of ``rows``, in
        that order, as Python objects: what ``Producer.send`` takes."""
        index = pa.array(rows, pa.int64())
        topics = [self.topics[t] for t in self.topic[rows].tolist()]
        keys = _binary(self.key).take(index).to_pylist()
        values = take_pylist(self.value, rows if self.value_rows is None else self.value_rows[rows])
        columns = [(name, _binary(column).take(index).to_pylist()) for name, column in self.headers]
        if self.pairs is not None:
            pairs, starts, ends = property_pairs(self.pairs.take(index))
        else:
            pairs, starts, ends = [], [0] * len(rows), [0] * len(rows)
        # Built as they are sent: a list of a batch's headers, all alive at once, made Python's
        # garbage collector walk them over and over, nearly doubling the sink's own time a record.
        headers = ([*pairs[s:e], *[(name, values_[i]) for name, values_ in columns]]
                   for i, (s, e) in enumerate(zip(starts, ends)))
        return zip(topics, self.partition[rows].tolist(), keys, values, headers, self.position[rows].tolist(),
                   self.timestamp[rows].tolist())


def take_pylist(column, rows: np.ndarray) -> list:
    """``column[rows]`` as Python objects, chunk by chunk.  Why not ``column.take(rows)``: Arrow
    joins a chunked binary column into one buffer first, and a batch's bodies (as the tier reader
    left them, in many chunks) are hundreds of MB, copied again for every slice."""
    if isinstance(column, pa.Array):
        return column.take(pa.array(rows, pa.int64())).to_pylist()
    out: list = [None] * len(rows)
    ends = np.cumsum([len(chunk) for chunk in column.chunks])
    which = np.searchsorted(ends, rows, side="right")
    for c in np.unique(which).tolist():
        at = np.flatnonzero(which == c)
        start = int(ends[c - 1]) if c else 0
        for i, value in zip(at.tolist(), column.chunk(c).take(pa.array(rows[at] - start)).to_pylist()):
            out[i] = value
    return out


def _binary(array):
    """A binary, string or dictionary column as plain binary, chunks joined."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks() if array.num_chunks != 1 else array.chunk(0)
    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    return array if pa.types.is_binary(array.type) else pc.cast(array, pa.binary())


def property_pairs(properties: pa.MapArray) -> tuple[list, list[int], list[int]]:
    """Every row's properties as header pairs (name, bytes value): row i's are
    ``pairs[starts[i]:ends[i]]``; a null map has none.

    Why not ``to_pylist``: it builds a list of tuples per row, ten times what the flat keys and
    values cost (a cast of the same buffers makes the values bytes)."""
    properties = pc.cast(properties, HEADERS_TYPE)
    pairs = list(zip(properties.keys.to_pylist(), properties.items.to_pylist()))
    offsets = properties.offsets.to_pylist()  # into the flat keys and values, slices included
    starts, ends = offsets[:-1], offsets[1:]
    if properties.null_count:
        valid = properties.is_valid().to_pylist()
        starts = [s if v else 0 for s, v in zip(starts, valid)]
        ends = [e if v else 0 for e, v in zip(ends, valid)]
    return pairs, starts, ends


def digits(column) -> pa.Array:
    """Each integer of ``column`` as its decimal digits (``b"%d" % n``), a column at a time."""
    return pc.cast(pc.cast(column, pa.string()), pa.binary())


def constant(value: bytes, rows: int) -> pa.DictionaryArray:
    """``value`` for each of ``rows`` rows, stored once."""
    return pa.DictionaryArray.from_arrays(pa.array(np.zeros(rows, np.int32)), pa.array([value], pa.binary()))

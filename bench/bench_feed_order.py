"""The mirror's read of a staging object, put in physical order: `./dev bench feed_order`.

    ./dev bench feed_order [--body 16384] [--mb 200] [--queues 64] [--rounds 4] [--gap 1.5]

A staging object holds its rows in queue order (topic, queue, offset); the mirror sends them in
physical order, each body as a Python object.  Measured, per GB of bodies: the CPU of the process
(user and kernel) to read the object (``pq.read_table`` of its bytes, the mirror's columns), put
it in physical order and turn its bodies into Python objects, as ``feed.read_unsorted`` and the
mirror did from stop 86 until its records went to librdkafka from the Arrow buffers: the other
columns taken in order, the bodies reordered as Python objects (``_taken``, kept here).

Baseline in the same run: the code before, which sorted the whole table (``Table.sort_by``, the
bodies copied in order by Arrow) and then turned the sorted bodies into Python objects.  Before
each measurement the process sleeps ``--gap`` seconds: pyarrow's allocator (mimalloc) gives freed
memory back to the kernel after 1 s, and the mirror's batches at 100 MB/s of 16 KiB came every
4 s, so each one writes into memory faulted in afresh, as here.  Rounds alternate which way goes
first; both ways' bodies must be equal, in the same order.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench.common import report
from connectors.kafka.mirror_sink import ROW, in_order
from connectors.tier.feed import Unsorted


def staging_object(body: int, mb: int, queues: int) -> bytes:
    """An object shaped as the stager writes one: rows in queue order, a row group per queue, zstd."""
    rows = max(queues, mb * 1_000_000 // body)
    rng = np.random.default_rng(7)
    pool = [rng.bytes(body) for _ in range(256)]
    queue = np.arange(rows) % queues
    order = np.lexsort((np.arange(rows), queue))  # queue, then physical order within the queue
    phy = np.arange(rows, dtype=np.int64) * (body + 200)
    table = pa.table({
        "topic": pa.array(["orders"] * rows),
        "queue_id": pa.array(queue[order], pa.int32()),
        "queue_offset": pa.array(order // queues, pa.int64()),
        "phy_offset": pa.array(phy[order]),
        "body": pa.array([pool[i % 256] for i in order], pa.binary()),
    })
    out = io.BytesIO()
    pq.write_table(table, out, compression="zstd", row_group_size=rows // queues + 1)
    return out.getvalue()


def sorted_then_python(data: bytes) -> list:
    table = pq.read_table(pa.BufferReader(data)).sort_by("phy_offset")
    return table["body"].to_pylist()


def unsorted_then_python(data: bytes) -> list:
    bodies = []
    for batch, unsorted in in_order(Unsorted.of(pq.read_table(pa.BufferReader(data)))):  # as the mirror sends them
        bodies += _taken(unsorted, batch.column(ROW))
    return bodies


def _taken(bodies: pa.ChunkedArray, rows: pa.Array) -> list[bytes]:
    """``bodies.take(rows).to_pylist()``, every body made a Python object and the list reordered."""
    index = rows.to_numpy(zero_copy_only=False)
    if 2 * len(index) < len(bodies):
        return bodies.take(rows).to_pylist()
    flat = bodies.to_pylist()
    return [flat[i] for i in index.tolist()]


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--body", type=int, default=16384, help="body bytes (default 16384)")
    parser.add_argument("--mb", type=int, default=200, help="MB of bodies in the object (default 200)")
    parser.add_argument("--queues", type=int, default=64, help="queues in the object (default 64)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds, alternating which way goes first")
    parser.add_argument("--gap", type=float, default=1.5, help="seconds before each measurement (default 1.5)")
    args = parser.parse_args()
    data = staging_object(args.body, args.mb, args.queues)
    ways = {"unsorted": unsorted_then_python, "sorted": sorted_then_python}
    gb = args.mb / 1000
    took: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(args.rounds):
        names = list(ways) if r % 2 == 0 else list(reversed(ways))
        bodies = {}
        for name in names:
            time.sleep(args.gap)
            before = cpu_s()
            bodies[name] = ways[name](data)
            took[name].append((cpu_s() - before) / gb)
        assert bodies["unsorted"] == bodies["sorted"], "the two ways put different bodies in order"
        del bodies
    new, old = statistics.median(took["unsorted"]), statistics.median(took["sorted"])
    report({"benchmark": "feed_order", "body_bytes": args.body, "object_mb": args.mb, "queues": args.queues,
            "rounds": args.rounds, "gap_s": args.gap,
            "cpu_s_per_gb": {"unsorted_then_python": [round(x, 3) for x in took["unsorted"]],
                             "sorted_then_python (the code before)": [round(x, 3) for x in took["sorted"]]},
            "median_cpu_s_per_gb": {"unsorted_then_python": round(new, 3), "sorted_then_python": round(old, 3)},
            "ratio": round(new / old, 3)})


if __name__ == "__main__":
    main()

"""Spark's stateful step of the compaction query alone, by the shape of the rows it is handed.

The JVM's CPU for the rows in each shape they could cross in, against the shape of the code before,
in the same session.

    python -m bench.bench_state_step [--files 6] [--rows 80000] [--keys 100000] [--rounds 3]
                                     [--shapes reduced,filtered,joined]

The rows are what the ``tierfeed`` source yields under ``latestPerKey``: each key's last keyed
message of a staging object.  ``--files`` Parquet files each hold ``--rows`` draws of ``--keys``
keys (one topic), reduced to each key's last, as the source reduces a partition.  A query reads
them one file a micro-batch (``maxFilesPerTrigger``), keeps the largest offset per key in Spark's
RocksDB state store (``update`` mode, availableNow) and hands each batch to the driver with
``toArrow``, as the compaction query does, with this project's session settings (the JIT's first
tier only, 4 shuffle partitions).

Shapes:

reduced   ``topic, key, phy_offset``, ``streaming.queries.compaction.latest_per_key.max_per_key``: the service's.
filtered  the same with ``sysflag`` and the filter ``latest_per_key`` puts before the aggregation
          (``keyed_messages``): the code before.
joined    one string column ``topic + NUL + key``: a state of another shape, for what such a
          change would buy (not the service's; its checkpoints could not be kept).

Each run is a new checkpoint; a warm-up run of the first shape goes first (Spark compiles its
plans then).  Measured per run from /proc: the CPU of the JVM's executor task threads (Spark's
operators, the state store, Arrow to Python) and of the whole JVM; the shapes alternate, the order
reversed every other round; figures are per round and medians, and each shape's median against
``filtered``'s.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import time

from bench.common import report

SHAPES = ("reduced", "filtered", "joined")
TOPIC = "TopicTest"


def write_files(root: str, files: int, rows: int, keys: int) -> int:
    """The files of every shape, the same keys and offsets in each; returns the rows written."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng, phy, total = random.Random(7), 0, 0
    for shape in SHAPES:
        os.makedirs(os.path.join(root, shape))
    for f in range(files):
        last: dict[int, int] = {}
        for _ in range(rows):
            last[rng.randrange(keys)] = phy
            phy += 2100  # a 2 KB message's place in the log
        names = [f"order-{k:08d}-{k * 7919 % 100003:06d}" for k in last]
        offsets = pa.array(list(last.values()), pa.int64())
        topic = pa.array([TOPIC] * len(names))
        tables = {
            "reduced": pa.table({"topic": topic, "key": names, "phy_offset": offsets}),
            "filtered": pa.table({"topic": topic, "key": names, "phy_offset": offsets,
                                  "sysflag": pa.array(np.zeros(len(names), np.int32))}),
            "joined": pa.table({"tk": [f"{TOPIC}\0{k}" for k in names], "phy_offset": offsets}),
        }
        for shape, table in tables.items():
            pq.write_table(table, os.path.join(root, shape, f"{f:04d}.parquet"))
        total += len(names)
    return total


def jvm_cpu_s(pid: int) -> dict:
    """CPU seconds of the JVM's executor task threads and of all its threads, from /proc, the
    threads sorted as the cost ledger sorts them (``bench.bench_ledger``)."""
    from bench.bench_ledger import TICK, _part, _stat

    tasks, out = _part("jvm", "Executor task"), {"tasks": 0.0, "jvm": 0.0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        ticks = _stat(f"/proc/{pid}/task/{tid}/stat")
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as fh:
                comm = fh.read().strip()
        except OSError:
            continue  # ended meanwhile: its time is in neither figure, the same for every shape
        if ticks is None:
            continue
        cpu = (ticks[0] + ticks[1]) / TICK
        out["jvm"] += cpu
        if _part("jvm", comm) == tasks:
            out["tasks"] += cpu
    return out


def query(spark, root: str, shape: str):
    from pyspark.sql import functions as F

    from streaming.queries.compaction.latest_per_key import latest_per_key, max_per_key

    schema = {"reduced": "topic string, key string, phy_offset long",
              "filtered": "topic string, key string, phy_offset long, sysflag int",
              "joined": "tk string, phy_offset long"}[shape]
    rows = spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).parquet(os.path.join(root, shape))
    if shape == "reduced":
        return max_per_key(rows)
    if shape == "filtered":
        return latest_per_key(rows)
    return rows.groupBy("tk").agg(F.max("phy_offset").alias("phy_offset"))


def run_once(spark, pid: int, root: str, shape: str, checkpoint: str) -> dict:
    out = {"rows": 0, "batches": 0}

    def handle(df, _batch_id):
        out["rows"] += df.toArrow().num_rows
        out["batches"] += 1

    before, t0 = jvm_cpu_s(pid), time.monotonic()
    q = (query(spark, root, shape).writeStream.outputMode("update").option("checkpointLocation", checkpoint)
         .foreachBatch(handle).trigger(availableNow=True).start())
    q.awaitTermination()
    after = jvm_cpu_s(pid)
    return {**out, "wall_s": round(time.monotonic() - t0, 2), "tasks_cpu_s": round(after["tasks"] - before["tasks"], 2),
            "jvm_cpu_s": round(after["jvm"] - before["jvm"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=6, help="micro-batches, one Parquet file each")
    parser.add_argument("--rows", type=int, default=80_000, help="draws of a key per file, before its reduction")
    parser.add_argument("--keys", type=int, default=100_000, help="distinct keys the draws are made from")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each shape, the order reversed every other round")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    args = parser.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    if not shapes or set(shapes) - set(SHAPES):
        parser.error(f"--shapes: of {', '.join(SHAPES)}, comma-separated")

    from streaming.runtime.session import build_session

    root = tempfile.mkdtemp(prefix="tierlog-bench-state-")
    try:
        rows = write_files(os.path.join(root, "data"), args.files, args.rows, args.keys)
        spark = build_session("bench-state-step", "local[2]")
        pid = int(spark.sparkContext._jvm.ProcessHandle.current().pid())
        warm = run_once(spark, pid, os.path.join(root, "data"), shapes[0], os.path.join(root, "ck-warm"))
        runs: dict[str, list[dict]] = {s: [] for s in shapes}
        for r in range(args.rounds):
            for shape in (shapes if r % 2 == 0 else shapes[::-1]):
                runs[shape].append(run_once(spark, pid, os.path.join(root, "data"), shape,
                                            os.path.join(root, f"ck-{r}-{shape}")))
        spark.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    medians = {s: {k: statistics.median(x[k] for x in runs[s]) for k in ("tasks_cpu_s", "jvm_cpu_s", "wall_s")}
               for s in shapes}
    base = medians.get("filtered")
    report({
        "rows_in": rows, "batches": args.files, "keys": args.keys, "warm_up": warm, "runs": runs, "medians": medians,
        "tasks_us_per_row": {s: round(m["tasks_cpu_s"] / rows * 1e6, 2) for s, m in medians.items()},
        "tasks_cpu_vs_filtered": base and {s: round(m["tasks_cpu_s"] / base["tasks_cpu_s"], 3)
                                           for s, m in medians.items()},
        "jvm_cpu_vs_filtered": base and {s: round(m["jvm_cpu_s"] / base["jvm_cpu_s"], 3) for s, m in medians.items()},
    })


if __name__ == "__main__":
    main()

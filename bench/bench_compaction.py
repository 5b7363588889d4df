"""The compaction query (issue 4): input rows/s and memory, against a stateless read in the same run.

    python -m bench.bench_compaction [--keys 1000000] [--updates 500000] [--batch 100000] [--body 100]
                                     [--rounds 2] [--python-batches 3]

The commitlog holds ``--keys`` messages with distinct keys, then ``--updates``
puts and deletes of random keys among them.  Every run reads it with the same
source, ``maxRecordsPerTrigger = --batch``, and availableNow:

read        the same columns, no state, a noop sink: the baseline.
state       the latest-per-key aggregation (RocksDB state store), noop sink.
full        the compaction query as ``tierlog run`` runs it: aggregation, bodies
            read from the commitlog, the KV view (rocksdict), TTL sweep.
python      (``--python-batches`` batches only) the same state kept by a Python
            ``transformWithStateInPandas`` processor: the alternative the
            issue asks to compare with.

Throughput is marginal and wall clock: input rows of every batch but the first
(Spark's first batch starts workers and compiles plans), over the time from the
end of the first batch to the end of the run, Spark's planning between batches
included, and for ``full`` the last batch's view update on the apply thread
too.  A warm-up run goes first, then ``--rounds`` rounds of read, state and
full, the order reversed every other round; the figures are medians over the
rounds.  Memory: peak RSS of the JVM and of all Python workers during each
run, sampled from /proc, and the state store's own memory figure per batch as
the number of keys in state grows.  Targets (issue 34): >= 150k input rows/s
for ``full``; state memory that does not grow with the key count.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import threading
import time

from bench.common import descendants, report
from connectors.commitlog.reader import ReaderOptions
from connectors.commitlog.format import Message
from connectors.commitlog.writer import CommitLogWriter
from state.kv import KVView
from streaming.queries.compaction.latest_per_key import SOURCE_COLUMNS, latest_per_key
from streaming.runtime.checkpoints import foreach_batch
from state.kv_writer import CompactionSettings
from streaming.queries.compaction.handler import CompactionHandler


def produce(directory: str, keys: int, updates: int, body: int) -> int:
    rng = random.Random(5)
    order = list(range(keys))
    rng.shuffle(order)

    def messages():
        for i, k in enumerate(order):
            yield Message(topic=f"t{k % 4}", queue_id=k % 8, body=rng.randbytes(body), properties={"KEYS": f"k{k:08d}"})
        for i in range(updates):
            k = rng.randrange(keys)
            props = {"KEYS": f"k{k:08d}"}
            if rng.random() < 0.1:
                props["KV_OP"] = "DELETE"
            yield Message(topic=f"t{k % 4}", queue_id=k % 8, body=b"" if "KV_OP" in props else rng.randbytes(body),
                          properties=props)

    with CommitLogWriter(directory, file_size=256 << 20, fsync="never") as writer:
        batch = []
        for m in messages():
            batch.append(m)
            if len(batch) == 10_000:
                writer.append_many(batch)
                batch = []
        writer.append_many(batch)
    return keys + updates


class RssSampler:
    """Peak resident memory of the JVM and of the Python workers (descendants of this process)."""

    def __init__(self, interval: float = 0.25):
        self.interval = interval
        self.peak = {"jvm_mb": 0.0, "python_workers_mb": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        while not self._stop.is_set():
            jvm = workers = 0.0
            for pid, cmdline, rss in _descendants(os.getpid()):
                if "java" in cmdline.split(" ")[0]:
                    jvm += rss
                elif "pyspark" in cmdline:
                    workers += rss
            self.peak["jvm_mb"] = max(self.peak["jvm_mb"], jvm)
            self.peak["python_workers_mb"] = max(self.peak["python_workers_mb"], workers)
            self._stop.wait(self.interval)


def _descendants(root: int):
    out = []
    for pid in descendants(root):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/status") as fh:
                rss = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:")) / 1024
        except (OSError, StopIteration):
            continue
        out.append((pid, cmdline, rss))
    return out


def source(spark, directory: str, batch: int):
    return (spark.readStream.format("commitlog").option("path", directory)
            .option("maxRecordsPerTrigger", batch).option("columns", ",".join(SOURCE_COLUMNS)).load())


def run(stream, process, checkpoint: str, update: bool = True, max_batches: int | None = None, after=None) -> dict:
    """Run to the end of the log (or ``max_batches``); ``after()`` is part of the run (the last
    batch's apply).  Rows/s over the wall clock from the first batch's end."""
    ends: list[float] = []

    def timed(df, batch_id):
        process(df, batch_id)
        ends.append(time.perf_counter())
    writer = stream.writeStream.foreachBatch(timed).option("checkpointLocation", checkpoint)
    if update:
        writer = writer.outputMode("update")
    with RssSampler() as rss:
        if max_batches is None:
            query = writer.trigger(availableNow=True).start()
            query.awaitTermination()
            if after:
                after()
            done = time.perf_counter()
        else:
            query = writer.trigger(processingTime="0 seconds").start()
            while len(ends) < max_batches and query.isActive:
                time.sleep(0.2)
            query.stop()
            done = ends[-1]
    if query.exception() is not None:
        raise RuntimeError(f"the benchmark query failed: {query.exception()}")
    progress = [p for p in query.recentProgress if p["numInputRows"]][: len(ends)]
    rows = sum(p["numInputRows"] for p in progress[1:])
    seconds = done - ends[0]
    out = {"batches": len(progress), "rows_per_s": round(rows / seconds) if rows and seconds > 0 else None,
           "steady_rows": rows, "steady_s": round(seconds, 2),
           "batch_s_median": sorted(p["durationMs"]["triggerExecution"] for p in progress)[len(progress) // 2] / 1000,
           **{k: round(v) for k, v in rss.peak.items()}}
    memory = [op["memoryUsedBytes"] for p in progress for op in p.get("stateOperators", [])]
    if memory:
        out["state_memory_mb_first_last_max"] = [round(m / 2**20, 1) for m in (memory[0], memory[-1], max(memory))]
    return out


def python_processor():
    """A transformWithStateInPandas processor keeping the same state: the latest physical offset per key."""
    import pandas as pd
    from pyspark.sql.streaming import StatefulProcessor

    class Latest(StatefulProcessor):
        def init(self, handle):
            self.latest = handle.getValueState("latest", "phy_offset long")

        def handleInputRows(self, key, rows, timerValues):
            newest = max(int(pdf["phy_offset"].max()) for pdf in rows)
            current = self.latest.get() if self.latest.exists() else None
            if current is None or current[0] < newest:
                self.latest.update((newest,))
                yield pd.DataFrame({"topic": [key[0]], "key": [key[1]], "phy_offset": [newest]})

        def close(self):
            pass

    return Latest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--updates", type=int, default=500_000)
    parser.add_argument("--batch", type=int, default=100_000)
    parser.add_argument("--body", type=int, default=100)
    parser.add_argument("--python-batches", type=int, default=3, help="0 skips the Python processor run")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of read, state and full, order alternating")
    args = parser.parse_args()

    from streaming.runtime.checkpoints import LOCAL_FILE_MANAGER  # as the service's session (plan.session_conf)
    from streaming.runtime.session import build_session

    root = tempfile.mkdtemp(prefix="tierlog-bench-compaction-")
    try:
        log_dir = os.path.join(root, "commitlog")
        t = time.perf_counter()
        messages = produce(log_dir, args.keys, args.updates, args.body)
        produce_s = time.perf_counter() - t
        spark = build_session("bench-compaction", "local[2]", {"spark.sql.shuffle.partitions": "2", **LOCAL_FILE_MANAGER})
        noop = lambda df, _id: df.write.format("noop").mode("overwrite").save()  # noqa: E731
        run(latest_per_key(source(spark, log_dir, args.batch)), noop, os.path.join(root, "ck-warm"), max_batches=3)
        keys_in_view = None

        def read(r):
            return run(source(spark, log_dir, args.batch), noop, os.path.join(root, f"ck-read-{r}"), update=False)

        def state(r):
            return run(latest_per_key(source(spark, log_dir, args.batch)), noop, os.path.join(root, f"ck-state-{r}"))

        def full(r):
            nonlocal keys_in_view
            ck = os.path.join(root, f"ck-full-{r}")
            kv = KVView(os.path.join(root, f"kv-{r}"))
            reports = []
            sink = CompactionHandler(CompactionSettings(ReaderOptions(log_dir), os.path.join(root, "tier"), snapshot_interval_s=0),
                                     kv, on_batch=reports.append)
            out = run(latest_per_key(source(spark, log_dir, args.batch)), foreach_batch(ck, sink.process), ck,
                      after=sink.flush)
            steady = reports[1:] or reports
            out["sink_phases_s_median"] = {phase: statistics.median(r.phases[phase] for r in steady)
                                           for phase in reports[0].phases}
            keys_in_view = sum(1 for _, e in kv.entries() if e is not None)
            sink.close()
            kv.close()
            return out

        runs = {"read": [], "state": [], "full": []}
        steps = [read, state, full]
        for r in range(args.rounds):
            for step in (steps if r % 2 == 0 else steps[::-1]):
                runs[step.__name__].append(step(r))
        results = {name: {"rows_per_s": statistics.median(x["rows_per_s"] for x in rs), "rounds": rs}
                   for name, rs in runs.items()}
        ratios = {name: statistics.median(x["rows_per_s"] / rd["rows_per_s"] for x, rd in zip(rs, runs["read"]))
                  for name, rs in runs.items() if name != "read"}
        if args.python_batches:
            stream = source(spark, log_dir, args.batch).where("key is not null").groupBy("topic", "key")
            stream = stream.transformWithStateInPandas(
                python_processor(), "topic string, key string, phy_offset long", "Update", "None")
            results["python"] = run(stream, noop, os.path.join(root, "ck-python"), max_batches=args.python_batches)
            ratios["python"] = results["python"]["rows_per_s"] / results["read"]["rows_per_s"]
        report({
            "benchmark": "compaction", "messages": messages, "distinct_keys": args.keys, "batch_rows": args.batch,
            "body_bytes": args.body, "produce_s": round(produce_s, 1), "keys_live_in_view": keys_in_view,
            "rounds": args.rounds, "runs": results,
            "ratio_to_read": {k: round(v, 3) for k, v in ratios.items()},
            "target_rows_per_s": 150_000,
            "met": results["full"]["rows_per_s"] >= 150_000,
        })
        spark.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

"""The runner knows a query only through ``streaming.queries.base.Query``: a fourth query is one
class and one entry in ``streaming.plan.QUERIES``, and the runner starts it, hands it every batch
with its offset range, checks and records its checkpoint, and stops it like the others."""

from __future__ import annotations

import json
import os

from connectors.commitlog.workload import Workload
from connectors.commitlog.writer import CommitLogWriter
from streaming import plan
from streaming.queries.base import StreamedQuery
from streaming.service import Service
from tests.tiering_helpers import FILE, make_conf


class CountingQuery(StreamedQuery):
    """A no-op query: it counts the references of each batch and remembers the ranges it was handed."""

    name = "counting"
    calls: list = []  # (what, ...) in the order the runner called, across instances of one test

    @classmethod
    def sinks(cls, conf):
        return []

    def stream(self, spark):
        return spark.readStream.format("commitlog").options(path=self.ctx.settings.paths.commitlog,
                                                             maxBytesPerTrigger="20000").load()

    def start(self, committed_end):
        self.calls.append(("start", committed_end))

    def process(self, batch):
        rows = batch.df.select("phy_offset").collect()
        self.calls.append(("batch", batch.batch_id, batch.start, batch.end, sorted(r[0] for r in rows)))

    def tick(self):
        self.calls.append(("tick",))

    def flush(self):
        self.calls.append(("flush",))

    def close(self):
        self.calls.append(("close",))


def test_a_fourth_query_is_one_class_and_one_line_in_the_plan(spark, tmp_path, monkeypatch):
    conf = make_conf(tmp_path, str(tmp_path / "tier"))
    workload = Workload(messages=400, topics=2, queues=2, keys=20, body_size=200, seed=5)
    with CommitLogWriter(conf.commitlog.dir, file_size=FILE, fsync="never") as writer:
        ledger = writer.append_many(list(workload.generate()))  # the writer's own record of what it stored
        end = writer.offset
    monkeypatch.setattr(plan, "QUERIES", plan.QUERIES + (CountingQuery,))  # the one line
    monkeypatch.setattr(CountingQuery, "calls", [])

    service = Service(conf)
    assert service.run(until_caught_up=True, spark=spark) == 0

    calls = CountingQuery.calls
    assert calls[0] == ("start", None) and calls[-2:] == [("flush",), ("close",)]
    assert ("tick",) in calls  # between batches, on the runner's thread
    batches = [c for c in calls if c[0] == "batch"]
    assert len(batches) > 3 and service.batches["counting"] == len(batches)  # the runner cut the log into batches
    # Each batch is handed the range it covers: contiguous, from the first record to the log's end
    # (the first batch's start too, which its own entry of the offset log records), and its rows
    # are exactly the ledger's records in that range.
    offsets = [m.phy_offset for m in ledger]
    assert batches[0][2] == offsets[0] and batches[-1][3] == end
    for before, after in zip(batches, batches[1:]):
        assert after[2] == before[3]
    for _, _, start, stop, rows in batches:
        assert rows == [o for o in offsets if start <= o < stop]
    assert sorted(o for b in batches for o in b[4]) == offsets
    # Its checkpoint is its own, guarded like the others'.
    fingerprint = json.load(open(os.path.join(conf.checkpoint.dir, "counting", "tierlog-checkpoint.json")))
    assert fingerprint["query"] == "counting"
    assert fingerprint["settings"]["commitlog.dir"] == os.path.abspath(conf.commitlog.dir)

    # A second run starts it from its committed end, and it gets no batch: nothing new.
    CountingQuery.calls.clear()
    assert Service(conf).run(until_caught_up=True, spark=spark) == 0
    assert CountingQuery.calls[0] == ("start", end)
    assert not [c for c in CountingQuery.calls if c[0] == "batch" and c[4]]


def test_until_caught_up_waits_for_spark_to_commit_a_followers_last_batch(tmp_path):
    """A query over the tier is done under --until-caught-up only once Spark has written the commit
    of the last batch its handler processed: Spark writes it after foreachBatch returns, and a stop
    in between leaves Spark's state a batch behind the KV view."""

    class Applied:  # a query over the tier that has applied everything the tier committed
        def caught_up(self) -> bool:
            return True

    class Stopped:
        isActive = False

    conf = make_conf(tmp_path, str(tmp_path / "tier"))
    service = Service(conf)
    service.queries = {"compaction": Applied()}
    service._last_batch["compaction"] = 3  # processed by its handler
    commits = tmp_path / "checkpoints" / "compaction" / "commits"
    commits.mkdir(parents=True)
    for batch_id in range(3):
        (commits / str(batch_id)).write_text("v1\n{}")
    streams = {"compaction": Stopped()}
    assert not service._followers_done(None, streams, ["compaction"])
    (commits / "3").write_text("v1\n{}")
    assert service._followers_done(None, streams, ["compaction"])

"""The KV writer without Spark: batches of changed keys -> the KV view and snapshots, across crashes.

The test hands ``state.kv_writer.KVWriter`` what the compaction query's Spark step would: each
batch's changed keys (topic, key, the physical offset of the key's latest message in the batch)
and the offset the batch ends at, computed here from the writer's ledger, not by the code under
test.  A child process applies the batches and is killed in the second one: before the writer has
it (as when the handler dies after Spark committed it; the restart replays it from the commitlog),
or at a crash point of the writer (``connectors.faults``).  A second child starts as the service
would after Spark committed that batch (``catch_up``), applies the rest, and the view must equal
the ledger's latest value of each key.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

from connectors.errors import TierlogError
from state.kv import KVView
from tests import ledger
from tests.cli_runner import ROOT
from tests.kv_helpers import append, kv_messages
from tests.oracle import latest_per_key
from tests.tiering_helpers import make_conf
from streaming import config as cfg

BATCHES = 5

CHILD = """
import json, os, signal, sys
import pyarrow as pa
from connectors.commitlog.reader import ReaderOptions
from state.kv import KVView
from state.kv_writer import CompactionSettings, KVWriter

plan = json.load(open(sys.argv[1]))
first, catch_up_to, die_before = int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
settings = CompactionSettings(ReaderOptions(plan["commitlog"]), plan["tier"], snapshot_interval_s=plan["snapshot_s"])
with KVView(plan["kv"]) as kv:
    writer = KVWriter(settings, kv)
    if catch_up_to != "-":
        writer.catch_up(int(catch_up_to))
    for i, batch in enumerate(plan["batches"][first:], start=first):
        if i == die_before:  # as the handler dies after Spark committed a batch, before the writer has it
            os.kill(os.getpid(), signal.SIGKILL)
        changes = pa.table({"topic": batch["topics"], "key": batch["keys"],
                            "phy_offset": pa.array(batch["phys"], pa.int64())})
        writer.apply(i, changes, batch["end"])
    writer.close()
"""


def batches_from_ledger(directory: str, n: int) -> list[dict]:
    """The ledger cut into ``n`` batches, each with every changed key's latest offset in it."""
    stored = ledger.stored(directory)
    size = -(-len(stored) // n)
    out = []
    for i in range(0, len(stored), size):
        chunk = stored[i:i + size]
        latest: dict = {}
        for m in chunk:
            key = m.key("KEYS")
            if key is not None and m.dispatched:
                latest[(m.topic, key)] = m.phy_offset
        out.append({"topics": [t for t, _ in latest], "keys": [k for _, k in latest],
                    "phys": list(latest.values()), "end": chunk[-1].phy_offset + chunk[-1].size})
    return out


def run_child(plan_file, first: int, catch_up_to, env: dict, die_before: int = -1) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD, str(plan_file), str(first),
                           "-" if catch_up_to is None else str(catch_up_to), str(die_before)],
                          cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("point", ["before_apply", "kv_applied", "snapshotted"])
def test_the_writer_survives_a_crash_in_a_batch_and_equals_the_ledger(tmp_path, point):
    conf = make_conf(tmp_path, str(tmp_path / "tier"), compaction=cfg.CompactionConfig(enabled=True))
    os.makedirs(conf.commitlog.dir)
    append(conf, kv_messages(3000, keys=400, seed=7))
    batches = batches_from_ledger(conf.commitlog.dir, BATCHES)
    kv_dir = str(tmp_path / "kv")
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps({"commitlog": conf.commitlog.dir, "tier": str(tmp_path / "tier"), "kv": kv_dir,
                                     "snapshot_s": 1e-6 if point == "snapshotted" else 0, "batches": batches}))
    faults = tmp_path / "faults"
    faults.mkdir()
    if point == "before_apply":
        crashed = run_child(plan_file, 0, None, {}, die_before=1)
    else:
        nth = 3 if point == "snapshotted" else 2  # a snapshot passes its point once per topic (two here)
        crashed = run_child(plan_file, 0, None, {"TIERLOG_FAULT": f"{point}:{nth}", "TIERLOG_FAULT_DIR": str(faults)})
    assert crashed.returncode == -9, crashed.stderr[-2000:]  # killed in the second batch, not finished
    with KVView(kv_dir, read_only=True) as kv:
        behind = kv.applied_through()
    assert behind == (batches[0]["end"] if point == "before_apply" else batches[1]["end"])
    # Spark committed the second batch before the crash (its apply runs beside the next batch).
    resumed = run_child(plan_file, 2, batches[1]["end"], {})
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    with KVView(kv_dir, read_only=True) as kv:
        assert kv.applied_through() == batches[-1]["end"]
        got = {(t, e.key): {"body": e.body, "phy_offset": e.phy_offset, "queue_id": e.queue_id,
                            "queue_offset": e.queue_offset, "store_ts": e.store_ts, "deleted": False}
               for t, e in kv.entries() if e is not None}
    assert got == latest_per_key(conf.commitlog.dir)
    assert len(got) > 100  # the workload is not trivially small


class FailingMessages:
    """The commitlog read as the writer reads it, noting the thread of each read and failing (an
    injected fault) for the batch that holds ``fail_at``."""

    def __init__(self, directory: str, fail_at: int | None = None):
        from connectors.commitlog.reader import ReaderOptions

        self.reader = ReaderOptions(directory).open(check_crc=False)
        self.fail_at, self.threads = fail_at, set()

    def records_as_stored(self, phys, columns):
        self.threads.add(threading.current_thread().name)
        if self.fail_at is not None and self.fail_at in set(phys.tolist()):
            raise TierlogError("injected: this batch's messages could not be read")
        return self.reader.records_as_stored(phys, columns)

    def first_offset(self) -> int:
        return self.reader.first_offset()

    def close(self) -> None:
        self.reader.close()


def handler_batches(tmp_path, fail_batch: int | None = None, snapshot_interval_s: float = 0):
    """A commitlog, its batches from the ledger, and a compaction handler on a new view whose
    messages fail for ``fail_batch``."""
    import pyarrow as pa

    from connectors.commitlog.reader import ReaderOptions
    from state.kv_writer import CompactionSettings
    from streaming.queries.compaction.handler import CompactionHandler

    conf = make_conf(tmp_path, str(tmp_path / "tier"), compaction=cfg.CompactionConfig(enabled=True))
    os.makedirs(conf.commitlog.dir)
    append(conf, kv_messages(3000, keys=400, seed=11))
    batches = batches_from_ledger(conf.commitlog.dir, BATCHES)
    messages = FailingMessages(conf.commitlog.dir, None if fail_batch is None else batches[fail_batch]["phys"][0])
    kv = KVView(str(tmp_path / "kv"))
    reports, released = [], []
    handler = CompactionHandler(CompactionSettings(ReaderOptions(conf.commitlog.dir), str(tmp_path / "tier"),
                                                   snapshot_interval_s=snapshot_interval_s),
                                kv, on_batch=reports.append, messages=messages, on_applied=released.append)
    stand_ins = []  # what Spark hands the handler: a DataFrame of the changed keys, the batch's range
    for i, b in enumerate(batches):
        table = pa.table({"topic": b["topics"], "key": b["keys"], "phy_offset": pa.array(b["phys"], pa.int64())})
        df = SimpleNamespace(toArrow=lambda table=table: table)
        stand_ins.append(SimpleNamespace(df=df, batch_id=i, start=batches[i - 1]["end"] if i else 0, end=b["end"]))
    return conf, batches, kv, handler, messages, stand_ins, reports, released


def test_the_handler_reads_the_next_batch_beside_the_apply_and_applies_in_order(tmp_path):
    conf, batches, kv, handler, messages, stand_ins, reports, released = handler_batches(tmp_path)
    for batch in stand_ins:
        handler.process(batch)
    handler.close()
    assert [r.batch_id for r in reports] == list(range(BATCHES))
    assert released == [0] + [b["end"] for b in batches[:-1]]
    assert messages.threads == {"kv-resolve_0"}  # every batch was read off Spark's and the apply thread
    assert kv.applied_through() == batches[-1]["end"]
    got = {(t, e.key): {"body": e.body, "phy_offset": e.phy_offset, "queue_id": e.queue_id,
                        "queue_offset": e.queue_offset, "store_ts": e.store_ts, "deleted": False}
           for t, e in kv.entries() if e is not None}
    kv.close()
    assert got == latest_per_key(conf.commitlog.dir)


def test_no_batch_is_applied_past_one_that_failed(tmp_path):
    """Batch 3's messages are read while batch 2 fails to be: batch 3 must not reach the view, or
    the view would say it applied through batch 3 without batch 2's changes."""
    _, batches, kv, handler, _, stand_ins, reports, _ = handler_batches(tmp_path, fail_batch=2)
    with pytest.raises(TierlogError, match="injected"):
        for batch in stand_ins:
            handler.process(batch)
    with pytest.raises(TierlogError, match="injected"):
        handler.close()  # batch 3's apply raises the same error
    assert [r.batch_id for r in reports] == [0, 1]
    assert kv.applied_through() == batches[1]["end"]
    kv.close()


def test_a_snapshot_round_writes_the_topics_that_changed_and_the_budget_defers_the_rest(tmp_path):
    """The first round on a new view writes every topic; then a round writes only the topics whose
    keys changed since their last snapshot (none: no round at all), and with the tables on, at most
    its share of the request budget, the topic that changed first first; the one deferred goes
    next, in this process or, after a stop, in the next."""
    import time

    import pyarrow as pa

    from connectors.commitlog.reader import ReaderOptions
    from connectors.tables.catalog import default_settings
    from connectors.tier import snapshots
    from connectors.tier.location import open_backend
    from state.kv_writer import CompactionSettings, KVWriter

    conf = make_conf(tmp_path, str(tmp_path / "tier"))
    os.makedirs(conf.commitlog.dir)
    append(conf, kv_messages(600, keys=60, seed=5, topics=3, delete_ratio=0))
    [batch] = batches_from_ledger(conf.commitlog.dir, 1)
    tier = str(tmp_path / "tier")
    tables = default_settings(tier, str(tmp_path / "state"), commits_per_minute=60)
    settings = CompactionSettings(ReaderOptions(conf.commitlog.dir), tier, snapshot_interval_s=1.0, tables=tables)
    backend = open_backend(tier)

    def written() -> dict[str, int]:
        counts: dict[str, int] = {}
        for snap in snapshots.list_snapshots(backend, settings.reader.broker):
            counts[snap.topic] = counts.get(snap.topic, 0) + 1
        return counts

    def only(*topics):
        rows = [(t, k, p) for t, k, p in zip(batch["topics"], batch["keys"], batch["phys"]) if t in topics]
        return pa.table({"topic": pa.array([r[0] for r in rows], pa.string()),
                         "key": pa.array([r[1] for r in rows], pa.string()),
                         "phy_offset": pa.array([r[2] for r in rows], pa.int64())})

    # Each batch ends one byte further (a snapshot is named by its offset); the view takes what it is given.
    with KVView(str(tmp_path / "kv")) as kv:
        writer = KVWriter(settings, kv)
        writer._last_snapshot = 0.0
        writer.apply(0, only("t0", "t1", "t2"), batch["end"] + 0)
        assert written() == {"t0": 1, "t1": 1, "t2": 1}  # a new process: every topic
        writer._last_snapshot = 0.0
        writer.apply(1, only(), batch["end"] + 1)
        assert written() == {"t0": 1, "t1": 1, "t2": 1}  # nothing changed: no round
        writer._last_snapshot = time.time()  # the interval not up while the next two change
        writer.apply(2, only("t2"), batch["end"] + 2)
        time.sleep(0.01)
        writer.apply(3, only("t0"), batch["end"] + 3)
        writer._last_snapshot = 0.0  # the budget's share of a 1 s interval: one topic a round
        writer.apply(4, only(), batch["end"] + 4)
        assert written() == {"t0": 1, "t1": 1, "t2": 2}  # t2 changed first
        writer.close()
        writer = KVWriter(settings, kv)  # a new process: the round before left t0 for the next
        writer._last_snapshot = 0.0
        assert writer.maybe_snapshot() is not None
        assert written() == {"t0": 2, "t1": 1, "t2": 2}
        writer._last_snapshot = 0.0
        assert writer.maybe_snapshot() is None and not writer.snapshot_due()  # nothing changed since
        writer.close()
    backend.close()


def test_a_snapshot_falls_due_between_batches_and_takes_what_the_view_applied(tmp_path):
    """The last changes before a quiet spell reach the snapshots (and the latest-per-key tables)
    with no batch to carry them: a tick writes the snapshot that fell due, through every batch
    applied; a tick with nothing changed since writes none."""
    from connectors.tier import snapshots
    from connectors.tier.location import open_backend

    conf, batches, kv, handler, _, stand_ins, reports, _ = handler_batches(tmp_path, snapshot_interval_s=3600)
    for batch in stand_ins:
        handler.process(batch)
    handler.flush()
    assert all(r.snapshot_rows is None for r in reports)  # the interval was not up at any batch
    backend = open_backend(str(tmp_path / "tier"))
    assert snapshots.list_snapshots(backend, handler.writer.settings.reader.broker) == []
    handler.writer._last_snapshot = 0.0  # the interval is up, and no batch comes
    handler.tick()
    handler.flush()
    written = snapshots.list_snapshots(backend, handler.writer.settings.reader.broker)
    assert written and {s.through_phy for s in written} == {batches[-1]["end"]}
    handler.writer._last_snapshot = 0.0
    handler.tick()
    handler.flush()
    assert snapshots.list_snapshots(backend, handler.writer.settings.reader.broker) == written
    handler.close()
    kv.close()
    backend.close()

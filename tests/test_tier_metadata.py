"""The tier's metadata layout (root, buckets, queue manifests, pages), without Spark.

The oracle is the test's own ledger: a plain dict of what it committed per queue (offsets,
segments, staging parts), kept by the test and never by the code under test.  Every check
reads the tier afresh through ``TierLog.committed`` or ``TierLog.open_head``.
"""

from __future__ import annotations

import json
import random

import pytest

from connectors.tier import layout
from connectors.tier.location import open_backend
from connectors.tier.errors import TierRecordError
from connectors.tier.log import TierLayoutError, TierLog
from connectors.tier.manifest import bucket_of
from connectors.brokers import DEFAULT_BROKER

NAMES = layout.Names(DEFAULT_BROKER)  # the names of a one-broker tier


@pytest.fixture(autouse=True)
def small_pages(monkeypatch):
    """Pages of 4 segments, so a short workload moves segments to pages and drops expired ones."""
    monkeypatch.setattr("connectors.tier.log.PAGE_SEGMENTS", 4)


class Ledger:
    """What the test committed, queue by queue."""

    def __init__(self, names: layout.Names = NAMES):
        self.names = names
        self.queues: dict = {}  # key -> dict(commit, sealed, low, segments=[...], staging=[names])
        self.phy = 0

    def batch(self, rng, keys, batch_id):
        objects, name = [], self.names.staging(self.phy)
        stats = []
        for key in keys:
            q = self.queues.setdefault(key, {"commit": 0, "sealed": 0, "low": 0, "segments": [], "staging": []})
            n = rng.randint(1, 5)
            stats.append([key[0], key[1], {"first": q["commit"], "last": q["commit"] + n - 1, "rows": n,
                                           "bytes": n * 10, "min_ts": 1000 + q["commit"], "max_ts": 1000 + q["commit"] + n}])
            q["commit"] += n
            if not q["staging"]:
                q["unsealed_since"] = batch_id  # the time_ms of its oldest live object
            q["staging"].append(name)
        objects.append({"name": name, "size": 100, "first_phy": self.phy, "time_ms": batch_id, "queues": stats})
        self.phy += 1000
        return {"type": "batch", "batch_id": batch_id, "source_start": self.phy - 1000, "source_end": self.phy,
                "staging": objects}

    def seal(self, keys):
        segs = []
        for key in keys:
            q = self.queues[key]
            if q["commit"] == q["sealed"]:
                continue
            seg = {"name": self.names.segment(*key, q["sealed"]), "topic": key[0], "queue_id": key[1],
                   "base": q["sealed"], "end": q["commit"] - 1, "rows": q["commit"] - q["sealed"], "size": 50,
                   "min_ts": 1000 + q["sealed"], "max_ts": 1000 + q["commit"], "keys": None}
            segs.append(seg)
            q["segments"].append(seg)
            q["sealed"], q["staging"] = q["commit"], []
        return {"type": "seal", "segments": segs, "retire": []}

    def expire(self, key, count):
        q = self.queues[key]
        gone, q["segments"] = q["segments"][:count], q["segments"][count:]
        if gone:
            q["low"] = gone[-1]["end"] + 1
        return {"type": "expire", "segments": gone}


def unsealed_totals(ledger: Ledger) -> dict:
    """What a maintenance asks of every queue with unsealed rows: (rows, bytes, oldest time_ms)."""
    return {k: (q["commit"] - q["sealed"], 10 * (q["commit"] - q["sealed"]), q["unsealed_since"])
            for k, q in ledger.queues.items() if q["staging"]}


def check_view(tier_log: TierLog, ledger: Ledger, keys) -> None:
    view = tier_log.committed()
    for key in keys:
        want = ledger.queues[key]
        state = view.state_of(key)
        assert (state.commit, state.sealed, state.low) == (want["commit"], want["sealed"], want["low"]), key
        assert state.segments == len(want["segments"]) and state.bytes == 50 * len(want["segments"])
        assert [s.to_json() for s in view.segments_for(key)] == [{k: v for k, v in s.items() if v is not None}
                                                                for s in want["segments"]]
        assert [p.name for p in view.staging_for(key)] == want["staging"]
        if want["segments"]:  # a bisected range returns just the segments it overlaps
            mid = want["segments"][len(want["segments"]) // 2]
            assert [s.base for s in view.segments_for(key, mid["base"], mid["base"] + 1)] == [mid["base"]]
    assert set(view.queue_keys()) == set(ledger.queues)


def run_workload(tmp_path, seed: int, steps: int, fold_every: int, nqueues: int = 40):
    rng = random.Random(seed)
    tier_log = TierLog(open_backend(str(tmp_path / "tier")), buckets=16)
    head = tier_log.open_head()
    ledger = Ledger()
    keys = [(f"t{i % 3}", i) for i in range(nqueues)]
    for step in range(steps):
        roll = rng.random()
        if roll < 0.6 or not ledger.queues:
            tier_log.append(head, ledger.batch(rng, rng.sample(keys, rng.randint(1, 8)), step))
        elif roll < 0.9:
            record = ledger.seal(rng.sample(sorted(ledger.queues), min(len(ledger.queues), rng.randint(1, 6))))
            if record["segments"]:
                tier_log.append(head, record)
        else:
            key = rng.choice(sorted(ledger.queues))
            record = ledger.expire(key, rng.randint(1, 3))
            if record["segments"]:
                tier_log.append(head, record)
        assert head.unsealed_totals() == unsealed_totals(ledger), step
        if step % fold_every == fold_every - 1:
            tier_log.fold(head)
        if step % 25 == 0:
            check_view(TierLog(tier_log.backend), ledger, rng.sample(sorted(ledger.queues), min(5, len(ledger.queues))))
    return tier_log, head, ledger


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_views_and_restarts_agree_with_the_ledger(tmp_path, seed):
    tier_log, head, ledger = run_workload(tmp_path, seed, steps=400, fold_every=7)
    check_view(TierLog(tier_log.backend), ledger, sorted(ledger.queues))
    again = TierLog(tier_log.backend).open_head()  # what a restarted service holds
    assert again.queues == head.queues and again.seq == head.seq and again.source_end == head.source_end
    live = lambda h: {k: [o.name for o in objs] for k, objs in h.unsealed().items()}  # noqa: E731
    assert live(again) == live(head)
    assert again.unsealed_totals() == head.unsealed_totals() == unsealed_totals(ledger)
    # Many segments per queue: some moved to pages, and pages are only read when asked for.
    assert any(tier_log.committed().queue(k).pages for k in ledger.queues)


def test_a_checkpoint_writes_only_the_queues_that_changed(tmp_path):
    backend = open_backend(str(tmp_path / "tier"))
    tier_log, ledger = TierLog(backend), Ledger()
    head = tier_log.open_head()
    rng = random.Random(0)
    keys = [("t", q) for q in range(2000)]
    for i in range(0, 2000, 200):
        tier_log.append(head, ledger.batch(rng, keys[i:i + 200], i))
    tier_log.fold(head)
    puts = []
    real_put = backend.put
    backend.put = lambda name, data: (puts.append(name), real_put(name, data))
    tier_log.append(head, ledger.batch(rng, [("t", 7)], 99))
    tier_log.fold(head)
    # the record, one queue manifest, its bucket and the root: nothing per other queue
    assert sorted(puts) == sorted([NAMES.log(10), NAMES.queue_manifest("t", 7, 10),
                                   NAMES.bucket(bucket_of(("t", 7), head.buckets), 10), NAMES.root(10)])
    check_view(TierLog(backend), ledger, [("t", 7), ("t", 8)])


class Crash(Exception):
    pass


@pytest.mark.parametrize("after_puts", [0, 1, 2, 3, 5])
def test_a_crash_in_a_checkpoint_loses_nothing(tmp_path, after_puts):
    tier_log, head, ledger = run_workload(tmp_path, 7, steps=120, fold_every=1000)
    backend = tier_log.backend
    real_put, count = backend.put, [0]

    def failing_put(name, data):
        if count[0] >= after_puts:
            raise Crash(name)
        count[0] += 1
        real_put(name, data)

    backend.put = failing_put
    with pytest.raises(Crash):
        tier_log.fold(head)
    backend.put = real_put
    check_view(TierLog(backend), ledger, sorted(ledger.queues))  # the old root and every record still count
    fresh = TierLog(backend)
    restarted = fresh.open_head()
    assert restarted.queues == head.queues
    fresh.fold(restarted)
    check_view(TierLog(backend), ledger, sorted(ledger.queues))


def test_a_bad_record_is_never_written(tmp_path):
    tier_log = TierLog(open_backend(str(tmp_path / "tier")))
    head = tier_log.open_head()
    with pytest.raises(TierRecordError, match="does not hold"):
        tier_log.append(head, {"type": "seal", "segments": [{"name": "x", "topic": "t", "queue_id": 0, "base": 0,
                                                            "end": 0, "rows": 1, "size": 1, "min_ts": 0, "max_ts": 0}],
                               "retire": []})
    assert not list(tier_log.backend.list(layout.LOG_PREFIX))


def moved(ledger: Ledger) -> Ledger:
    """The ledger of a tier from before brokers, with the names ``tierlog tier upgrade`` moves its
    objects to (built here from the layout's documented paths, not by the code under test)."""
    for q in ledger.queues.values():
        for seg in q["segments"]:
            seg["name"] = seg["name"].replace("/queue=", f"/broker={DEFAULT_BROKER}/queue=")
            if seg["keys"]:
                seg["keys"] = seg["keys"].replace("/queue=", f"/broker={DEFAULT_BROKER}/queue=")
        q["staging"] = [n.replace("_staging/", f"_staging/broker={DEFAULT_BROKER}/") for n in q["staging"]]
    ledger.names = NAMES
    return ledger


def put_data_objects(backend, ledger: Ledger) -> set[str]:
    """An object for each segment, key index and staging object the ledger names; their names."""
    names = {n for q in ledger.queues.values() for n in q["staging"]}
    names |= {n for q in ledger.queues.values() for s in q["segments"] for n in (s["name"], s["keys"]) if n}
    for name in names:
        backend.put(name, name.encode())
    return names


def test_a_first_layout_tier_is_upgraded_in_place(tmp_path):
    """A tier written by the first layout (records without a version, one whole-state checkpoint,
    no brokers) is refused by readers and writers with what to do, and `tierlog tier upgrade`
    moves it under a broker with the same content."""
    from connectors.tier.upgrade import upgrade_to_broker

    backend = open_backend(str(tmp_path / "tier"))
    rng = random.Random(3)
    ledger = Ledger(layout.Names(None))
    records = []
    for i in range(30):
        records.append(ledger.batch(rng, [("t", q) for q in rng.sample(range(6), 3)], i))
        if i % 4 == 3:
            records.append(ledger.seal(sorted(ledger.queues)))
    expire = ledger.expire(("t", sorted(k[1] for k in ledger.queues)[0]), 1)
    records.append({"type": "expire", "segments": [s["name"] for s in expire["segments"]]})  # v1 named them
    for seq, record in enumerate(records):
        if record["type"] == "seal":
            record["retire"] = []
        backend.put(layout.Names(None).log(seq), json.dumps({**record, "seq": seq}).encode())
    old = put_data_objects(backend, ledger)
    for refused in (lambda: TierLog(backend).committed(), lambda: TierLog(backend).open_head()):
        with pytest.raises(TierLayoutError, match="tierlog tier upgrade"):
            refused()
    report = upgrade_to_broker(backend, DEFAULT_BROKER, progress=lambda line: None)
    assert report["queues"] == len(ledger.queues)
    head = TierLog(backend).open_head()
    assert head.seq == len(records)  # one past the old log: a metadata store that followed it rebuilds
    ledger = moved(ledger)
    check_view(TierLog(backend), ledger, sorted(ledger.queues))
    left = {o.name for o in backend.list()}
    assert not old & left  # every old object is gone...
    assert {n for q in ledger.queues.values() for n in q["staging"]} <= left  # ...and its copy is there
    assert {s["name"] for q in ledger.queues.values() for s in q["segments"]} <= left
    assert [o.name for o in backend.list(layout.LOG_PREFIX)] == [NAMES.root(head.seq)]
    assert upgrade_to_broker(backend, DEFAULT_BROKER) is None  # nothing left to do


def test_an_upgrade_interrupted_after_its_root_is_finished_by_running_it_again(tmp_path, monkeypatch):
    """A tier of the manifest layout from before brokers; the upgrade dies after writing the new
    root, before deleting a single old object.  Readers already see the moved tier, and running
    the upgrade again deletes what is left."""
    from connectors.tier import upgrade

    backend = open_backend(str(tmp_path / "tier"))
    rng, ledger = random.Random(5), Ledger(layout.Names(None))
    before, head = TierLog(backend, None), None
    head = before.open_head()
    for i in range(12):
        before.append(head, ledger.batch(rng, [("t", q) for q in rng.sample(range(4), 2)], i))
        if i % 3 == 2:
            before.append(head, ledger.seal(sorted(ledger.queues)))
        if i == 6:
            before.fold(head)
    old = put_data_objects(backend, ledger)

    def crash(*args):
        raise KeyboardInterrupt("crash after the new root")

    monkeypatch.setattr(upgrade, "_delete_old", crash)
    with pytest.raises(KeyboardInterrupt):
        upgrade.upgrade_to_broker(backend, DEFAULT_BROKER, progress=lambda line: None)
    monkeypatch.undo()
    ledger = moved(ledger)
    check_view(TierLog(backend), ledger, sorted(ledger.queues))  # the new root holds it all already
    assert old <= {o.name for o in backend.list()}
    report = upgrade.upgrade_to_broker(backend, DEFAULT_BROKER, progress=lambda line: None)
    assert report["objects_copied"] == 0 and report["objects_deleted"] >= len(old)
    assert not old & {o.name for o in backend.list()}
    check_view(TierLog(backend), ledger, sorted(ledger.queues))


def test_retention_by_bytes_and_messages_drops_each_queues_oldest_segments(tmp_path):
    """Kafka's rule per queue: drop the oldest segment while what stays still meets the limit."""
    from state.metadata import MetadataStore
    from connectors.tier.retention import Retention
    from connectors.tier.writer import TierWriter, WriterSettings

    tier_log, head, ledger = run_workload(tmp_path, 5, steps=300, fold_every=9)
    store = MetadataStore(str(tmp_path / "metadata"))
    try:
        store.rebuild(tier_log.committed())
        settings = WriterSettings(location=str(tmp_path / "tier"),
                                  retention=Retention(bytes={"t1": 120}, messages={"*": 25}, check_s=0))
        sink = TierWriter(settings, store)
        sink.expire(now_ms=10**13)
        for key, q in ledger.queues.items():
            keep = list(q["segments"])
            while keep and ((key[0] == "t1" and sum(s["size"] for s in keep) - keep[0]["size"] >= 120)
                            or q["commit"] - (keep[0]["end"] + 1) >= 25):  # "*" covers t1 too
                keep.pop(0)
            gone = len(q["segments"]) - len(keep)
            ledger.expire(key, gone)
        assert any(not q["segments"] or q["low"] > 0 for q in ledger.queues.values())
        check_view(TierLog(tier_log.backend), ledger, sorted(ledger.queues))
        assert [s.base for s in store.segments("t1", 1)] == [s["base"] for s in ledger.queues[("t1", 1)]["segments"]]
        pending = store.pending_deletes()
        assert all(s["name"] not in pending for q in ledger.queues.values() for s in q["segments"])
        sink.fold()  # expired pages are dropped from the manifests, and scheduled for deletion
        check_view(TierLog(tier_log.backend), ledger, sorted(ledger.queues))
        assert any(name.startswith(NAMES.meta_prefix + "pages/") for name in store.pending_deletes())
    finally:
        store.close()


def test_a_record_applied_by_queue_folds_to_what_the_whole_record_does():
    """``by_queue`` splits a record into one part per queue, so a record over Q queues costs O(Q) to
    apply, not O(Q^2); each part must do to its queue exactly what the whole record does."""
    from connectors.tier.manifest import apply_to_manifest, apply_to_state, by_queue, record_keys

    rng = random.Random(7)
    keys = [(f"t{i % 3}", i) for i in range(12)]
    states, manifests = {}, {}
    whole_states, whole_manifests = {}, {}
    offsets = {k: 0 for k in keys}
    for seq in range(1, 60):
        touched = rng.sample(keys, rng.randint(1, len(keys)))
        if seq % 3:
            objects = []
            for i in range(rng.randint(1, 3)):
                queues = []
                for t, q in sorted(touched):
                    n = rng.randint(1, 5)
                    queues.append([t, q, {"first": offsets[(t, q)], "last": offsets[(t, q)] + n - 1, "rows": n,
                                          "bytes": n * 10, "min_ts": seq, "max_ts": seq}])
                    offsets[(t, q)] += n
                objects.append({"name": f"s{seq}-{i}", "size": 100, "first_phy": seq * 10 + i, "time_ms": seq,
                                "queues": queues})
            record = {"type": "batch", "seq": seq, "staging": objects}
        else:
            held = [k for k in touched if k in whole_states and whole_states[k].commit > whole_states[k].sealed]
            if not held:
                continue
            record = {"type": "seal", "seq": seq, "retire": [], "segments": [
                {"topic": t, "queue_id": q, "base": whole_states[(t, q)].sealed, "end": whole_states[(t, q)].commit - 1,
                 "rows": 1, "size": 7, "name": f"seg-{seq}-{t}-{q}", "keys": f"k-{seq}-{t}-{q}", "min_ts": 0,
                 "max_ts": 0} for t, q in held]}
        parts = by_queue(record)
        assert set(parts) == record_keys(record)
        for key, part in parts.items():
            whole_states[key] = apply_to_state(whole_states.get(key), key, record)
            states[key] = apply_to_state(states.get(key), key, part)
            whole_manifests[key] = apply_to_manifest(whole_manifests.get(key), key, record)
            manifests[key] = apply_to_manifest(manifests.get(key), key, part)
            assert states[key] == whole_states[key]
            assert manifests[key].to_json() == whole_manifests[key].to_json(), (seq, key)
    assert any(m.recent for m in manifests.values()) and any(m.staging for m in manifests.values())

"""Compacted snapshots on both backends: names, contents, pruning, odd topic names."""

from __future__ import annotations

from connectors.commitlog.reader import ReaderOptions
from connectors.tier import snapshots
from connectors.tier.location import open_backend
from state.kv import Change, KVView


def test_write_list_read_and_prune(tier_location, tmp_path):
    backend = open_backend(tier_location)
    odd = "orders/eu=1 %"
    with KVView(str(tmp_path / "kv")) as kv:
        for round_, through in enumerate((100, 200, 300)):
            kv.apply([Change(odd, f"k{i}", "put", through - 10 + i, 1, i, 1_700_000_000_000 + i,
                             b"v%d-%d" % (round_, i)) for i in range(3)]
                     + [Change("plain", "gone", "delete" if round_ else "put", through - 1, body=b"x")])
            written = snapshots.write_snapshots(backend, "broker-a", kv.entries(), through, keep=2)
            assert written == {odd: 3, "plain": 0 if round_ else 1}
        # Another broker's snapshots of the same topics, at physical offsets of its own log.
        snapshots.write_snapshots(backend, "broker-b", kv.entries(), 50, keep=2)
    backend.put("_compacted/broker=broker-a/topic=plain/not-a-snapshot.txt", b"ignored")
    listed = snapshots.list_snapshots(backend, "broker-a")
    assert [(s.topic, s.through_phy) for s in listed] == [(odd, 200), (odd, 300), ("plain", 200), ("plain", 300)]
    assert [(s.topic, s.through_phy) for s in snapshots.list_snapshots(backend, "broker-b")] == [(odd, 50), ("plain", 50)]
    latest = snapshots.latest_snapshots(backend, "broker-a")
    rows = snapshots.read_snapshot(backend, latest[odd]).to_pylist()
    assert [(r["key"], r["body"], r["phy_offset"]) for r in rows] == [(f"k{i}", b"v2-%d" % i, 290 + i) for i in range(3)]
    assert rows[1]["store_ts"].timestamp() * 1000 == 1_700_000_000_001
    assert snapshots.read_snapshot(backend, latest["plain"]).num_rows == 0  # every key deleted: an empty snapshot
    assert "%2F" in latest[odd].name and "=" not in latest[odd].name.split("topic=", 1)[1]


def test_the_first_snapshot_comes_an_interval_after_the_first_start_and_restarts_keep_that_clock(
        tier_location, tmp_path, monkeypatch):
    import time

    from state import kv_writer

    (tmp_path / "commitlog").mkdir()
    settings = kv_writer.CompactionSettings(ReaderOptions(str(tmp_path / "commitlog")), tier_location, snapshot_interval_s=600)
    with KVView(str(tmp_path / "kv")) as kv:
        kv.apply([Change("t", "k", "put", 5, body=b"v")], applied_through=10)
        first = kv_writer.KVWriter(settings, kv)
        assert first.maybe_snapshot(10) is None  # a view catching up is not snapshotted at its first batch
        first.close()
        started = time.time()
        monkeypatch.setattr(kv_writer.time, "time", lambda: started + 601)
        restarted = kv_writer.KVWriter(settings, kv)  # the clock runs from the first start
        assert restarted.maybe_snapshot(10) == 1
        assert restarted.maybe_snapshot(10) is None
        restarted.close()
    assert [s.through_phy for s in snapshots.list_snapshots(open_backend(tier_location), "broker-a")] == [10]


def test_values_kept_in_the_tier_come_from_the_previous_snapshot_where_unchanged(tier_location):
    """A snapshot of entries whose bodies the view keeps in the tier (body None): a key whose message
    is the one the previous snapshot holds takes that value, and only the others are read (by
    ``values``, the view's reads from the tier); every row is whole either way."""
    import dataclasses

    from state.kv import Entry

    backend = open_backend(tier_location)
    first = {f"k{i:03d}": (1000 + i, b"first-%d" % i) for i in range(300)}
    entries = [("t", Entry("t", k, body, phy, 0, phy, 1_700_000_000_000)) for k, (phy, body) in sorted(first.items())]
    assert snapshots.write_snapshots(backend, "broker-a", iter(entries), 2000, keep=2) == {"t": 300}
    # Every third key changed since (a new message), a few were deleted, a few are new; none holds its body.
    second = dict(first)
    for i in range(0, 300, 3):
        second[f"k{i:03d}"] = (5000 + i, b"second-%d" % i)
    for i in (1, 2, 4):
        second.pop(f"k{i:03d}")
    second["k999"] = (6000, b"new")
    asked: list[str] = []

    def values(chunk):
        asked.extend(e.key for e in chunk if e.body is None)
        return [e if e.body is not None else dataclasses.replace(e, body=second[e.key][1]) for e in chunk]

    entries = [("t", Entry("t", k, None, phy, 0, phy, 1_700_000_000_000)) for k, (phy, _) in sorted(second.items())]
    entries.insert(2, ("t", None))  # a tombstone
    assert snapshots.write_snapshots(backend, "broker-a", iter(entries), 7000, keep=2, values=values) == {"t": len(second)}
    rows = snapshots.read_snapshot(backend, snapshots.latest_snapshots(backend, "broker-a")["t"]).to_pylist()
    assert {r["key"]: (r["phy_offset"], r["body"]) for r in rows} == second
    assert sorted(asked) == sorted(k for k, (phy, _) in second.items() if phy >= 5000)

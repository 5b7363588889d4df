"""The KV view (rocksdict) against a plain dict oracle: latest by physical offset, tombstones, replays."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from state.kv import Change, KVError, KVView
from tests.cli_runner import ROOT


def oracle(changes: list[Change]) -> dict:
    latest: dict = {}
    for c in sorted(changes, key=lambda c: c.phy_offset):
        latest[(c.topic, c.key)] = c
    return {k: c for k, c in latest.items() if c.op == "put"}


def view_contents(view: KVView, topics) -> dict:
    return {(e.topic, e.key): e for t in topics for e in view.scan(t)}


def test_latest_wins_and_deletes_hide_keys(tmp_path):
    with KVView(str(tmp_path / "kv")) as kv:
        kv.apply([Change("t", "a", "put", 10, body=b"a1"), Change("t", "b", "put", 11, body=b"b1")], 11)
        kv.apply([Change("t", "a", "put", 20, 1, 5, 1234, b"a2"), Change("t", "b", "delete", 21)], 21)
        a = kv.get("t", "a")
        assert (a.body, a.phy_offset, a.queue_id, a.queue_offset, a.store_ts) == (b"a2", 20, 1, 5, 1234)
        assert kv.get("t", "b") is None and kv.get("t", "zz") is None
        assert kv.applied_through() == 21


def test_replays_and_late_changes_never_move_a_key_backwards(tmp_path):
    with KVView(str(tmp_path / "kv")) as kv:
        batch = [Change("t", "k", "put", 5, body=b"old"), Change("t", "k", "put", 9, body=b"new")]
        assert kv.apply(batch) == 1
        assert kv.apply(batch) == 0  # the same batch again: nothing changes
        kv.apply([Change("t", "k", "delete", 12)])
        assert kv.apply([Change("t", "k", "put", 9, body=b"new")]) == 0  # the tombstone keeps it deleted
        assert kv.get("t", "k") is None
        kv.apply([Change("t", "k", "put", 30, body=b"again")])
        assert kv.get("t", "k").body == b"again"


def test_scan_by_prefix_and_topics_stay_apart(tmp_path):
    with KVView(str(tmp_path / "kv")) as kv:
        kv.apply([Change("orders", k, "put", i, body=k.encode()) for i, k in enumerate(["a1", "a2", "b1", "ab"])])
        kv.apply([Change("order", "a9", "put", 100, body=b"other topic")])
        assert [e.key for e in kv.scan("orders", "a")] == ["a1", "a2", "ab"]
        assert [e.key for e in kv.scan("order")] == ["a9"]
        assert kv.multi_get("orders", ["b1", "zz"]) == {"b1": kv.get("orders", "b1"), "zz": None}


def test_bad_changes_are_refused(tmp_path):
    with KVView(str(tmp_path / "kv")) as kv:
        with pytest.raises(KVError, match="unknown op 'upsert'"):
            kv.apply([Change("t", "k", "upsert", 1)])
        with pytest.raises(KVError, match="contains NUL"):
            kv.apply([Change("t\x00x", "k", "put", 1)])
    with pytest.raises(KVError, match="no KV view"):
        KVView(str(tmp_path / "none"), read_only=True)


def test_read_only_view_while_a_writer_has_it_open(tmp_path):
    path = str(tmp_path / "kv")
    with KVView(path) as kv:
        kv.apply([Change("t", "k", "put", 1, body=b"v")])
        kv.db.flush()
        with KVView(path, read_only=True) as ro:
            assert ro.get("t", "k").body == b"v"
            with pytest.raises(KVError, match="read-only"):
                ro.apply([Change("t", "k", "put", 2)])


KILLED_AFTER_APPLY = """
import os, sys
from state.kv import Change, KVView
path, durable, batches = sys.argv[1], sys.argv[2], int(sys.argv[3])
kv = KVView(path, durable=durable)
for b in range(batches):
    kv.apply([Change("t", f"k{i % 50}", "put", b * 100 + i, body=os.urandom(2000 if i % 2 else 10))
              for i in range(100)], applied_through=b * 100 + 100)
    print(b * 100 + 100, flush=True)  # what the caller saw applied
os._exit(0)  # killed: no close, no flush but the view's own
"""


@pytest.mark.parametrize("durable", ["flush", "wal"])
def test_a_batch_applied_is_on_disk_when_apply_returns(tmp_path, durable):
    """The view's contract, with or without RocksDB's WAL: what ``apply`` returned from survives the
    process dying right after, and another process's read-only open sees it while the writer runs."""
    import subprocess
    import sys

    path = str(tmp_path / "kv")
    done = subprocess.run([sys.executable, "-c", KILLED_AFTER_APPLY, path, durable, "5"],
                          cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert done == ["100", "200", "300", "400", "500"]
    with KVView(path, read_only=True) as kv:
        assert kv.applied_through() == 500
        assert {k: e.phy_offset for k, e in view_contents(kv, ["t"]).items()} == {
            ("t", f"k{i}"): 400 + 50 + i for i in range(50)}
    with KVView(path, durable=durable) as kv:  # the writer again, and a reader beside it, no flush asked
        kv.apply([Change("t", "k0", "put", 600, body=b"new")], applied_through=601)
        with KVView(path, read_only=True) as ro:
            assert ro.get("t", "k0").body == b"new" and ro.applied_through() == 601


def test_a_view_built_from_scratch_is_written_once_at_close(tmp_path):
    """``durable="close"`` (a rebuild): no file per write, every batch on disk once closed."""
    path = str(tmp_path / "kv")
    with KVView(path, durable="close") as kv:
        for b in range(3):
            kv.apply([Change("t", f"k{i}", "put", b * 10 + i, body=b"v" * 2000) for i in range(10)],
                     applied_through=b * 10 + 10)
        assert not [n for n in os.listdir(path) if n.endswith((".sst", ".blob"))]
    with KVView(path, read_only=True) as kv:
        assert kv.applied_through() == 30 and len(view_contents(kv, ["t"])) == 10
    with pytest.raises(ValueError, match="none of flush, wal, close"):
        KVView(str(tmp_path / "other"), durable="sometimes")


@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["t1", "t2"]), st.integers(0, 30), st.sampled_from(["put", "put", "delete"]),
                  st.binary(max_size=20)),
        min_size=1, max_size=120,
    ),
    batch=st.integers(1, 40),
    seed=st.integers(0, 1000),
)
def test_random_batches_in_any_order_equal_the_oracle(tmp_path_factory, ops, batch, seed):
    changes = [Change(t, f"k{k}", op, phy, body=b) for phy, (t, k, op, b) in enumerate(ops)]
    shuffled = changes[:]
    random.Random(seed).shuffle(shuffled)  # late and out-of-order delivery
    with KVView(str(tmp_path_factory.mktemp("kv"))) as kv:
        for i in range(0, len(shuffled), batch):
            kv.apply(shuffled[i : i + batch])
        kv.apply(changes)  # a full replay changes nothing
        got = view_contents(kv, ["t1", "t2"])
    expected = oracle(changes)
    assert got.keys() == expected.keys()
    for k, c in expected.items():
        assert (got[k].body, got[k].phy_offset) == (c.body, c.phy_offset)


def test_a_table_whose_bodies_come_in_many_chunks_equals_the_oracle(tmp_path):
    """``apply_table`` as the KV writer hands it a batch: each column chunked as the tier reader left
    it (the bodies in row groups, the keys in one piece), puts, tombstones and null bodies, a key
    more than once, in no order; then the same batches again."""
    import pyarrow as pa

    from connectors.changes import CHANGE_ROW

    rng = random.Random(11)
    changes, phy = [], 0
    for _ in range(2_000):
        phy += rng.randrange(1, 5)
        key = f"k{rng.randrange(600)}"
        if rng.random() < 0.1:
            changes.append(Change("t", key, "delete", phy, store_ts=phy))
        else:
            body = None if rng.random() < 0.05 else rng.randbytes(rng.choice([0, 7, 300, 2_000]))
            changes.append(Change("t", key, "put", phy, 1, phy // 3, phy, body))
    rng.shuffle(changes)

    def table(batch: list[Change]) -> pa.Table:
        rows = [(c.topic, c.key, c.phy_offset, c.queue_id, c.queue_offset, c.store_ts, c.op == "delete",
                 c.body) for c in batch]
        columns = [list(col) for col in zip(*rows)]
        bodies = pa.array(columns[-1], pa.binary())
        cuts = sorted(rng.sample(range(1, len(batch)), 6))
        chunked = pa.chunked_array([bodies.slice(a, b - a) for a, b in zip([0, *cuts], [*cuts, len(batch)])])
        types = (pa.string(), pa.string(), pa.int64(), pa.int32(), pa.int64(), pa.int64(), pa.bool_())
        return pa.table([*(pa.array(col, t) for col, t in zip(columns, types)), chunked], names=list(CHANGE_ROW))

    with KVView(str(tmp_path / "kv")) as kv:
        for _ in range(2):  # the second pass is a replay: nothing changes
            for i in range(0, len(changes), 500):
                kv.apply_table(table(changes[i : i + 500]))
        got = view_contents(kv, ["t"])
    expected = oracle([c if c.body is not None else Change(c.topic, c.key, c.op, c.phy_offset, c.queue_id,
                                                          c.queue_offset, c.store_ts, b"") for c in changes])
    assert got.keys() == expected.keys()
    for k, c in expected.items():
        e = got[k]
        assert (e.body, e.phy_offset, e.queue_id, e.queue_offset, e.store_ts) == (
            c.body, c.phy_offset, c.queue_id, c.queue_offset, c.store_ts)


def test_values_in_blob_files_equal_the_oracle_after_compaction_and_a_read_only_open(tmp_path):
    """Values on both sides of the blob bound, overwritten and deleted over batches, then flushed
    and compacted (blob garbage collection moves live values), read back by a read-only open."""
    from state.kv import BLOB_MIN_BYTES

    rng = random.Random(5)
    changes, phy = [], 0
    for _ in range(6):
        for _ in range(300):
            phy += 1
            key = f"k{rng.randrange(200)}"
            if rng.random() < 0.1:
                changes.append(Change("t", key, "delete", phy))
            else:
                size = rng.choice([0, 10, BLOB_MIN_BYTES - 30, BLOB_MIN_BYTES, 3 * BLOB_MIN_BYTES])
                changes.append(Change("t", key, "put", phy, store_ts=phy, body=rng.randbytes(size)))
    path = str(tmp_path / "kv")
    with KVView(path) as kv:
        for i in range(0, len(changes), 300):
            kv.apply(changes[i : i + 300], applied_through=changes[i + 299].phy_offset + 1)
            kv.db.flush()
        kv.db.compact_range(None, None)
    assert any(name.endswith(".blob") for name in os.listdir(path)), "no value reached a blob file"
    expected = oracle(changes)
    with KVView(path, read_only=True) as kv:
        got = view_contents(kv, ["t"])
        assert kv.get("t", next(iter(expected))[1]).body == next(iter(expected.values())).body
    assert got.keys() == expected.keys()
    for k, c in expected.items():
        assert (got[k].body, got[k].phy_offset, got[k].store_ts) == (c.body, c.phy_offset, c.store_ts)


def test_apply_table_matches_apply(tmp_path):
    import pyarrow as pa

    table = pa.table({
        "topic": ["t", "t", "u"], "key": ["a", "a", "b"], "phy_offset": [1, 7, 3], "queue_id": [0, 1, 2],
        "queue_offset": [10, 11, 12], "store_ts": pa.array([1_000_000, 2_000_000, 3_000_000], pa.timestamp("us", tz="UTC")),
        "deleted": [False, False, True], "body": [b"x", b"y", None],
    })
    with KVView(str(tmp_path / "kv")) as kv:
        assert kv.apply_table(table, applied_through=9) == 2
        a = kv.get("t", "a")
        assert (a.body, a.phy_offset, a.queue_id, a.queue_offset, a.store_ts) == (b"y", 7, 1, 11, 2000)
        assert kv.get("u", "b") is None
        assert [(t, e and e.key) for t, e in kv.entries()] == [("t", "a"), ("u", None)]
        assert kv.apply_table(table, applied_through=9) == 0  # a replay changes nothing


def test_what_a_changelog_on_again_starts_from(tmp_path):
    """The live keys, the deletes' tombstones, and the keys that expired while no changelog took
    their tombstones (marked sent once a changelog has them); an expiry's tombstone, which holds
    the expired put's offset, is never among the rows."""
    with KVView(str(tmp_path / "kv"), ttl={"t": 10.0}) as kv:
        kv.apply([Change("t", "live", "put", 5, store_ts=50_000, body=b"v"),
                  Change("t", "deleted", "delete", 6, store_ts=50_000),
                  Change("t", "expired", "put", 3, queue_id=1, queue_offset=7, store_ts=1_000, body=b"x"),
                  Change("t", "sent", "put", 4, store_ts=1_000, body=b"s")])
        assert kv.unsent_expiries() == []
        assert [c.key for c in kv.expire(now_ms=11_000, before_write=lambda changes: None)] == ["expired", "sent"]
        assert kv.unsent_expiries() == []  # a changelog took them
        kv.apply([Change("t", "expired", "put", 8, store_ts=20_000, body=b"y"),
                  Change("t", "later", "put", 9, store_ts=20_000, body=b"z")])
        assert [c.key for c in kv.expire(now_ms=31_000)] == ["expired", "later"]  # no changelog
        assert kv.get("t", "expired") is None
        assert list(kv.latest_rows()) == [("t", "live", 5, 0, 0, 50_000, False, b"v")]
        assert list(kv.latest_rows(tombstones=True)) == [("t", "deleted", 6, 0, 0, 50_000, True, None),
                                                         ("t", "live", 5, 0, 0, 50_000, False, b"v")]
        unsent = kv.unsent_expiries()
        assert [(c.key, c.op, c.phy_offset, c.store_ts) for c in unsent] == [("expired", "delete", 8, 20_000),
                                                                             ("later", "delete", 9, 20_000)]
        kv.apply([Change("t", "later", "put", 10, store_ts=40_000, body=b"w")])  # put again meanwhile
        kv.mark_expiries_sent(unsent)
        assert kv.unsent_expiries() == [] and kv.get("t", "later").body == b"w"


def test_ttl_expires_keys_once_and_emits_deletes(tmp_path):
    ttl = {"short": 10.0}  # seconds; other topics never expire
    with KVView(str(tmp_path / "kv"), ttl=ttl) as kv:
        kv.apply([
            Change("short", "old", "put", 1, store_ts=1_000, body=b"o"),
            Change("short", "fresh", "put", 2, store_ts=1_000, body=b"f"),
            Change("long", "old", "put", 3, store_ts=1_000, body=b"l"),
        ])
        kv.apply([Change("short", "fresh", "put", 4, store_ts=9_000, body=b"f2")])  # updated: expiry moves
        assert kv.expire(now_ms=10_999) == []
        gone = kv.expire(now_ms=11_000)
        assert [(c.key, c.op, c.phy_offset) for c in gone] == [("old", "delete", 1)]
        assert kv.get("short", "old") is None and kv.get("long", "old").body == b"l"
        assert kv.apply([Change("short", "old", "put", 1, store_ts=1_000, body=b"o")]) == 0  # a replay stays expired
        assert [c.key for c in kv.expire(now_ms=19_000)] == ["fresh"]
        assert kv.expire(now_ms=10**12) == []
    # A TTL given to a topic later indexes the keys already there.
    with KVView(str(tmp_path / "kv"), ttl={"long": 1.0}) as kv:
        assert [c.key for c in kv.expire(now_ms=2_000)] == ["old"]

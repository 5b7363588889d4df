"""Helpers for the compaction tests: workloads with puts, deletes and repeated keys, and the three-way check."""

from __future__ import annotations

import random

from connectors.commitlog.format import Message
from connectors.commitlog.writer import CommitLogWriter
from connectors.tier import snapshots
from connectors.tier.location import open_backend
from state.kv import KVView
from streaming.queries.compaction.latest_per_key import read_state
from streaming import config as cfg
from streaming.settings import derive
from tests import ledger
from tests.oracle import latest_per_key

FILE = 256 * 1024


def kv_messages(n: int, *, keys: int, seed: int, topics: int = 2, delete_ratio: float = 0.15,
                body_size: int = 40, store_ts: int = 0, keyless_ratio: float = 0.02):
    """Random puts and deletes over ``keys`` keys; a few messages carry no key at all."""
    rng = random.Random(seed)
    for i in range(n):
        props = {"UNIQ_KEY": f"{seed:08X}{i:024X}"}
        if rng.random() >= keyless_ratio:
            props["KEYS"] = f"k{rng.randrange(keys):07d}"
        body = b""
        if rng.random() < delete_ratio:
            props["KV_OP"] = "DELETE"
        else:
            body = b"%d:%d:" % (seed, i) + rng.randbytes(rng.randrange(body_size))
        yield Message(topic=f"t{rng.randrange(topics)}", queue_id=rng.randrange(3), body=body,
                      properties=props, store_ts=store_ts)


def append(conf: cfg.Config, messages) -> None:
    with CommitLogWriter(conf.commitlog.dir, file_size=FILE, fsync="never") as writer:
        batch = []
        for m in messages:
            batch.append(m)
            if len(batch) == 5000:
                ledger.append(writer, batch)
                batch = []
        if batch:
            ledger.append(writer, batch)


def view_contents(conf: cfg.Config) -> dict:
    with KVView(derive(conf).paths.kv, read_only=True) as kv:
        return {(t, e.key): _fields(e) for t, e in kv.entries() if e is not None}


def stored_kinds(conf: cfg.Config, topic: str | None = None) -> dict[str, int]:
    """How the view stores its keys (of ``topic``; None: all), by the head's last byte: copies,
    references, tombstones."""
    from state import kv as kv_module

    names = {0: "copy", kv_module._REFERENCED: "reference"}
    counts: dict[str, int] = {}
    with KVView(derive(conf).paths.kv, read_only=True) as view:
        for raw_key, raw in view.db.items(from_key=kv_module._DATA_START):
            if topic is not None and raw_key.decode().partition(kv_module.SEP)[0] != topic:
                continue
            kind = names.get(raw[kv_module._HEAD.size - 1], "tombstone")
            counts[kind] = counts.get(kind, 0) + 1
            assert kind != "reference" or len(raw) == kv_module._HEAD.size  # a reference holds no body
    return counts


def _fields(e) -> dict:
    return {"body": e.body, "phy_offset": e.phy_offset, "queue_id": e.queue_id,
            "queue_offset": e.queue_offset, "store_ts": e.store_ts, "deleted": False}


def spark_state(spark, conf: cfg.Config) -> dict:
    """Spark's committed state: (topic, key) -> the latest message's physical offset, deletes included."""
    table = read_state(spark, derive(conf).paths.checkpoint("compaction"))
    cols = [table.column(c).to_pylist() for c in ("topic", "key", "phy_offset")]
    return {(t, k): p for t, k, p in zip(*cols)}


def snapshot_contents(conf: cfg.Config) -> tuple[dict, int | None]:
    """The newest snapshot of every topic, merged, and the lowest offset they cover through."""
    backend = open_backend(conf.tier.location)
    try:
        latest = snapshots.latest_snapshots(backend, conf.broker.name)
        out = {}
        for snap in latest.values():
            for row in snapshots.read_snapshot(backend, snap).to_pylist():
                out[(snap.topic, row["key"])] = {
                    "body": row["body"], "phy_offset": row["phy_offset"], "queue_id": row["queue_id"],
                    "queue_offset": row["queue_offset"], "store_ts": round(row["store_ts"].timestamp() * 1000),
                    "deleted": False,
                }
        return out, min((s.through_phy for s in latest.values()), default=None)
    finally:
        backend.close()


def assert_all_equal_oracle(spark, conf: cfg.Config, *, snapshot: bool = True) -> dict:
    """The KV view, Spark's state and the newest snapshot all equal the latest value of each key in
    what the writer appended (``tests.ledger``; a replay of the commitlog where it cannot know)."""
    expected = latest_per_key(conf.commitlog.dir)
    assert view_contents(conf) == expected
    with_tombstones = latest_per_key(conf.commitlog.dir, with_tombstones=True)
    assert spark_state(spark, conf) == {k: v["phy_offset"] for k, v in with_tombstones.items()}
    if snapshot:
        snap, _ = snapshot_contents(conf)
        assert snap == expected
    return expected

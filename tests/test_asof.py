"""A key's value as of any moment, from the tier and its snapshots alone, against the writer's ledger.

The oracle replays the ledger: a key's value at T is its last message (by physical offset) stored at
or before T.  The tier is written without Spark (``tiering_helpers.tier_in_batches``), snapshots by
the KV writer's own ``write_snapshot`` from a view that applied the ledger's changes up to a point.
"""

from __future__ import annotations

import random
import subprocess
import sys
import zlib

import pytest

from connectors.commitlog.format import Message
from connectors.commitlog.writer import CommitLogWriter
from connectors.tier.asof import AsOfReader, AsOfRefused
from connectors.tier.reader import TierReader
from connectors.tier.retention import Retention
from state.kv import Change, KVView
from state.kv_writer import write_snapshot
from state.metadata import MetadataStore
from tests import ledger
from tests.kv_helpers import kv_messages
from tests.tiering_helpers import tier_in_batches

BASE_MS = 1_700_000_000_000
STEP_MS = 10
KEYS = 40


def key_of(n: int) -> str:
    return f"k{n:07d}"  # as kv_messages names them


def messages(n: int, seed: int, start: int = 0, at=lambda i: BASE_MS + i * STEP_MS) -> list[Message]:
    """One topic's keyed puts and deletes, the i-th stored at ``at(i)``."""
    out = list(kv_messages(n, keys=KEYS, seed=seed, topics=1, keyless_ratio=0.0))
    for i, m in enumerate(out, start):
        m.store_ts = at(i)
    return out


def write_chunks(tmp_path, chunks: int, per_chunk: int, name: str = "commitlog",
                 at=lambda i: BASE_MS + i * STEP_MS) -> tuple[str, list[Message], list[int]]:
    """The commitlog in ``chunks`` appends; returns its directory, the ledger and each chunk's end."""
    log_dir = str(tmp_path / name)
    written, ends = [], []
    with CommitLogWriter(log_dir, file_size=256 * 1024, fsync="never") as writer:
        for c in range(chunks):
            stored = ledger.append(writer, messages(per_chunk, seed=c + zlib.crc32(name.encode()) % 1000, start=c * per_chunk, at=at))
            written.extend(stored)
            ends.append(stored[-1].phy_offset + stored[-1].size)
    return log_dir, written, ends


def view_through(path, written: list[Message], through: int) -> KVView:
    """A KV view that applied the ledger's changes below ``through``."""
    kv = KVView(str(path))
    kv.apply([Change("t0", m.properties["KEYS"], "delete" if m.properties.get("KV_OP") == "DELETE" else "put",
                     m.phy_offset, m.queue_id, m.queue_offset, m.store_ts, m.body)
              for m in written if m.phy_offset < through], applied_through=through)
    return kv


def snapshot_at(tmp_path, location: str, written: list[Message], through: int, broker: str = "broker-a") -> None:
    """A snapshot through ``through``, as the KV writer writes one from its view."""
    kv = view_through(tmp_path / f"kv-{broker}-{through}", written, through)
    try:
        write_snapshot(kv, location, broker, through, keep=20)
    finally:
        kv.close()


def oracle(written: list[Message], key: str, at_ms: int, ttl_ms: int | None = None) -> tuple[str, bytes | None]:
    last = None
    for m in written:
        if m.properties["KEYS"] == key and m.store_ts <= at_ms and (last is None or m.store_ts >= last.store_ts):
            last = m  # the ledger is in physical order; two brokers' ledgers, by store time
    if last is None:
        return "absent", None
    if last.properties.get("KV_OP") == "DELETE":
        return "deleted", None
    if ttl_ms is not None and last.store_ts + ttl_ms <= at_ms:
        return "expired", None
    return "live", last.body


def probe_times(written: list[Message], rng: random.Random, n: int) -> list[int]:
    end = written[-1].store_ts
    deletes = [m.store_ts for m in written if m.properties.get("KV_OP") == "DELETE"]
    return ([rng.randrange(BASE_MS - 100, end + 100) for _ in range(n)]
            + [t + d for t in rng.sample(deletes, 20) for d in (0, 1)] + [BASE_MS - 1, end])


def build(tmp_path, location: str, broker: str = "broker-a", at=lambda i: BASE_MS + i * STEP_MS):
    log_dir, written, ends = write_chunks(tmp_path, chunks=5, per_chunk=400, name=f"commitlog-{broker}", at=at)
    store = MetadataStore(str(tmp_path / f"metadata-{broker}"))
    try:
        tier_in_batches(log_dir, location, store, 40_000, broker=broker, segment_messages=100)
    finally:
        store.close()
    for through in ends[1:4]:  # none before the second chunk: early times come from the history alone
        snapshot_at(tmp_path, location, written, through, broker)
    return location, written, ends


@pytest.fixture
def tier(tmp_path):
    return build(tmp_path, str(tmp_path / "tier"))


def test_a_key_at_any_moment_equals_the_ledger(tier):
    location, written, ends = tier
    reader = AsOfReader(TierReader(location))
    rng = random.Random(7)
    used = set()
    times = probe_times(written, rng, 960)
    for at in times:
        key = key_of(rng.randrange(KEYS))
        got = reader.get("t0", key, at)
        assert (got.state, got.value) == oracle(written, key, at), (key, at, got)
        used.add(got.snapshot is not None)
    assert used == {True, False}  # both ways were taken: from a snapshot, and from the history alone
    # at a snapshot's own moment: the newest store time of what it reflects
    stands = max(m.store_ts for m in written if m.phy_offset < ends[2])
    for key in (key_of(n) for n in range(KEYS)):
        got = reader.get("t0", key, stands)
        assert (got.state, got.value) == oracle(written, key, stands)
        if got.state == "live":  # a key not live in the snapshot is answered from its history
            assert got.snapshot is not None and got.snapshot.endswith(f"{ends[2]:020d}.parquet")


def test_two_brokers_writing_one_topic(tmp_path):
    """Each broker's part of the tier answers for its own messages; the key's value is the newest
    of their answers by store time (the brokers' store times interleave here)."""
    location = str(tmp_path / "tier")
    _, a, _ = build(tmp_path, location, "broker-a", at=lambda i: BASE_MS + i * 2 * STEP_MS)
    _, b, _ = build(tmp_path, location, "broker-b", at=lambda i: BASE_MS + i * 2 * STEP_MS + STEP_MS)
    written = a + b
    reader = AsOfReader(TierReader(location))
    rng = random.Random(5)
    brokers = set()
    for at in probe_times(sorted(written, key=lambda m: m.store_ts), rng, 150):
        key = key_of(rng.randrange(KEYS))
        got = reader.get("t0", key, at)
        assert (got.state, got.value) == oracle(written, key, at), (key, at, got)
        brokers.add(got.change["broker"] if got.change else None)
    assert {"broker-a", "broker-b"} <= brokers
    one = AsOfReader(TierReader(location, broker="broker-b"))
    key, at = key_of(5), written[-1].store_ts + 1
    got = one.get("t0", key, at)
    assert (got.state, got.value) == oracle(b, key, at)


def test_an_s3_tier_answers_the_same(tmp_path, s3_location):
    _, written, _ = build(tmp_path, s3_location)
    reader = AsOfReader(TierReader(s3_location))
    rng = random.Random(9)
    for at in probe_times(written, rng, 10)[:20]:
        key = key_of(rng.randrange(KEYS))
        got = reader.get("t0", key, at)
        assert (got.state, got.value) == oracle(written, key, at), (key, at, got)


def test_a_topic_with_a_time_to_live_reports_expiries(tier):
    location, written, _ = tier
    ttl = 30 * STEP_MS  # keys change about every 40 messages: many expire between changes
    reader = AsOfReader(TierReader(location), {"t0": ttl})
    rng = random.Random(11)
    states = set()
    for at in probe_times(written, rng, 400):
        key = key_of(rng.randrange(KEYS))
        got = reader.get("t0", key, at)
        assert (got.state, got.value) == oracle(written, key, at, ttl), (key, at, got)
        states.add(got.state)
    assert states == {"live", "deleted", "expired", "absent"}


def test_history_lists_every_change_in_the_window(tier):
    location, written, _ = tier
    reader = AsOfReader(TierReader(location))
    lo, hi = BASE_MS + 300 * STEP_MS, BASE_MS + 1500 * STEP_MS
    got = reader.history("t0", key_of(7), lo, hi)
    want = [m for m in written if m.properties["KEYS"] == key_of(7) and lo <= m.store_ts <= hi]
    assert [(r["phy_offset"], r["store_ts"], r["op"], r["body"]) for r in got] == [
        (m.phy_offset, m.store_ts, "delete" if m.properties.get("KV_OP") else "put", m.body) for m in want]


def test_a_time_retention_put_out_of_reach_is_refused_naming_the_earliest_answerable(tmp_path):
    log_dir, written, ends = write_chunks(tmp_path, chunks=5, per_chunk=400)
    location = str(tmp_path / "tier")
    store = MetadataStore(str(tmp_path / "metadata"))
    try:  # each queue keeps about its newest 300 messages: the oldest segments go
        tier_in_batches(log_dir, location, store, 40_000, segment_messages=100,
                        retention=Retention(messages={"*": 300}, check_s=0), delete_grace_s=0)
    finally:
        store.close()
    reader = AsOfReader(TierReader(location))
    with pytest.raises(AsOfRefused, match="no compacted snapshot"):
        reader.get("t0", key_of(1), written[-1].store_ts)
    snapshot_at(tmp_path, location, written, ends[3])
    reader = AsOfReader(TierReader(location))  # a reader answers from the tier as it first found it
    stands = max(m.store_ts for m in written if m.phy_offset < ends[3])
    with pytest.raises(AsOfRefused, match=f"earliest time that can is .*\\({stands} ms\\)"):
        reader.get("t0", key_of(1), stands - 1)
    rng = random.Random(3)
    for _ in range(200):
        at, key = rng.randrange(stands, written[-1].store_ts + 100), key_of(rng.randrange(KEYS))
        got, want = reader.get("t0", key, at), oracle(written, key, at)
        if got.state == "absent" and want[0] == "deleted":  # deleted before the snapshot, whose history is gone
            assert got.snapshot is not None and not any(
                m.phy_offset >= ends[3] and m.store_ts <= at for m in written if m.properties["KEYS"] == key)
            continue
        assert (got.state, got.value) == want, (key, at, got)


def test_the_command_line_answers_and_refuses_in_one_line(tier, tmp_path):
    location, written, _ = tier
    m = next(m for m in reversed(written) if not m.properties.get("KV_OP"))
    key, at = m.properties["KEYS"], m.store_ts
    base = [sys.executable, "-m", "streaming.cli", "kv"]
    got = subprocess.run([*base, "get", "t0", key, "--as-of", str(at), "--tier", location, "--format", "json"],
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    assert '"state": "live"' in got.stdout and f'"phy_offset": {m.phy_offset}' in got.stdout
    bad = subprocess.run([*base, "get", "nope", key, "--as-of", str(at), "--tier", location],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "t0" in bad.stderr
    history = subprocess.run([*base, "history", "t0", key, "--from", str(BASE_MS), "--to", str(at),
                              "--tier", location, "--format", "json"], capture_output=True, text=True, timeout=120)
    assert history.returncode == 0, history.stderr
    assert history.stdout.count("\n") == sum(1 for w in written if w.properties["KEYS"] == key and w.store_ts <= at)


def test_a_snapshot_written_before_snapshots_said_their_time_is_passed_over(tier, tmp_path):
    from connectors.tier import snapshots
    from connectors.tier.location import open_backend

    location, written, ends = tier
    kv = view_through(tmp_path / "kv-old", written, ends[4])
    try:
        backend = open_backend(location)
        snapshots.write_snapshots(backend, "broker-a", kv.entries(), ends[4], keep=20)  # as before: no time
        backend.close()
    finally:
        kv.close()
    reader = AsOfReader(TierReader(location))
    rng = random.Random(13)
    for at in probe_times(written, rng, 100):
        key = key_of(rng.randrange(KEYS))
        got = reader.get("t0", key, at)
        assert (got.state, got.value) == oracle(written, key, at), (key, at, got)
        assert got.snapshot is None or not got.snapshot.endswith(f"{ends[4]:020d}.parquet")

"""The compaction query against a plain replay: KV view, Spark's state store and snapshots agree.

Workloads mix puts, deletes, repeated keys and keyless messages, and the
service is restarted between rounds (each run is a new query on the same
checkpoint, as after a deploy).
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import time

import pytest

from connectors.commitlog.format import Message
from state.kv import Change, KVView
from state.metadata import MetadataStore
from streaming import config as cfg
from streaming.service import Service
from streaming.settings import derive
from tests.cli_runner import ROOT
from tests.kv_helpers import append, assert_all_equal_oracle, kv_messages, spark_state, stored_kinds, view_contents
from tests.oracle import latest_per_key
from tests.tiering_helpers import make_conf

EVERY_BATCH = cfg.CompactionConfig(enabled=True, snapshot_interval_s=0.001)


def run(spark, conf) -> None:
    assert Service(conf).run(until_caught_up=True, spark=spark) == 0


def test_latest_per_key_survives_restarts_and_equals_the_oracle(spark, tier_location, tmp_path):
    conf = make_conf(tmp_path, tier_location, compaction=EVERY_BATCH)
    for round_ in range(3):
        append(conf, kv_messages(1500, keys=300, seed=round_))
        run(spark, conf)
        expected = assert_all_equal_oracle(spark, conf)
    assert len(expected) > 200  # the check covered real content
    run(spark, conf)  # nothing new: a run with no batches changes nothing
    assert view_contents(conf) == expected


def test_values_kept_in_the_tier_read_back_whole_everywhere(spark, tier_location, tmp_path):
    """With ``compaction.reference_min_bytes`` inside the workload's sizes, the view keeps about half
    its values as references into the tier, in sealed segments and staging objects alike: the view
    (opened without being told its tier), Spark's state and every snapshot (the later ones reusing
    their predecessor's values) still equal the oracle across restarts."""
    compaction = cfg.CompactionConfig(enabled=True, snapshot_interval_s=0.001, reference_min_bytes=190)
    conf = make_conf(tmp_path, tier_location, compaction=compaction, segment_messages=150)
    for round_ in range(3):
        append(conf, kv_messages(1500, keys=300, seed=40 + round_, body_size=80))
        run(spark, conf)
        expected = assert_all_equal_oracle(spark, conf)
    kinds = stored_kinds(conf)
    assert kinds["reference"] > 50 and kinds["copy"] > 50, kinds
    assert len(expected) > 200


def test_a_retention_set_later_with_compaction_off_has_the_next_start_take_the_values_in(spark, tmp_path):
    """The view references values of t0 and t1; then compaction is turned off and t0 given a tier
    retention.  No compaction query starts to take t0's values in, so the service's start does: the
    tier's retention no longer waits on t0, t1 stays referenced, and the view reads back the same."""
    compaction = cfg.CompactionConfig(enabled=True, snapshot_interval_s=0, reference_min_bytes=190)
    conf = make_conf(tmp_path, str(tmp_path / "tier"), compaction=compaction, segment_messages=150)
    append(conf, kv_messages(1500, keys=300, seed=60, body_size=80))
    run(spark, conf)
    before = view_contents(conf)
    assert stored_kinds(conf, "t0").get("reference", 0) > 20 and stored_kinds(conf, "t1").get("reference", 0) > 20

    later = dataclasses.replace(conf, compaction=dataclasses.replace(compaction, enabled=False),
                                tier=dataclasses.replace(conf.tier, retention_messages="t0=300"))
    append(later, kv_messages(300, keys=300, seed=61, body_size=80))
    run(spark, later)
    store = MetadataStore(derive(later).paths.metadata, read_only=True)
    try:
        assert store.journal.references() == {"t1"}
    finally:
        store.close()
    assert stored_kinds(later, "t0").get("reference", 0) == 0 and stored_kinds(later, "t1")["reference"] > 20
    assert view_contents(later) == before  # compaction off: the view took nothing new, and lost nothing


def test_late_and_replayed_rows_never_move_a_key_backwards(spark, tmp_path):
    """A new checkpoint replays everything from the start into a view that is ahead of it."""
    conf = make_conf(tmp_path, str(tmp_path / "tier"), compaction=EVERY_BATCH)
    append(conf, kv_messages(2000, keys=100, seed=7))
    run(spark, conf)
    expected = assert_all_equal_oracle(spark, conf)
    shutil.rmtree(conf.checkpoint.dir)  # Spark forgets; the view does not
    run(spark, conf)
    assert view_contents(conf) == expected
    assert_all_equal_oracle(spark, conf)


def test_ttl_expires_quiet_keys_and_nothing_else(spark, tmp_path):
    now = int(time.time() * 1000)
    ttl = cfg.CompactionConfig(enabled=True, ttl="t0=10m", snapshot_interval_s=0.001)
    conf = make_conf(tmp_path, str(tmp_path / "tier"), compaction=ttl)
    append(conf, kv_messages(800, keys=150, seed=1, store_ts=now - 3_600_000))  # an hour ago
    append(conf, kv_messages(300, keys=150, seed=2))  # now: some keys are refreshed
    run(spark, conf)
    ttl_map = {"t0": 600.0}  # t0=10m
    expected = latest_per_key(conf.commitlog.dir, ttl=ttl_map, now_ms=int(time.time() * 1000))
    everything = latest_per_key(conf.commitlog.dir)
    got = view_contents(conf)
    assert got == expected
    expired = {k for k in everything if k not in expected}
    assert expired and all(k[0] == "t0" for k in expired)  # only the topic with a TTL loses keys
    assert all(everything[k]["store_ts"] < now - 3_000_000 for k in expired)
    # Spark's aggregation keeps expired keys (it has no per-key eviction); the view hides them.
    live_in_spark = {k for k, phy in spark_state(spark, conf).items() if phy == everything.get(k, {}).get("phy_offset")}
    assert live_in_spark == set(everything)
    # A replayed old put cannot bring an expired key back.
    topic, key = next(iter(expired))
    with KVView(derive(conf).paths.kv, ttl=ttl_map) as kv:
        old = everything[(topic, key)]
        assert kv.apply([Change(topic, key, "put", old["phy_offset"], store_ts=old["store_ts"], body=b"x")]) == 0


def test_transaction_records_and_keyless_messages_take_no_part(spark, tmp_path):
    conf = make_conf(tmp_path, str(tmp_path / "tier"), compaction=EVERY_BATCH)
    prepared = Message(topic="t0", queue_id=0, body=b"prepared", properties={"KEYS": "tx"}, sysflag=0x4)
    committed = Message(topic="t0", queue_id=0, body=b"committed", properties={"KEYS": "tx2"}, sysflag=0x8)
    keyless = Message(topic="t0", queue_id=0, body=b"no key", properties={})
    append(conf, [prepared, committed, keyless])
    run(spark, conf)
    assert {k: v["body"] for k, v in view_contents(conf).items()} == {("t0", "tx2"): b"committed"}
    assert_all_equal_oracle(spark, conf)


def test_a_million_distinct_keys(spark, tmp_path):
    conf = make_conf(tmp_path, str(tmp_path / "tier"), compaction=EVERY_BATCH)
    conf = cfg.Config(**{**conf.__dict__, "source": cfg.SourceConfig(max_records_per_trigger=250_000,
                                                                      partition_bytes=16 << 20)})

    def distinct_then_updates():
        for i in range(1_000_000):
            yield Message(topic=f"t{i % 2}", queue_id=i % 4, body=b"v%d" % i, properties={"KEYS": f"k{i:07d}"})
        yield from kv_messages(100_000, keys=1_000_000, seed=3, body_size=8)

    append(conf, distinct_then_updates())
    run(spark, conf)
    expected = assert_all_equal_oracle(spark, conf)
    assert len(expected) > 900_000


def test_a_view_behind_the_checkpoint_catches_up_from_the_commitlog(spark, tmp_path):
    """Spark may commit a batch before the apply thread has written it to the view (then a crash)."""
    conf = make_conf(tmp_path, str(tmp_path / "tier"), compaction=EVERY_BATCH)
    append(conf, kv_messages(2000, keys=300, seed=21))
    run(spark, conf)
    expected = assert_all_equal_oracle(spark, conf)
    shutil.rmtree(derive(conf).paths.kv)  # the view lost everything; Spark's checkpoint has it all
    run(spark, conf)  # no new messages, so no batch: only the catch-up can restore the view
    assert view_contents(conf) == expected


def test_the_state_stores_run_on_rocksdb_in_a_jvm_that_trims_its_c_heap_and_compiles_with_c1_only(spark):
    """Bounded RocksDB memory is only half of flat memory: glibc keeps what RocksDB frees unless
    the JVM trims it (streaming/runtime/session.py), and an old JVM would ignore the flag silently.  The
    JIT's first tier only is the default (``spark.jit_c1_only``); false leaves the flag out."""
    from streaming.runtime.session import C1_ONLY, java_options

    jvm = spark.sparkContext._jvm
    assert spark.conf.get("spark.sql.streaming.stateStore.providerClass").endswith("RocksDBStateStoreProvider")
    assert spark.conf.get("spark.sql.streaming.stateStore.rocksdb.boundedMemoryUsage") == "true"
    bean_class = jvm.java.lang.Class.forName("com.sun.management.HotSpotDiagnosticMXBean")
    diagnostics = jvm.java.lang.management.ManagementFactory.getPlatformMXBean(bean_class)
    assert diagnostics.getVMOption("TrimNativeHeapInterval").getValue() == "30000"
    assert diagnostics.getVMOption("TieredStopAtLevel").getValue() == "1"
    assert C1_ONLY not in java_options(False, c1_only=False) and C1_ONLY in java_options(True)


def _thp_enabled(pid) -> str | None:
    with open(f"/proc/{pid}/status") as status:
        return next((line.split()[1] for line in status if line.startswith("THP_enabled:")), None)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux process flag")
def test_the_session_and_the_jvm_it_starts_run_without_transparent_huge_pages(spark):
    """``spark.transparent_huge_pages = false`` (the default): the driver turns them off before the
    JVM starts, so the JVM inherits it; and so does a process started later, in a process of its own."""
    assert _thp_enabled("self") == "0"
    assert _thp_enabled(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()) == "0"
    code = ("import subprocess; from streaming.runtime.session import no_huge_pages; assert no_huge_pages(); "
            "print(subprocess.run(['cat', '/proc/self/status'], capture_output=True, text=True).stdout)")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           cwd=ROOT)
    assert "THP_enabled:\t0" in child.stdout

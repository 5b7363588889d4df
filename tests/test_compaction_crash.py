"""SIGKILL the service inside compaction batches, restart it, and compare everything with the oracle.

Each run is a real ``tierlog run --until-caught-up`` process running both
queries; ``TIERLOG_FAULT`` kills its driver at a named point of the
compaction sink.  New messages are appended before every run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from streaming import config as cfg
from tests.cli_runner import run_killed_at, sink_offsets, tierlog
from tests.cli_runner import write_config as shared_config
from tests.kv_helpers import append, assert_all_equal_oracle, kv_messages, view_contents
from tests.oracle import latest_per_key, view_fields, written_messages
from tests.tiering_helpers import assert_tier_equals_commitlog

FAULTS = [("collected", 2), ("kv_applied", 1), ("snapshotted", 2), ("kv_applied", 3), ("collected", 1),
          ("snapshotted", 1)]


def puts_by_offset(directory: str) -> dict:
    """Every keyed put the writer appended: physical offset -> ((topic, key), the view's fields of it)."""
    return {m.phy_offset: ((m.topic, m.key("KEYS")), view_fields(m)) for m in written_messages(directory)
            if m.key("KEYS") is not None and m.dispatched and m.op != "delete"}


def write_config(tmp_path: Path) -> Path:
    return shared_config(tmp_path, source={"max_bytes_per_trigger": 40000},
                         tier={"segment_messages": 300, "delete_grace_s": 0}, compaction={"snapshot_interval_s": 0.001})


@pytest.mark.heavy
@pytest.mark.timeout(1200)
def test_sigkill_in_compaction_batches_then_restart(spark, tmp_path):
    config = write_config(tmp_path)
    conf = cfg.load(str(config), env={})
    kills = 0
    for i, (point, nth) in enumerate(FAULTS):
        append(conf, kv_messages(500, keys=200, seed=i))
        kills += run_killed_at(config, point, nth, tmp_path / f"fault-{i}")
        # Whatever the view holds after a crash is a state the oracle passed through: no key
        # is newer than the log, and none has a value that was never its latest.
        everything = latest_per_key(conf.commitlog.dir, with_tombstones=True)
        written = puts_by_offset(conf.commitlog.dir)
        for k, v in view_contents(conf).items():
            assert v["phy_offset"] <= everything[k]["phy_offset"], k
            # ... and its value is exactly the put of that key at that offset: body, queue, time.
            assert written.get(v["phy_offset"]) == (k, v), (k, v["phy_offset"])
    assert kills >= 5, f"only {kills} runs were killed"

    final = tierlog("run", "--until-caught-up", "--config", str(config))
    assert final.returncode == 0, final.stderr[-3000:]
    assert_all_equal_oracle(spark, conf)
    assert_tier_equals_commitlog(conf)
    sinks = sink_offsets(conf)
    assert sinks["kv"] == sinks["tier"]  # both caught up to the end of the log

"""Crash tests: SIGKILL the service at chosen points, restart it, compare the tier with the oracle.

Each run is a real ``tierlog run --until-caught-up`` process.  ``TIERLOG_FAULT``
makes it SIGKILL itself (from the driver or from an executor) at a named
point; more messages are appended before every run so each run has work.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from connectors.tier.reader import TierReader
from state.metadata import MetadataStore
from streaming import config as cfg
from streaming.settings import derive
from tests.cli_runner import crashed_in, tierlog
from tests.cli_runner import write_config as shared_config
from tests.tiering_helpers import assert_tier_equals_commitlog, produce

# (crash point, on which pass): 14 kills, covering every point at least once.
FAULTS = [
    ("staged", 1), ("uploaded", 1), ("dispatched", 2), ("logged", 1), ("committed", 2), ("seal_uploaded", 1),
    ("sealed", 1), ("fold_written", 1), ("staged", 3), ("logged", 3), ("folded", 1), ("committed", 1),
    ("seal_uploaded", 2), ("dispatched", 1),
]


def write_config(tmp_path: Path) -> Path:
    return shared_config(tmp_path, source={"max_bytes_per_trigger": 60000, "partition_bytes": 30000},
                         tier={"segment_messages": 120, "delete_grace_s": 0, "fold_every": 5},
                         compaction={"enabled": False})


def run_service(config: Path, fault: str | None, fault_dir: Path) -> subprocess.CompletedProcess:
    """A run in ``fault_dir`` (``tests.cli_runner.crashed_in``); one that was not killed left no JVM crash."""
    env = {"TIERLOG_FAULT": fault, "TIERLOG_FAULT_DIR": str(fault_dir)} if fault else None
    result = tierlog("run", "--until-caught-up", "--config", str(config), env=env, cwd=fault_dir)
    if result.returncode != -signal.SIGKILL:
        assert not crashed_in(fault_dir), crashed_in(fault_dir)
    return result


def committed_offsets(conf) -> dict:
    return {k: q.commit for k, q in TierReader(conf.tier.location).committed().queue_states().items()}


@pytest.mark.heavy
@pytest.mark.timeout(1800)
def test_sigkill_at_every_point_then_restart_loses_and_duplicates_nothing(tmp_path):
    config = write_config(tmp_path)
    conf = cfg.load(str(config), env={})
    produce(conf, 600)
    kills, previous, fired = 0, {}, set()
    for i, (point, nth) in enumerate(FAULTS):
        fault_dir = tmp_path / f"fault-{i}"
        fault_dir.mkdir()
        result = run_service(config, f"{point}:{nth}", fault_dir)
        if result.returncode == -signal.SIGKILL:
            kills += 1
            fired.add(point)
        else:
            assert result.returncode == 0, result.stderr[-3000:]
        offsets = committed_offsets(conf)
        assert all(offsets.get(k, 0) >= v for k, v in previous.items()), "a commit offset moved backwards"
        previous = offsets
        produce(conf, 250, start=600 + 250 * i)

    final = run_service(config, None, tmp_path)
    assert final.returncode == 0, final.stderr[-3000:]
    assert kills >= 12, f"only {kills} runs were killed"
    declared = {point for point, _ in FAULTS}
    assert fired == declared, f"crash points that never fired: {sorted(declared - fired)}"
    assert_tier_equals_commitlog(conf)

    state = TierReader(conf.tier.location).committed()
    store = MetadataStore(derive(conf).paths.metadata, read_only=True)
    try:
        for q in store.queues():
            tier_q = state.queues[(q.topic, q.queue_id)]
            assert (q.commit, q.sealed) == (tier_q.commit, tier_q.sealed)
            assert q.low <= q.sealed <= q.commit <= q.dispatch
        assert store.journal.sinks()["tier"] == state.source_end
    finally:
        store.close()

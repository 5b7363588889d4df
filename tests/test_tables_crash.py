"""SIGKILL inside the Iceberg table commits of a real ``tierlog run`` ([tables] enabled, compaction
snapshotting every batch), at each crash point the tables added, then restart: the message tables
hold exactly the ledger's committed messages, each once (a fresh file written but not committed is
never listed), and the latest-per-key tables the ledger's latest values at their snapshot, nothing
missing or doubled."""

from __future__ import annotations

import pytest

from streaming import config as cfg
from tests.cli_runner import run_killed_at, tierlog
from tests.cli_runner import write_config as shared_config
from tests.test_tables import assert_message_tables_equal_ledger
from tests.test_tables_latest import assert_latest_tables_equal_ledger
from tests.tiering_helpers import assert_tier_equals_commitlog, produce

# (crash point, on which pass): between a fresh file's write and its commit, inside a message
# table's commit, right after it, inside a latest-per-key table's commit, and a later message
# table commit.
FAULTS = [("table_fresh_written", 1), ("table_committing", 1), ("table_committed", 1), ("latest_table_committing", 1),
          ("table_committing", 2)]


@pytest.mark.heavy
@pytest.mark.timeout(1200)
def test_sigkill_inside_table_commits_then_restart_leaves_tables_equal_to_the_ledger(tmp_path):
    config = shared_config(tmp_path, source={"max_bytes_per_trigger": 60000, "partition_bytes": 30000},
                           tier={"segment_messages": 120, "delete_grace_s": 0, "fold_every": 5},
                           compaction={"snapshot_interval_s": 0.01}, tables={"enabled": True})
    conf = cfg.load(str(config), env={})
    produce(conf, 900)  # 150 messages a queue: every queue seals in the first run
    killed, written = [], 900
    for i, (point, nth) in enumerate(FAULTS):
        if run_killed_at(config, point, nth, tmp_path / f"fault-{i}"):
            killed.append(point)
        # Before the last fault, over two segments a queue: its run commits a second message table
        # however far an earlier run got before its kill (a run killed late, its tiering ahead of
        # compaction's table commit, had sealed everything, and the run after it had nothing to seal).
        more = 1600 if i == len(FAULTS) - 2 else 400
        produce(conf, more, start=written)
        written += more
    final = tierlog("run", "--until-caught-up", "--config", str(config))
    assert final.returncode == 0, final.stderr[-3000:]
    assert len(killed) == len(FAULTS), f"killed only at {killed}"
    assert_tier_equals_commitlog(conf)
    assert assert_message_tables_equal_ledger(conf) > 1000
    assert assert_latest_tables_equal_ledger(conf) > 20

"""Orderly exit: `tierlog run` stops every query and its Spark session before the process exits.

A clean `./dev test` once crashed a driver JVM 14 s into a service run (SIGSEGV in librocksdbjni at
rocksdb::GetPropertyInfo, an hs_err_pid file left in the working directory): the interpreter's exit
tore the JVM down while a state store's maintenance thread still asked RocksDB for a property.  The
service now stops the session it started, so Spark closes its state stores first.  A crash like
that is rare, hence several runs; each leaves its hs_err file, if any, in its working directory.
Every other test that runs `tierlog run` checks its exit too, so this one need not be the only net:
20 runs took over 600 s on a loaded CI host, 6 keep it near 3 minutes."""

from __future__ import annotations

import pytest

from streaming import config as cfg
from tests.cli_runner import ROOT, tierlog, write_config
from tests.tiering_helpers import assert_tier_equals_commitlog, produce

pytestmark = pytest.mark.heavy
RUNS = 6


@pytest.mark.timeout(1200)
def test_many_runs_exit_zero_and_leave_no_jvm_crash(tmp_path):
    config = write_config(tmp_path, compaction={"snapshot_interval_s": 0})
    conf = cfg.load(str(config), env={})
    for run in range(RUNS):
        produce(conf, 40, start=run * 40)
        r = tierlog("run", "--until-caught-up", "--config", str(config), cwd=tmp_path)
        assert r.returncode == 0, (run, r.stderr[-3000:])
    crashes = list(tmp_path.rglob("hs_err_pid*")) + list(ROOT.glob("hs_err_pid*"))
    assert not crashes, crashes
    assert_tier_equals_commitlog(conf)

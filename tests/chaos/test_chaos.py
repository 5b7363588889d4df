"""The CI smoke run of the chaos harness: seeded faults against the whole service, then every invariant.

The long soak (30 minutes, 2,000 messages/s) is ``bench/bench_soak.py`` (``./dev bench soak``); it runs
the same harness.  Replay a failure with ``./dev bench soak --seed N``.
"""

from __future__ import annotations

import pytest

from tests.chaos.harness import ChaosRun, Plan, schedule


def test_the_schedule_is_fixed_by_the_seed_and_covers_every_kind():
    for tier in ("s3", "posix"):
        plan = Plan(seed=5, tier=tier, faults=20)
        faults = schedule(plan)
        assert faults == schedule(plan) and faults != schedule(Plan(seed=6, tier=tier, faults=20))
        assert {f.kind for f in faults} == set(plan.kinds())
        assert [f.at for f in faults] == sorted(f.at for f in faults)


@pytest.mark.heavy
@pytest.mark.timeout(1500)
def test_s3_tier_survives_20_seeded_faults(tmp_path):
    run = ChaosRun(Plan(seed=11, tier="s3", faults=20), tmp_path / "run")
    report = run.run()
    print(report.as_json())
    run.check()  # each fault kind had its effect, too (report.effects)
    assert sum(report.faults.values()) >= 20 and set(report.faults) == set(Plan(tier="s3").kinds())
    assert report.effects["s3_retried"] > 0 and report.effects["gc"] > 0
    assert report.tiered == report.produced and report.replicated == report.produced


@pytest.mark.heavy
@pytest.mark.timeout(1200)
def test_posix_tier_survives_a_full_disk_and_kills(tmp_path):
    run = ChaosRun(Plan(seed=12, tier="posix", faults=10), tmp_path / "run")
    report = run.run()
    print(report.as_json())
    run.check()
    assert report.effects["disk_full"] > 0 and report.effects["gc"] > 0 and report.tiered == report.produced

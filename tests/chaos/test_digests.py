"""The chaos harness checks itself: its hashed oracle is the plain one, and its comparison catches each fault."""

from __future__ import annotations

import zlib
from array import array

import pytest

from tests.chaos import digests
from tests.chaos.harness import ChaosRun, Plan
from tests.kafka_helpers import kafka_conf, mirror_oracle
from tests.oracle import latest_per_key, replay
from tests.tiering_helpers import make_conf, produce


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    root = tmp_path_factory.mktemp("digests")
    conf = kafka_conf(make_conf(root, str(root / "tier")), "127.0.0.1:1", "digests")  # never connected to
    produce(conf, 3000, topics=2, queues=5)
    return conf, digests.expected(conf.commitlog.dir, conf.kafka)


def test_the_hashed_oracle_is_the_plain_replay(log):
    conf, want = log
    rows = replay(conf.commitlog.dir)
    assert list(want.log.phy) == [r["phy_offset"] for r in rows]
    assert list(want.log.digest) == [digests.row_digest(r) for r in rows]
    assert want.end == rows[-1]["phy_offset"] + rows[-1]["size"]
    mirror = mirror_oracle(conf)
    assert set(want.mirror) == set(mirror)
    for part, records in mirror.items():
        assert list(want.mirror[part].phy) == [int(dict(h)["tierlog.phy"]) for _k, _v, h in records]
        assert list(want.mirror[part].digest) == [digests.record_digest(*r) for r in records]
    latest = latest_per_key(conf.commitlog.dir, with_tombstones=True)
    assert {k: (v.phy, v.deleted, v.body) for k, v in want.latest.items()} == \
        {k: (v["phy_offset"], v["deleted"], zlib.crc32(v["body"])) for k, v in latest.items()}
    assert any(v.deleted for v in want.latest.values())


def test_a_changed_field_changes_the_digest(log):
    conf, _want = log
    row = replay(conf.commitlog.dir)[0]
    for field, value in (("body", row["body"] + b"x"), ("store_ts", row["store_ts"] + 1),
                         ("properties", {**row["properties"], "X": "1"}), ("queue_offset", row["queue_offset"] + 1)):
        assert digests.row_digest({**row, field: value}) != digests.row_digest(row), field
    assert digests.row_digest(dict(reversed(list(row.items())))) == digests.row_digest(row)


def _variant(want: digests.Positions, change) -> digests.Positions:
    phy, digest = list(want.phy), list(want.digest)
    change(phy, digest)
    return digests.Positions(array("q", phy), array("I", digest))


@pytest.mark.parametrize("fault, lost, duplicates, says", [
    (lambda p, d: (p.pop(7), d.pop(7)), 1, 0, "missing ["),
    (lambda p, d: (p.insert(9, p[8]), d.insert(9, d[8])), 0, 1, "1 twice"),
    (lambda p, d: (p.__setitem__(slice(3, 5), p[4:2:-1]), d.__setitem__(slice(3, 5), d[4:2:-1])), 0, 0, "expected"),
    (lambda p, d: d.__setitem__(5, d[5] ^ 1), 0, 0, "1 messages differ"),
    (lambda p, d: (p.append(p[-1] + 1), d.append(0)), 0, 0, "extra ["),
])
def test_the_comparison_reports_each_fault(log, tmp_path, fault, lost, duplicates, says):
    _conf, want = log
    run = ChaosRun(Plan(seed=1, tier="posix"), tmp_path)
    run._compare("tier", _variant(want.log, fault), want.log)
    assert (run.report.lost, run.report.duplicates) == (lost, duplicates)
    assert len(run.report.problems) == 1 and says in run.report.problems[0], run.report.problems
    clean = ChaosRun(Plan(seed=1, tier="posix"), tmp_path)
    clean._compare("tier", want.log, want.log)
    assert clean.report.problems == [] and clean.report.lost == clean.report.duplicates == 0

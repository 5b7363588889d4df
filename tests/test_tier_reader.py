"""TierReader queries (get, offset_for_time, queue listing) against a plain replay, on posix and S3."""

from __future__ import annotations

import random

import pytest

from connectors.commitlog.format import Message
from connectors.tier.reader import GetStatus, TierReader
from streaming.service import Service
from tests.kv_helpers import append
from tests.oracle import normalize_arrow_row, replay
from tests.tiering_helpers import make_conf

BASE_TS = 1_700_000_000_000


def timed_messages(n: int, seed: int, start_ts: int):
    """Store times that mostly grow, with repeats and a few steps back (clocks are not monotonic)."""
    rng = random.Random(seed)
    ts = start_ts
    for i in range(n):
        ts += rng.choice([0, 0, 5, 10, 250]) if rng.random() > 0.03 else -40
        yield Message(topic=f"t{i % 2}", queue_id=rng.randrange(3), body=b"m%d" % i,
                      properties={"KEYS": f"k{i % 50}"}, store_ts=ts)


@pytest.fixture(scope="module")
def tier(spark, tmp_path_factory, s3_endpoint):
    """One tier per backend, holding both sealed segments and staging objects."""
    out = {}
    for backend in ("posix", "s3"):
        root = tmp_path_factory.mktemp(f"reader-{backend}")
        if backend == "posix":
            location = str(root / "tier")
        else:
            import boto3

            bucket = f"tierlog-reader-{random.randrange(10**9)}"
            boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
            location = f"s3://{bucket}/tier"
        conf = make_conf(root, location, segment_messages=120)
        append(conf, timed_messages(1500, seed=1, start_ts=BASE_TS))
        assert Service(conf).run(until_caught_up=True, spark=spark) == 0  # sealed into segments
        append(conf, timed_messages(150, seed=2, start_ts=BASE_TS + 10**6))
        assert Service(conf).run(until_caught_up=True, spark=spark) == 0  # too few to seal: staging
        out[backend] = conf
    return out


def oracle_queues(conf) -> dict:
    queues: dict = {}
    for row in replay(conf.commitlog.dir):
        queues.setdefault((row["topic"], row["queue_id"]), []).append(row)
    return queues


@pytest.mark.parametrize("backend", ["posix", "s3"])
def test_get_returns_committed_messages_in_order_and_clear_statuses(tier, backend):
    conf = tier[backend]
    reader = TierReader(conf.tier.location)
    state = reader.state()
    assert state.segments and state.staging  # both kinds of object are read
    for (topic, queue), rows in oracle_queues(conf).items():
        for offset, limit in ((0, 7), (115, 30), (len(rows) - 3, 32), (len(rows) // 2, 1000)):
            result = reader.get(topic, queue, offset, limit, state)
            assert result.status is GetStatus.FOUND
            got = [normalize_arrow_row(r) for r in result.messages.to_pylist()]
            assert got == rows[offset : offset + limit]
            assert result.next_offset == min(len(rows), offset + limit)
        commit = len(rows)
        assert reader.get(topic, queue, commit, 5, state).status is GetStatus.OFFSET_OVERFLOW_ONE
        badly = reader.get(topic, queue, commit + 10, 5, state)
        assert badly.status is GetStatus.OFFSET_OVERFLOW_BADLY and badly.next_offset == commit
    assert reader.get("nope", 0, 0, 5, state).status is GetStatus.NO_QUEUE


@pytest.mark.parametrize("backend", ["posix", "s3"])
def test_offset_for_time_matches_a_brute_force_search(tier, backend):
    conf = tier[backend]
    reader = TierReader(conf.tier.location)
    state = reader.state()
    rng = random.Random(3)
    for (topic, queue), rows in oracle_queues(conf).items():
        times = [r["store_ts"] for r in rows]
        probes = [times[0] - 1, times[-1] + 1, *rng.sample(times, 15), *(t + 3 for t in rng.sample(times, 10))]
        for ts in probes:
            lower = next((r["queue_offset"] for r in rows if r["store_ts"] >= ts), len(rows))
            upper = max((r["queue_offset"] for r in rows if r["store_ts"] <= ts), default=0)
            assert reader.offset_for_time(topic, queue, ts, "lower", state) == lower, (topic, queue, ts)
            assert reader.offset_for_time(topic, queue, ts, "upper", state) == upper, (topic, queue, ts)


def test_queue_listing(tier):
    conf = tier["posix"]
    infos = {(i.topic, i.queue_id): i for i in TierReader(conf.tier.location).queue_infos()}
    expected = oracle_queues(conf)
    assert set(infos) == set(expected)
    for key, rows in expected.items():
        info = infos[key]
        assert (info.low, info.commit) == (0, len(rows))
        assert 0 < info.sealed < info.commit and info.segments >= 1 and info.bytes > 0


def test_get_offset_for_time_and_queues_from_the_command_line(tier):
    import base64
    import json

    from tests.cli_runner import tierlog

    conf = tier["posix"]
    location = conf.tier.location
    rows = oracle_queues(conf)[("t1", 2)]
    r = tierlog("get", "t1", "2", "100", "--max", "5", "--format", "json", "--tier", location)
    assert r.returncode == 0, r.stderr
    got = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(g["queue_offset"], base64.b64decode(g["body"]), g["store_ts"]) for g in got] == [
        (m["queue_offset"], m["body"], m["store_ts"]) for m in rows[100:105]]
    past = tierlog("get", "t1", "2", str(len(rows) + 5), "--tier", location)
    assert past.returncode == 1 and f"commit offset {len(rows)}" in past.stderr
    assert tierlog("get", "t1", "2", str(len(rows)), "--tier", location).returncode == 0  # caught up
    assert "no queue" in tierlog("get", "t9", "0", "0", "--tier", location).stderr

    ts = rows[200]["store_ts"]
    r = tierlog("offset-for-time", "t1", "2", str(ts), "--format", "json", "--tier", location)
    expected = next(m["queue_offset"] for m in rows if m["store_ts"] >= ts)
    assert json.loads(r.stdout)["offset"] == expected
    iso = tierlog("offset-for-time", "t1", "2", "2023-11-14T22:13:20.000+00:00", "--format", "json", "--tier", location)
    assert json.loads(iso.stdout)["offset"] == next(m["queue_offset"] for m in rows if m["store_ts"] >= BASE_TS)

    listed = [json.loads(line) for line in tierlog("queues", "--format", "json", "--tier", location).stdout.splitlines()]
    assert {(q["topic"], q["queue_id"], q["commit"]) for q in listed} == {
        (t, q, len(v)) for (t, q), v in oracle_queues(conf).items()}

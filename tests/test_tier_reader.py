"""TierReader queries (get, offset_for_time, queue listing) against the writers' ledger, on posix and S3."""

from __future__ import annotations

import os
import random
import time

import pytest

from connectors.commitlog.format import Message
from connectors.tier.log import TierLog
from connectors.tier.reader import GetStatus, TierReader
from streaming.service import Service
from tests.kv_helpers import append
from tests.oracle import normalize_arrow_row, written_rows
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
    for row in written_rows(conf.commitlog.dir):
        queues.setdefault((row["topic"], row["queue_id"]), []).append(row)
    assert len(queues) > 1 and sum(map(len, queues.values())) > 100, "the tests below need a log to compare with"
    return queues


@pytest.mark.parametrize("backend", ["posix", "s3"])
def test_get_returns_committed_messages_in_order_and_clear_statuses(tier, backend):
    conf = tier[backend]
    reader = TierReader(conf.tier.location)
    state = reader.committed()
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
def test_messages_at_scattered_positions_equal_the_oracle(tier, backend):
    """Positions in any order, repeated, across sealed segments and staging objects and several
    queues, with a few the tier does not hold: each row is the ledger's message at that position,
    and a missing one is a null row."""
    from connectors.tier.location import open_backend

    conf = tier[backend]
    queues = oracle_queues(conf)
    rng = random.Random(5)
    positions = [(t, q, rng.randrange(len(rows))) for (t, q), rows in queues.items() for _ in range(40)]
    positions += positions[:7] + [("t0", 0, 10**6), ("nope", 1, 0), ("t1", 99, 3)]
    rng.shuffle(positions)
    counting = CountingBackend(open_backend(conf.tier.location))
    got = TierReader(counting).messages_at(*zip(*positions), ["phy_offset", "body", "queue_offset"])
    assert got.column_names == ["phy_offset", "body", "queue_offset"]
    for (t, q, o), row in zip(positions, got.to_pylist()):
        if (t, q) not in queues or o >= len(queues[(t, q)]):
            assert row == {"phy_offset": None, "body": None, "queue_offset": None}
            continue
        expected = queues[(t, q)][o]
        assert (row["phy_offset"], row["body"], row["queue_offset"]) == (expected["phy_offset"], expected["body"], o)
    # Each object holding a position is read once, not once per position.
    objects = [n for n in counting.read_names if not n.startswith(("_log/", "_meta/"))]
    assert any(n.startswith("_staging/") for n in objects) and any(n.startswith("topic=") for n in objects)
    assert len(objects) == len(set(objects)), objects
    assert TierReader(conf.tier.location).messages_at([], [], [], ["body"]).num_rows == 0


@pytest.mark.parametrize("backend", ["posix", "s3"])
def test_offset_for_time_matches_a_brute_force_search(tier, backend):
    conf = tier[backend]
    reader = TierReader(conf.tier.location)
    state = reader.committed()
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
    assert "no topic 't9' in the tier" in tierlog("get", "t9", "0", "0", "--tier", location).stderr  # and its topics

    ts = rows[200]["store_ts"]
    r = tierlog("offset-for-time", "t1", "2", str(ts), "--format", "json", "--tier", location)
    expected = next(m["queue_offset"] for m in rows if m["store_ts"] >= ts)
    assert json.loads(r.stdout)["offset"] == expected
    iso = tierlog("offset-for-time", "t1", "2", "2023-11-14T22:13:20.000+00:00", "--format", "json", "--tier", location)
    assert json.loads(iso.stdout)["offset"] == next(m["queue_offset"] for m in rows if m["store_ts"] >= BASE_TS)

    listed = [json.loads(line) for line in tierlog("queues", "--format", "json", "--tier", location).stdout.splitlines()]
    assert {(q["topic"], q["queue_id"], q["commit"]) for q in listed} == {
        (t, q, len(v)) for (t, q), v in oracle_queues(conf).items()}


class CountingBackend:
    """The real backend, counting which objects are read (to prove the key index is used)."""

    def __init__(self, backend):
        self.backend, self.read_names = backend, []

    def read(self, name, start=0, length=None):
        self.read_names.append(name)
        return self.backend.read(name, start, length)

    def open_input(self, name, size=None):
        self.read_names.append(name)
        return self.backend.open_input(name, size)

    def __getattr__(self, attr):
        return getattr(self.backend, attr)


@pytest.mark.parametrize("backend", ["posix", "s3"])
def test_by_key_matches_the_ledger_and_opens_only_segments_holding_the_key(tier, backend):
    from connectors.tier.location import open_backend

    conf = tier[backend]
    reader = TierReader(conf.tier.location)
    state = reader.committed()
    rows = written_rows(conf.commitlog.dir)
    rng = random.Random(4)
    for topic, key in [("t0", "k0"), ("t1", "k1"), ("t0", "k48"), ("t1", "k49")]:
        mine = [r for r in rows if r["topic"] == topic and r["key"] == key]
        assert mine
        windows = [(None, None), (mine[len(mine) // 3]["store_ts"], None), (None, mine[-5]["store_ts"]),
                   tuple(sorted(rng.sample([r["store_ts"] for r in mine], 2)))]
        for begin, end in windows:
            expected = [r for r in mine if (begin is None or r["store_ts"] >= begin)
                        and (end is None or r["store_ts"] <= end)]
            got = [normalize_arrow_row(r) for r in reader.by_key(topic, key, begin, end, state).to_pylist()]
            assert got == expected, (topic, key, begin, end)
    # A key in no segment: only key indexes (and staging objects) are read, never a segment.
    counting = CountingBackend(open_backend(conf.tier.location))
    assert TierReader(counting).by_key("t0", "k1", committed=state).num_rows == 0  # k1 is only ever on t1
    segment_names = {s.name for s in state.segments.values()}
    assert not segment_names & set(counting.read_names)
    assert {s.keys for s in state.segments.values() if s.topic == "t0"} <= set(counting.read_names)


def test_key_from_the_command_line(tier):
    import json

    from tests.cli_runner import tierlog

    conf = tier["posix"]
    expected = [r for r in written_rows(conf.commitlog.dir) if r["topic"] == "t1" and r["key"] == "k7"]
    since = expected[3]["store_ts"]
    r = tierlog("key", "t1", "k7", "--since", str(since), "--format", "json", "--tier", conf.tier.location)
    assert r.returncode == 0, r.stderr
    got = [json.loads(line) for line in r.stdout.splitlines()]
    assert [g["phy_offset"] for g in got] == [m["phy_offset"] for m in expected if m["store_ts"] >= since]


def _rows(table) -> list[dict]:
    return sorted((normalize_arrow_row(r) for r in table.to_pylist()), key=lambda r: r["phy_offset"])


@pytest.mark.parametrize("backend", ["posix", "s3"])
def test_spark_tier_source_duckdb_and_tier_reader_agree(spark, tier, backend):
    conf = tier[backend]
    location = conf.tier.location
    reader = TierReader(location)
    state = reader.committed()
    expected = written_rows(conf.commitlog.dir)
    from_spark = _rows(spark.read.format("tier").load(location).toArrow())
    assert from_spark == _rows(reader.read_all(state)) == expected
    sealed = [r for r in expected if r["queue_offset"] < state.queues[(r["topic"], r["queue_id"])].sealed]
    assert len(sealed) < len(expected)  # staging holds the rest: both kinds of object were read
    con = duckdb_connection()  # held: a relation does not keep its connection open
    segments = con.sql(f"select * from read_parquet('{location}/topic=*/broker=*/queue=*/*.parquet', "
                       "hive_partitioning=false)").arrow()
    segments = segments.read_all() if hasattr(segments, "read_all") else segments  # a reader in DuckDB >= 1.4
    assert _rows(segments) == sealed


def duckdb_extensions() -> str:
    """Where the ``duckdb-ext-*`` pip packages put DuckDB's extensions (nothing is downloaded)."""
    import importlib.util

    return os.path.join(importlib.util.find_spec("duckdb_ext").submodule_search_locations[0], "extensions")


def duckdb_connection():
    """DuckDB as a user on S3 would set it up: the httpfs extension from its pip package
    (``duckdb-ext-httpfs``, nothing downloaded) and an S3 secret for the endpoint."""
    from urllib.parse import urlparse

    import duckdb

    con = duckdb.connect(config={"extension_directory": duckdb_extensions(), "autoinstall_known_extensions": False})
    con.sql("LOAD httpfs")
    endpoint = urlparse(os.environ["AWS_ENDPOINT_URL_S3"])
    con.sql(f"""CREATE SECRET tier (TYPE s3, KEY_ID '{os.environ["AWS_ACCESS_KEY_ID"]}',
                SECRET '{os.environ["AWS_SECRET_ACCESS_KEY"]}', REGION '{os.environ["AWS_REGION"]}',
                ENDPOINT '{endpoint.netloc}', URL_STYLE 'path', USE_SSL {str(endpoint.scheme == "https").lower()})""")
    return con


def test_spark_tier_source_prunes_by_topic_queue_offset_and_time(spark, tier):
    conf = tier["posix"]
    location = conf.tier.location
    df = spark.read.format("tier").load(location)
    rows = oracle_queues(conf)[("t1", 2)]
    picked = df.where("topic = 't1' and queue_id = 2 and queue_offset >= 100 and queue_offset < 130")
    assert _rows(picked.toArrow()) == rows[100:130]
    from pyspark.sql.datasource import EqualTo, GreaterThanOrEqual, LessThan

    from streaming.sources.tier import TierBatchReader

    pruned = TierBatchReader(location)
    list(pruned.pushFilters([EqualTo(("topic",), "t1"), EqualTo(("queue_id",), 2),
                             GreaterThanOrEqual(("queue_offset",), 100), LessThan(("queue_offset",), 130)]))
    opened = pruned.partitions()
    assert 0 < len(opened) < len(TierBatchReader(location).partitions())  # fewer objects opened
    assert all(r[:2] == ("t1", 2) and r[2] <= 100 and r[3] >= 130 for p in opened for r in p.ranges)
    since = rows[200]["store_ts"]
    late = df.where(f"topic = 't1' and queue_id in (2) and store_ts >= timestamp_millis({since})")
    assert _rows(late.toArrow()) == [r for r in rows if r["store_ts"] >= since]
    everything = written_rows(conf.commitlog.dir)
    assert _rows(df.where("queue_id in (0, 1)").toArrow()) == [r for r in everything if r["queue_id"] in (0, 1)]
    assert df.where("topic = 'nope'").count() == 0


def test_read_ahead_cache_serves_lagging_groups_and_stays_bounded(tier):
    from connectors.tier.cache import ReadAheadCache

    conf = tier["posix"]
    rows = oracle_queues(conf)[("t1", 2)]
    cache = ReadAheadCache(TierReader(conf.tier.location), max_bytes=8 << 20)
    positions = {"a": 0, "b": 0, "c": 0, "d": 0}
    lag = {"a": 0, "b": 2, "c": 5, "d": 9}  # steps behind "a"
    for step in range(60):
        for group, behind in lag.items():
            if step < behind:
                continue
            result = cache.get(group, "t1", 2, positions[group], 8)
            if result.status is GetStatus.OFFSET_OVERFLOW_ONE:
                continue
            assert [normalize_arrow_row(r) for r in result.messages.to_pylist()] == \
                rows[positions[group]:positions[group] + 8]
            positions[group] = result.next_offset
    assert all(p == len(rows) for p in positions.values())
    assert cache.stats.hit_ratio > 0.7, cache.stats  # the window grew: one read serves many gets
    assert cache.stats.bytes <= 8 << 20


def test_read_ahead_cache_drops_what_no_group_will_reach_in_time(tier):
    from connectors.tier.cache import ReadAheadCache

    conf = tier["posix"]
    cache = ReadAheadCache(TierReader(conf.tier.location), ttl_s=0.0)  # nothing is worth keeping
    offset = 0
    while (result := cache.get("fast", "t1", 2, offset, 16)).status is GetStatus.FOUND:
        offset = result.next_offset
    assert cache.stats.dropped_early > 0 and cache.stats.bytes < 64 << 10
    bounded = ReadAheadCache(TierReader(conf.tier.location), max_bytes=1, ttl_s=3600)
    for queue in range(3):
        bounded.get("g", "t0", queue, 0, 50)
    assert bounded.stats.evicted_lru >= 2 and len(bounded._windows) == 1


def test_every_query_equals_the_oracle_while_batches_commit_and_seals_run(spark, tmp_path, tier_location, monkeypatch):
    """get, offset_for_time, by_key and a cached consumer, called over and over while the service
    commits small batches and seals segments, each compared with the ledger as of the state it read.

    After each commit and seal record the service writes, it waits until the reader has read the
    state that record made: so the reads cover every state the tier went through, however the two
    threads are scheduled."""
    import dataclasses
    import threading

    from connectors.tier.cache import ReadAheadCache

    conf = make_conf(tmp_path, tier_location, segment_messages=70, delete_grace_s=30.0)
    conf = dataclasses.replace(conf, source=dataclasses.replace(conf.source, max_bytes_per_trigger=25_000))
    append(conf, timed_messages(2400, seed=5, start_ts=BASE_TS))
    queues = oracle_queues(conf)
    # seen["seqs"]: the seq of each state the reader read, with its segment count
    stop, problems, seen = threading.Event(), [], {"calls": 0, "seqs": {}}
    written: set[int] = set()  # the seq of each state a commit or seal record made

    def check(what, got, expected):
        seen["calls"] += 1
        if got != expected:
            problems.append((what, got if len(str(got)) < 300 else "...", expected if len(str(expected)) < 300 else "..."))

    def one_round(reader, cache, positions, rng):
        state = reader.committed()
        if not state.queues:
            return
        seen["seqs"][state.seq] = len(state.segments)
        (topic, queue), q = rng.choice(sorted(state.queues.items()))
        rows = queues[(topic, queue)][q.low : q.commit]
        offset = rng.randrange(q.low, q.commit)
        got = reader.get(topic, queue, offset, 40, state).messages.to_pylist()
        check(("get", topic, queue, offset), [normalize_arrow_row(r) for r in got], rows[offset - q.low :][:40])
        ts = rng.choice(rows)["store_ts"] + rng.choice([-1, 0, 1])
        lower = next((r["queue_offset"] for r in rows if r["store_ts"] >= ts), q.commit)
        upper = max((r["queue_offset"] for r in rows if r["store_ts"] <= ts), default=q.low)
        check(("lower", topic, queue, ts), reader.offset_for_time(topic, queue, ts, "lower", state), lower)
        check(("upper", topic, queue, ts), reader.offset_for_time(topic, queue, ts, "upper", state), upper)
        key = f"k{rng.randrange(50)}"
        committed = [r for (t, qid), rs in queues.items() if t == topic and (t, qid) in state.queues
                     for r in rs[state.queues[(t, qid)].low : state.queues[(t, qid)].commit] if r["key"] == key]
        got = [normalize_arrow_row(r) for r in reader.by_key(topic, key, committed=state).to_pylist()]
        check(("by_key", topic, key), got, sorted(committed, key=lambda r: r["phy_offset"]))
        at = positions.get((topic, queue), 0)
        result = cache.get("follower", topic, queue, at, 25)
        if result.status is GetStatus.FOUND:
            expected = queues[(topic, queue)][at : result.next_offset]
            check(("cache", topic, queue, at), [normalize_arrow_row(r) for r in result.messages.to_pylist()], expected)
            positions[(topic, queue)] = result.next_offset

    def query_loop():
        reader = TierReader(tier_location)
        cache, positions, rng = ReadAheadCache(reader, refresh_s=0.2), {}, random.Random(7)
        while not stop.is_set():
            try:
                one_round(reader, cache, positions, rng)
            except Exception as exc:  # noqa: BLE001 - a failed read is a finding, not a crash of the thread
                problems.append(("raised", repr(exc)))

    log_append = TierLog.append

    def append_then_wait_for_the_reader(log, head, record):
        seq = log_append(log, head, record)
        written.add(seq)
        deadline = time.monotonic() + 60
        while seq not in seen["seqs"] and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        return seq

    monkeypatch.setattr(TierLog, "append", append_then_wait_for_the_reader)
    thread = threading.Thread(target=query_loop)
    thread.start()
    try:
        service = Service(conf)
        assert service.run(until_caught_up=True, spark=spark) == 0
    finally:
        stop.set()
        thread.join()
    assert not problems, problems[:5]
    assert written <= seen["seqs"].keys(), f"states the reader never read: {sorted(written - seen['seqs'].keys())}"
    # The workload makes many commits and seals in several batches: the reads spanned them all.
    segment_counts = {seen["seqs"][seq] for seq in written}
    assert service.batches["tiering"] >= 8 and len(segment_counts) >= 3 and seen["calls"] > 40, segment_counts


def readme_python_blocks(*needles: str) -> list[str]:
    """The ```python blocks of docs/reading.md (the reference of the tier's readers, written for a
    tier of topic `orders`; the README's own blocks read the demo's, tests/test_docs.py) that
    contain every one of ``needles``."""
    from tests.cli_runner import ROOT

    text = (ROOT / "docs" / "reading.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    found = [b for b in blocks if all(n in b for n in needles)]
    assert found, f"no docs/reading.md python block holds {needles}"
    return found


def test_readme_tier_examples_run_against_a_real_tier(spark, tmp_path):
    location = str(tmp_path / "tier")
    conf = make_conf(tmp_path, location, segment_messages=500)
    base = 1763712000000 - 3000  # the README's offset_for_time asks for 1763712000000
    append(conf, (Message(topic="orders" if i % 5 else "payments", queue_id=i % 4, body=b"o%d" % i,
                          properties={"KEYS": f"order-{i % 97}"}, store_ts=base + i) for i in range(7000)))
    assert Service(conf).run(until_caught_up=True, spark=spark) == 0
    state = TierReader(location).committed()
    rows = written_rows(conf.commitlog.dir)
    sealed = [r for r in rows if r["queue_offset"] < state.queues[(r["topic"], r["queue_id"])].sealed]
    assert state.staging and len(sealed) > 3000  # both kinds of object

    def here(block: str) -> str:  # the docs read the demo's tier: this test's tier, topic and key instead
        return block.replace("data/demo/tier", location).replace("topic-0", "orders").replace("key-00000042", "order-42")

    [tables] = readme_python_blocks("import duckdb", "pyarrow.dataset")
    ns = {"spark": spark}
    exec(here(tables), ns)
    per_queue: dict = {}
    for r in sealed:
        per_queue[(r["topic"], r["queue_id"])] = per_queue.get((r["topic"], r["queue_id"]), 0) + 1
    assert ns["counts"] == sorted((t, "broker-a", q, n) for (t, q), n in per_queue.items())  # one broker, the default
    assert sorted(ns["segments"]["phy_offset"].to_pylist()) == [r["phy_offset"] for r in sealed]
    assert ns["sealed"].count() == len(sealed)
    assert _rows(ns["topic0"].toArrow()) == [r for r in rows if r["topic"] == "orders" and r["queue_offset"] >= 1000]

    [queries] = readme_python_blocks("TierReader(", "offset_for_time")
    exec(here(queries), ns)
    queue3 = [r for r in rows if (r["topic"], r["queue_id"]) == ("orders", 3)]
    assert [normalize_arrow_row(r) for r in ns["result"].messages.to_pylist()] == queue3[1000:1100]
    assert ns["start"] == next(r["queue_offset"] for r in queue3 if r["store_ts"] >= 1763712000000)
    assert _rows(ns["history"]) == [r for r in rows if r["topic"] == "orders" and r["key"] == "order-42"]

    [asof] = readme_python_blocks("AsOfReader(")
    exec(here(asof), ns)
    last = [r for r in rows if r["topic"] == "orders" and r["key"] == "order-42"][-1]  # every message a put
    assert (ns["answer"].state, ns["answer"].value, ns["answer"].change["phy_offset"]) == (
        "live", last["body"], last["phy_offset"])

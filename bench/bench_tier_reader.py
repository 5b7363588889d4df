"""Tier query benchmark (issue 6): reading a tier of 10M messages, printing JSON.

    python -m bench.bench_tier_reader [--messages 10000000] [--root DIR] [--keep]

The tier is built once by the real service (`tierlog run`'s tiering query,
until caught up) from a synthetic commitlog, then kept under ``--root`` so
later runs reuse it.  Everything below reads the tier from its location
alone, as a downstream user would; files are in the page cache (run twice
and the first pass warms them).

sequential   msgs/s reading every queue from its lowest offset to its commit
             offset, three ways: ``TierReader.get`` pulls of 64k messages, a
             consumer pulling 1,024 at a time through the read-ahead cache, and
             ``read_all``.  Baseline: pyarrow reading the same Parquet files
             (the committed segments and staging objects) raw, every column,
             ``pq.read_table``.  Target: >= 50% of raw.
offset_for_time
             p50/p99 of ``offset_for_time`` at random times of random queues,
             lower and upper, each reading the committed state afresh (as the
             CLI does) and with a state already read.  Checked against a brute
             force over the queue.  Target: p99 <= 20 ms.
by_key       p50/p99 of ``by_key`` for random keys over all time, state read
             afresh.  Checked against a filter of the whole topic for some.
             Target: p99 <= 200 ms.
cache        4 consumers of the longest queue, lagging 0, 1%, 10% and 40% of it,
             pulling 32 at a time in turns through one ``ReadAheadCache``: hit
             ratio, windows dropped early and by the memory bound, and msgs/s
             against the same pulls without the cache (100 rounds of them:
             each uncached pull decodes a whole row group).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import time

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from bench.bench_tiering import make_conf, produce, run_service
from bench.common import report
from connectors.commitlog.arrow import epoch_ms_array
from connectors.tier.cache import ReadAheadCache
from connectors.tier.reader import TierReader


def build(root: str, messages: int, topics: int, queues: int, keys: int, body: int, segment: int) -> dict:
    """Produce ``messages`` and tier them with the service, unless ``root`` already holds that tier."""
    marker = os.path.join(root, "built")
    conf = make_conf(root, tier={"segment_messages": segment, "fold_every": 50},
                     source={"max_bytes_per_trigger": 256 << 20})
    if os.path.exists(marker):
        return {"reused": True, "location": conf.tier.location}
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    t = time.perf_counter()
    produce(conf, messages, queues, body, topics, keys=keys, seed=6)
    produced = time.perf_counter() - t
    t = time.perf_counter()
    run_service(conf)
    tiered = time.perf_counter() - t
    open(marker, "w").close()
    return {"reused": False, "location": conf.tier.location, "produce_s": round(produced, 1),
            "tier_s": round(tiered, 1)}


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def summary_ms(seconds: list[float]) -> dict:
    ms = [s * 1000 for s in seconds]
    return {"p50_ms": round(pct(ms, 50), 2), "p99_ms": round(pct(ms, 99), 2), "max_ms": round(max(ms), 2),
            "calls": len(ms)}


def best_of(fn, repeat: int = 2) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t)
    return best, result


# ---------------------------------------------------------------- sequential


def sequential(reader: TierReader) -> dict:
    state = reader.committed()
    root = reader.backend.root
    files = [os.path.join(root, o.name) for o in [*state.segments.values(), *state.staging.values()]]
    committed = sum(q.commit - q.low for q in state.queues.values())

    def raw() -> int:
        return sum(pq.read_table(f).num_rows for f in files)

    def consume(get, max_messages: int) -> int:
        n = 0
        for (t, q), qs in sorted(state.queues.items()):
            offset = qs.low
            while offset < qs.commit:
                got = get(t, q, offset, max_messages)
                n += got.messages.num_rows
                offset = got.next_offset
        return n

    def cached(max_messages: int) -> int:
        cache = ReadAheadCache(reader, max_bytes=512 << 20)
        return consume(lambda t, q, o, n: cache.get("g", t, q, o, n), max_messages)

    raw_s, raw_rows = best_of(raw)
    out = {"segments": len(state.segments), "staging_objects": len(state.staging),
           "bytes": sum(os.path.getsize(f) for f in files), "committed_messages": committed,
           "raw_pyarrow": rate(raw_rows, raw_s)}
    for name, fn in (("get_64k", lambda: consume(lambda t, q, o, n: reader.get(t, q, o, n, state), 65536)),
                     ("cache_1024", lambda: cached(1024)),
                     ("read_all", lambda: reader.read_all(state).num_rows)):
        seconds, rows = best_of(fn)
        assert rows == committed, (name, rows, committed)
        out[name] = rate(rows, seconds)
        out[name]["vs_raw"] = round(out[name]["msgs_per_s"] / out["raw_pyarrow"]["msgs_per_s"], 2)
    return out


def rate(rows: int, seconds: float) -> dict:
    return {"rows": rows, "seconds": round(seconds, 3), "msgs_per_s": round(rows / seconds)}


# ---------------------------------------------------------------- point queries


def offset_for_time(reader: TierReader, calls: int, rng: random.Random) -> dict:
    state = reader.committed()
    queues = sorted(state.queues)
    truth: dict = {}

    def times_of(key):
        if key not in truth:
            table = reader.read_queue(*key, state)
            truth[key] = (table["queue_offset"].to_numpy(), epoch_ms_array(table["store_ts"]).to_numpy())
        return truth[key]

    fresh, warm = [], []
    for i in range(calls):
        key = rng.choice(queues)
        offsets, ts = times_of(key)
        at = int(rng.randint(int(ts.min()) - 5, int(ts.max()) + 5))
        boundary = "lower" if i % 2 == 0 else "upper"
        t = time.perf_counter()
        got = reader.offset_for_time(*key, at, boundary)
        fresh.append(time.perf_counter() - t)
        t = time.perf_counter()
        again = reader.offset_for_time(*key, at, boundary, state)
        warm.append(time.perf_counter() - t)
        hits = offsets[ts >= at] if boundary == "lower" else offsets[ts <= at]
        expected = (int(hits.min()) if len(hits) else state.queues[key].commit) if boundary == "lower" else \
            (int(hits.max()) if len(hits) else state.queues[key].low)
        assert got == again == expected, (key, at, boundary, got, again, expected)
    return {"state_read_afresh": summary_ms(fresh), "state_given": summary_ms(warm)}


def by_key(reader: TierReader, calls: int, keys: int, rng: random.Random) -> dict:
    state = reader.committed()
    topics = sorted({t for t, _ in state.queues})
    checked, seconds, rows = 0, [], 0
    whole: dict = {}
    for i in range(calls):
        topic = rng.choice(topics)
        key = f"key-{rng.randrange(keys):08d}"
        t = time.perf_counter()
        got = reader.by_key(topic, key)
        seconds.append(time.perf_counter() - t)
        rows += got.num_rows
        if i < 5:  # a brute-force check of a few
            if topic not in whole:
                whole[topic] = pa.concat_tables([reader.read_queue(t_, q, state) for t_, q in state.queues if t_ == topic])
            table = whole[topic]
            expected = table.filter(pc.equal(table["key"], key)).sort_by("phy_offset")
            assert got["phy_offset"].to_pylist() == expected["phy_offset"].to_pylist(), (topic, key)
            checked += 1
    return {**summary_ms(seconds), "rows_found": rows, "checked_against_scan": checked}


# ---------------------------------------------------------------- cache


def cache_consumers(reader: TierReader, lag_shares: list[float], pull: int, max_bytes: int) -> dict:
    state = reader.committed()
    key = max(state.queues, key=lambda k: state.queues[k].commit - state.queues[k].low)
    q = state.queues[key]
    lags = [int(share * (q.commit - q.low)) for share in lag_shares]
    head = q.low + max(lags)

    def run(get, rounds: int | None = None) -> int:
        positions = [head - lag for lag in lags]
        n = 0
        while positions[0] < q.commit and (rounds is None or rounds > 0):
            rounds = None if rounds is None else rounds - 1
            for i, pos in enumerate(positions):
                if pos >= q.commit:
                    continue
                got = get(i, pos)
                n += got.messages.num_rows
                positions[i] = got.next_offset
        return n

    cache = ReadAheadCache(reader, max_bytes=max_bytes)
    t = time.perf_counter()
    cached_rows = run(lambda i, pos: cache.get(f"group-{i}", *key, pos, pull))
    cached_s = time.perf_counter() - t
    t = time.perf_counter()  # uncached, every pull decodes a row group: a sample of 100 rounds
    direct_rows = run(lambda i, pos: reader.get(*key, pos, pull, state), rounds=100)
    direct_s = time.perf_counter() - t
    s = cache.stats
    return {"queue": list(key), "lags": lags, "pull": pull, "max_bytes": max_bytes,
            "hits": s.hits, "misses": s.misses, "hit_ratio": round(s.hit_ratio, 4),
            "dropped_early": s.dropped_early, "evicted_lru": s.evicted_lru,
            "cached": rate(cached_rows, cached_s), "uncached": rate(direct_rows, direct_s),
            "speedup": round((cached_rows / cached_s) / (direct_rows / direct_s), 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=10_000_000)
    p.add_argument("--topics", type=int, default=4)
    p.add_argument("--queues", type=int, default=8, help="per topic")
    p.add_argument("--keys", type=int, default=1_000_000)
    p.add_argument("--body", type=int, default=100, help="body bytes")
    p.add_argument("--segment-messages", type=int, default=100_000)
    p.add_argument("--calls", type=int, default=1000, help="offset_for_time calls (by_key: a fifth)")
    p.add_argument("--root", help="where to build (and keep) the tier; default: a temporary directory")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    p.add_argument("--build-only", action="store_true", help="build the tier under --root and stop")
    args = p.parse_args()
    root = args.root or tempfile.mkdtemp(prefix="tierlog-bench-reader-")
    rng = random.Random(6)
    try:
        built = build(root, args.messages, args.topics, args.queues, args.keys, args.body, args.segment_messages)
        if args.build_only:
            report(built)
            return
        reader = TierReader(built["location"])
        result = {"benchmark": "tier_reader", "messages": args.messages, "body_bytes": args.body, "build": built}
        result["sequential"] = sequential(reader)
        result["offset_for_time"] = offset_for_time(reader, args.calls, rng)
        result["by_key"] = by_key(reader, max(10, args.calls // 5), args.keys, rng)
        result["cache"] = cache_consumers(reader, [0, 0.01, 0.1, 0.4], 32, 256 << 20)
        seq = result["sequential"]
        result["targets"] = {
            "sequential_vs_raw_ge_0.5": min(seq[k]["vs_raw"] for k in ("get_64k", "cache_1024", "read_all")) >= 0.5,
            "offset_for_time_p99_le_20ms": result["offset_for_time"]["state_read_afresh"]["p99_ms"] <= 20,
            "by_key_p99_le_200ms": result["by_key"]["p99_ms"] <= 200,
        }
        report(result)
    finally:
        if not args.root and not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

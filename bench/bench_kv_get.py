"""A KV view's point reads: values kept as references into the tier against values kept as copies.

    ./dev bench kv_get [--body 2000,16384] [--messages-mb 256] [--keys 20000] [--queries 300]
                       [--rounds 3] [--s3]

For each body size: one topic of 8 queues, keyed messages of JSON-like bodies over ``--keys`` keys
(about ``--messages-mb`` of them), tiered without Spark in 8 MB batches and sealed into segments of
32 MiB (so about two thirds of the latest values lie in sealed segments, the rest in staging
objects), all off the clock.  Two KV views of the same changes are built from the tier: one keeps
every value as a copy (``compaction.reference_min_bytes`` 0), the other every value as a reference
(``state.kv_refs``).

Each query is ``KVView.get`` of a random key of those written, on a view opened read-only as ``tierlog
kv get`` opens it (the referenced view reads the tier's root, the records after it, the queue's
bucket and manifest and one row group of the key's object; its reader made once, as a long-lived
process's is).  ``--rounds`` rounds, the two views alternating, the order reversed every other round;
per view the p50 and p99 of every query.  Targets (issue 49's bounds): p99 <= 5 ms for a copy and
<= 50 ms for a reference on posix.  ``--s3``: the tier on moto's S3 server on loopback, in this
process (every object read an HTTP GET); stated, no target.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time

import numpy as np

from bench.bench_asof import s3_tier
from bench.common import percentiles, report
from connectors.commitlog.format import Message
from connectors.commitlog.writer import CommitLogWriter


def body_of(rng: random.Random, size: int, i: int) -> bytes:
    """A JSON-like body of about ``size`` bytes: compressible, as most business messages are."""
    items = []
    while sum(map(len, items)) < size:
        items.append(json.dumps({"sku": rng.randrange(10**6), "qty": rng.randrange(9), "note": f"item {i}"}))
    return ("[" + ",".join(items) + "]").encode()[:size]


def build(root: str, location: str, body: int, messages: int, keys: int) -> dict:
    """The log, the tier and the two views; returns what was built."""
    from connectors.changes import CHANGE_ROW
    from connectors.tier.reader import TierReader
    from state.kv import KVView
    from state.metadata import MetadataStore
    from state.replay import keyed_rows
    from tests.tiering_helpers import tier_in_batches

    log_dir, rng = f"{root}/commitlog", random.Random(body)
    with CommitLogWriter(log_dir, file_size=256 << 20, fsync="never") as writer:
        for start in range(0, messages, 5000):
            writer.append_many([Message(topic="t0", queue_id=i % 8, body=body_of(rng, body, i),
                                        properties={"KEYS": f"k{rng.randrange(keys):07d}"})
                                for i in range(start, min(messages, start + 5000))])
    store = MetadataStore(f"{root}/metadata")
    try:
        tier_in_batches(log_dir, location, store, 8 << 20, segment_bytes=32 << 20, segment_age_s=1e9)
    finally:
        store.close()
    reader = TierReader(location, broker="broker-a")
    committed = reader.committed()
    rows = keyed_rows(reader.read_all(committed)).sort_by("phy_offset").select(list(CHANGE_ROW))
    for name, referenced in (("copy", None), ("reference", np.ones(rows.num_rows, dtype=bool))):
        with KVView(f"{root}/kv-{name}", tier=location, broker="broker-a") as kv:
            kv.apply_table(rows, applied_through=rows["phy_offset"][-1].as_py() + 1, referenced=referenced)
    keys = sorted(set(rows["key"].to_pylist()))
    sealed = sum(q.sealed for q in committed.queue_states().values())
    commit = sum(q.commit for q in committed.queue_states().values())
    return {"messages": messages, "keys": keys, "segments": len(committed.segments),
            "sealed_share": round(sealed / commit, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--body", default="2000,16384", help="body sizes, comma-separated")
    ap.add_argument("--messages-mb", type=int, default=256, help="about this many MB of bodies a size")
    ap.add_argument("--keys", type=int, default=20_000)
    ap.add_argument("--queries", type=int, default=300, help="gets a view a round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--s3", action="store_true", help="the tier on S3: moto's server on loopback")
    args = ap.parse_args()

    from state.kv import KVView

    out = {"benchmark": "kv_get", "backend": "s3" if args.s3 else "posix", "results": []}
    server, bucket = s3_tier() if args.s3 else (None, None)
    for body in (int(b) for b in args.body.split(",") if b):
        root = tempfile.mkdtemp(prefix="bench-kv-get-")
        try:
            t0 = time.perf_counter()
            location = f"{bucket}-{body}" if args.s3 else f"{root}/tier"
            built = build(root, location, body, max(1, (args.messages_mb << 20) // body), args.keys)
            built_s = round(time.perf_counter() - t0, 1)
            keys = built.pop("keys")
            built["keys"] = len(keys)
            views = {name: KVView(f"{root}/kv-{name}", read_only=True, tier=location, broker="broker-a")
                     for name in ("copy", "reference")}
            rng, times = random.Random(3), {name: [] for name in views}
            names = list(views)
            for r in range(args.rounds):
                for name in names if r % 2 == 0 else names[::-1]:
                    for _ in range(args.queries):
                        key = rng.choice(keys)
                        t = time.perf_counter()
                        views[name].get("t0", key)
                        times[name].append(time.perf_counter() - t)
            for key in rng.sample(keys, 50):  # off the clock: both views hold the same whole values
                copy, reference = views["copy"].get("t0", key), views["reference"].get("t0", key)
                assert copy is not None and copy == reference, key
            for view in views.values():
                view.close()
            got = {name: percentiles(times[name]) for name in names}
            out["results"].append({"body": body, **built, "built_s": built_s, **got,
                                   "targets_p99_ms": {"copy": 5, "reference": 50} if not args.s3 else None})
        finally:
            shutil.rmtree(root, ignore_errors=True)
    if server is not None:
        server.stop()
    report(out)


if __name__ == "__main__":
    main()

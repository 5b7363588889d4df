"""As-of key reads (issue 50): a key's value at a random time, from the tier and its snapshots alone.

    python -m bench.bench_asof [--messages 1000000] [--keys 100000] [--snapshot-every 100000]
                               [--queries 200] [--rounds 3] [--s3]

One topic of 8 queues, ``--messages`` keyed messages of 100-byte bodies (15% deletes) over
``--keys`` keys, one store time a millisecond apart; tiered without Spark in 4 MB batches, sealed
every 50,000 messages a queue (so most of it is in sealed segments with key indexes), and a
compacted snapshot every ``--snapshot-every`` messages, written by the KV writer's own
``write_snapshot``.  Off the clock.

Each query is a random key at a random time, answered by a new ``AsOfReader`` over one long-lived
``TierReader`` (so each query reads the tier's root and records afresh, the topic's snapshots and a
few of their footers, and the key's changes after the snapshot; the backend's client is made once),
in these sets:

asof_young   times in the first fifth of the tier's time span;
asof_old     times in the last fifth: the figure must not grow with the tier's age;
history      the baseline: the same old queries answered from the key's whole history in the tier
             (``TierReader.by_key`` up to the time, the last change), what a reader without
             snapshots must do.

``--rounds`` rounds, the order of the sets reversed every other round; per set the p50 and p99 of
every query of every round.  Target: asof p99 <= 200 ms on posix, and asof_old no higher than
asof_young.  ``--s3``: the tier on moto's S3 server on loopback (every object read is an HTTP GET).
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time

from bench.common import percentiles, report
from connectors.commitlog.format import Message
from connectors.commitlog.writer import CommitLogWriter
from connectors.tier.asof import AsOfReader
from connectors.tier.reader import TierReader

BASE_MS = 1_700_000_000_000


def s3_tier():
    """moto's S3 server on loopback and a bucket on it: (server, tier location)."""
    import os

    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(AWS_ENDPOINT_URL_S3=f"http://{host}:{port}", AWS_ACCESS_KEY_ID="testing",
                      AWS_SECRET_ACCESS_KEY="testing", AWS_REGION="us-east-1")
    boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL_S3"]).create_bucket(Bucket="bench-asof")
    return server, "s3://bench-asof/tier"


def build(root: str, messages: int, keys: int, every: int, location: str | None = None) -> tuple[str, int]:
    """The tier (at ``location``, else under ``root``) and its snapshots; returns its location and
    the last store time."""
    from state.kv import Change, KVView
    from state.kv_writer import write_snapshot
    from state.metadata import MetadataStore
    from tests.tiering_helpers import tier_in_batches

    log_dir, location = f"{root}/commitlog", location or f"{root}/tier"
    rng = random.Random(1)
    kv = KVView(f"{root}/kv")
    with CommitLogWriter(log_dir, file_size=256 << 20, fsync="never") as writer:
        for start in range(0, messages, every):
            batch = []
            for i in range(start, min(messages, start + every)):
                props = {"KEYS": f"k{rng.randrange(keys):07d}"}
                delete = rng.random() < 0.15
                if delete:
                    props["KV_OP"] = "DELETE"
                batch.append(Message(topic="t0", queue_id=i % 8, body=b"" if delete else rng.randbytes(100),
                                     properties=props, store_ts=BASE_MS + i))
            stored = writer.append_many(batch)
            kv.apply([Change("t0", m.properties["KEYS"], "delete" if "KV_OP" in m.properties else "put",
                             m.phy_offset, m.queue_id, m.queue_offset, m.store_ts, m.body) for m in stored],
                     applied_through=stored[-1].phy_offset + stored[-1].size)
            write_snapshot(kv, location, "broker-a", kv.applied_through(), keep=10_000)
    kv.close()
    store = MetadataStore(f"{root}/metadata")
    try:
        tier_in_batches(log_dir, location, store, 4 << 20, segment_messages=50_000)
    finally:
        store.close()
    return location, BASE_MS + messages - 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--snapshot-every", type=int, default=100_000)
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--s3", action="store_true", help="the tier on S3: moto's server on loopback")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="bench-asof-")
    server = None
    try:
        t0 = time.perf_counter()
        location = None
        if args.s3:
            server, location = s3_tier()
        location, last_ms = build(root, args.messages, args.keys, args.snapshot_every, location)
        built_s = time.perf_counter() - t0
        span = last_ms - BASE_MS
        rng = random.Random(2)

        def queries(lo: float, hi: float) -> list[tuple[str, int]]:
            return [(f"k{rng.randrange(args.keys):07d}", BASE_MS + int(span * rng.uniform(lo, hi)))
                    for _ in range(args.queries)]

        young, old = queries(0.0, 0.2), queries(0.8, 1.0)
        states: dict[str, int] = {}

        tier = TierReader(location)  # its backend (an S3 client) made once, as a long-lived reader's is

        def asof(qs):
            out = []
            for key, at in qs:
                t = time.perf_counter()
                answer = AsOfReader(tier).get("t0", key, at)
                out.append(time.perf_counter() - t)
                states[answer.state] = states.get(answer.state, 0) + 1
            return out

        def history(qs):
            out = []
            for key, at in qs:
                t = time.perf_counter()
                tier.by_key("t0", key, None, at)  # its last row is the answer
                out.append(time.perf_counter() - t)
            return out

        sets = {"asof_young": lambda: asof(young), "asof_old": lambda: asof(old), "history": lambda: history(old)}
        seconds = {name: [] for name in sets}
        for r in range(args.rounds):
            for name in (list(sets) if r % 2 == 0 else list(sets)[::-1]):
                seconds[name].extend(sets[name]())
        result = {name: percentiles(s) for name, s in seconds.items()}
        result["ratio_history_over_asof_old_p99"] = round(result["history"]["p99_ms"] / result["asof_old"]["p99_ms"], 2)
        report({"bench": "asof", "tier": "s3 (moto)" if args.s3 else "posix", "messages": args.messages, "keys": args.keys, "snapshot_every": args.snapshot_every,
                "snapshots": args.messages // args.snapshot_every, "build_s": round(built_s, 1),
                "rounds": args.rounds, "answers": states, **result})
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()

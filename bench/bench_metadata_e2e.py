"""The whole service on a tier that has sealed many segments: `./dev bench metadata_e2e`.

Builds two tiers with the real service (``Service.run(until_caught_up=True)``, Spark, the tiering
query, real Parquet segments and key indexes, ``segment_messages = 1``): a *big* one sealing
``--segments`` segments over ``--queues`` queues, and a fresh *small* one of 400 queues.  Then, in
rounds that alternate the two, it appends 200 messages to one queue and runs the service again,
and reports for that batch the seconds of its commit and maintain steps (from the batch's own log
line) and of the whole batch, and the seconds a new ``TierReader`` takes to ``get`` 5 messages of
that queue.  The ratios big/small are the figures; the small tier is the baseline of the same run.

    ./dev bench metadata_e2e [--segments 100000] [--queues 20000] [--rounds 3] [--tier posix|s3]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import tempfile
import time

from bench.common import report
from connectors.commitlog.format import Message
from connectors.commitlog.writer import CommitLogWriter
from connectors.tier.reader import TierReader
from streaming import config as cfg
from streaming.service import Service

FILE = 64 << 20
BODY = b"b" * 100


class BatchLines(logging.Handler):
    """The tiering query's per-batch log lines, parsed."""

    def __init__(self):
        super().__init__()
        self.lines: list[dict] = []

    def emit(self, record):
        text = record.getMessage()
        if text.startswith("batch "):
            line = json.loads(text[6:])
            if line.get("query") == "tiering":
                self.lines.append(line)


class Deployment:
    def __init__(self, root: str, name: str, location: str, queues: int):
        base = os.path.join(root, name)
        self.queues = queues
        self.conf = cfg.Config(
            commitlog=cfg.CommitlogConfig(dir=os.path.join(base, "commitlog")),
            source=cfg.SourceConfig(max_records_per_trigger=queues),  # one message per queue per batch
            tier=cfg.TierConfig(location=location, segment_messages=1, delete_grace_s=0.0),
            state=cfg.StateConfig(dir=os.path.join(base, "state")),
            checkpoint=cfg.CheckpointConfig(dir=os.path.join(base, "checkpoints")),
            compaction=cfg.CompactionConfig(enabled=False),
            metrics=cfg.MetricsConfig(port=0),
        )
        os.makedirs(self.conf.commitlog.dir, exist_ok=True)
        self.appended = 0

    def append(self, keys: list[tuple[str, int]]) -> None:
        with CommitLogWriter(self.conf.commitlog.dir, file_size=FILE, fsync="never") as writer:
            writer.append_many([Message(topic=t, queue_id=q, body=BODY, properties={"KEYS": f"k{i % 97}"})
                                for i, (t, q) in enumerate(keys)])
        self.appended += len(keys)

    def run(self, spark, lines: BatchLines) -> list[dict]:
        before = len(lines.lines)
        Service(self.conf).run(until_caught_up=True, spark=spark)
        return lines.lines[before:]


def all_queues(n: int) -> list[tuple[str, int]]:
    return [(f"topic-{i // 1000}", i % 1000) for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--segments", type=int, default=100_000)
    parser.add_argument("--queues", type=int, default=20_000)
    parser.add_argument("--small-queues", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tier", choices=["posix", "s3"], default="posix")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    from streaming.runtime.checkpoints import LOCAL_FILE_MANAGER  # as the service's session (plan.session_conf)
    from streaming.runtime.session import build_session

    root = tempfile.mkdtemp(prefix="bench-metadata-e2e-", dir=args.dir)
    moto = None
    try:
        if args.tier == "s3":
            import boto3
            from moto.server import ThreadedMotoServer

            moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
            moto.start()
            os.environ.update(AWS_ENDPOINT_URL_S3=f"http://127.0.0.1:{moto._server.server_port}",
                              AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
            boto3.client("s3").create_bucket(Bucket="bench")
            where = lambda name: f"s3://bench/{name}"  # noqa: E731
        else:
            where = lambda name: os.path.join(root, name, "tier")  # noqa: E731
        lines = BatchLines()
        logging.getLogger("tierlog.service").addHandler(lines)
        logging.getLogger("tierlog.service").setLevel(logging.INFO)
        spark = build_session("bench-metadata-e2e", extra=LOCAL_FILE_MANAGER)
        big = Deployment(root, "big", where("big"), args.queues)
        small = Deployment(root, "small", where("small"), args.small_queues)
        started = time.monotonic()
        for dep, segments in ((big, args.segments), (small, args.small_queues * 5)):
            for _ in range(max(1, segments // dep.queues)):
                dep.append(all_queues(dep.queues))
            dep.run(spark, lines)
        build_s = time.monotonic() - started
        sealed = {name: sum(q.segments for q in TierReader(dep.conf.tier.location).committed().queue_states().values())
                  for name, dep in (("big", big), ("small", small))}
        samples = {name: {"commit_maintain_s": [], "batch_s": [], "get_s": []} for name in ("big", "small")}
        probe = ("topic-0", 0)
        for r in range(args.rounds):
            for name, dep in (("big", big), ("small", small)) if r % 2 == 0 else (("small", small), ("big", big)):
                dep.append([probe] * 200)
                batches = [b for b in dep.run(spark, lines) if b["rows"]]
                last = batches[-1]
                samples[name]["commit_maintain_s"].append(last["phases"]["commit"] + last["phases"]["maintain"])
                samples[name]["batch_s"].append(last["seconds"])
                t = time.perf_counter()
                got = TierReader(dep.conf.tier.location).get(*probe, 3, 5)
                samples[name]["get_s"].append(time.perf_counter() - t)
                assert got.messages.num_rows == 5, got.status
        med = {n: {k: statistics.median(v) for k, v in s.items()} for n, s in samples.items()}
        report({"benchmark": "metadata_e2e", "tier": args.tier, "rounds": args.rounds, "build_s": round(build_s, 1),
                "sealed_segments": sealed, "queues": {"big": big.queues, "small": small.queues},
                "big": {k: round(v, 4) for k, v in med["big"].items()},
                "small (baseline, same run)": {k: round(v, 4) for k, v in med["small"].items()},
                "ratio_big_over_small": {k: round(med["big"][k] / med["small"][k], 2) for k in med["big"]}})
    finally:
        if moto is not None:
            moto.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

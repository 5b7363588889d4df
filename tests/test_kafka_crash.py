"""SIGKILL the service while it replicates to Kafka, restart it, and compare Kafka with the oracle.

Each run is a real ``tierlog run --until-caught-up`` process with both Kafka
sinks on; ``TIERLOG_FAULT`` kills its driver part way through sending
(records buffered, some acknowledged), after a mirror batch is in Kafka but
before Spark commits it, or after a changelog batch is in Kafka but before
the KV view has it.  New messages are appended before every run.  Nothing may
be missing from Kafka at the end, and nothing may be there twice.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from streaming import config as cfg
from tests.cli_runner import run_killed_at, sink_offsets, tierlog
from tests.cli_runner import write_config as shared_config
from tests.kafka_helpers import assert_mirror_equals_oracle, changelog_oracle, changelog_records, compacted, mirror_contents
from tests.kv_helpers import append, kv_messages, view_contents
from tests.oracle import latest_per_key

# "committed": the tier has committed a batch, the mirror (which reads the tier) has not sent it.
FAULTS = [("kafka_sending", 1), ("mirrored", 1), ("changelogged", 1), ("kafka_sending", 2), ("mirrored", 2),
          ("changelogged", 2), ("committed", 2)]
TOPICS = ["t0", "t1"]
TTL = {"t0": 3600.0}  # compaction.ttl = "t0=1h": far from the ages the messages have (3 h, or minutes)
OLD_ROUNDS, AGE_MS = 2, 3 * 3_600_000


def write_config(tmp_path: Path, bootstrap: str, prefix: str) -> Path:
    return shared_config(tmp_path, source={"max_bytes_per_trigger": 60000}, tier={"delete_grace_s": 0},
                         compaction={"snapshot_interval_s": 0, "ttl": "t0=1h"},
                         kafka={"bootstrap": bootstrap, "mirror_topic": f"{prefix}.{{topic}}",
                                "changelog_topic": f"{prefix}.{{topic}}.changelog", "partitions": 4, "linger_ms": 2})


def assert_no_duplicates(conf: cfg.Config) -> None:
    for (topic, p), records in mirror_contents(conf, TOPICS).items():
        positions = [int(dict(h)["tierlog.phy"]) for _k, _v, h in records]
        assert positions == sorted(set(positions)), f"{topic}[{p}]: a record twice or out of order"
    changes = [(t, k, pos) for t, k, _v, pos, _p in changelog_records(conf, TOPICS)]
    assert len(changes) == len(set(changes)), "a change was sent twice"


@pytest.mark.heavy
@pytest.mark.timeout(1200)
def test_sigkill_while_replicating_then_restart(tmp_path, kafka_bootstrap, kafka_prefix):
    config = write_config(tmp_path, kafka_bootstrap, kafka_prefix)
    conf = cfg.load(str(config), env={})
    kills = 0
    for i, (point, nth) in enumerate(FAULTS):
        old = int(time.time() * 1000) - AGE_MS if i < OLD_ROUNDS else 0
        # the old rounds' keys reach past the fresh rounds' 300, so some stay expired at the end
        append(conf, kv_messages(1500, keys=600 if old else 300, seed=i, store_ts=old))
        kills += run_killed_at(config, point, nth, tmp_path / f"fault-{i}")
        assert_no_duplicates(conf)
    assert kills >= 5, f"only {kills} runs were killed"

    final = tierlog("run", "--until-caught-up", "--config", str(config))
    assert final.returncode == 0, final.stderr[-3000:]
    assert_mirror_equals_oracle(conf, TOPICS)
    alive = latest_per_key(conf.commitlog.dir, ttl=TTL, now_ms=int(time.time() * 1000))
    got = compacted(changelog_records(conf, TOPICS))
    assert {k: v for k, v in got.items() if v is not None} == {k: v["body"] for k, v in alive.items()}
    assert view_contents(conf) == alive
    expired = {k for k, v in got.items() if v is None} - {k for k, v in changelog_oracle(conf).items() if v is None}
    assert expired and all(topic == "t0" for topic, _ in expired), "no key expired: the TTL was not exercised"
    assert_no_duplicates(conf)
    sinks = sink_offsets(conf)
    assert sinks["mirror"] == sinks["changelog"] == sinks["tier"] == sinks["kv"]

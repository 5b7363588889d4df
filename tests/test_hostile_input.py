"""Bad input and secrets: hostile topic names stay inside the tier, a corrupt log stops the job with
its file and offset, and canary credentials never leave the process in logs, status, errors or metrics."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.request

import pytest

from connectors.commitlog.format import Message, file_name
from connectors.kafka.embedded import free_port
from connectors.tier.layout import escape_topic, unescape_topic
from connectors.tier.reader import TierReader
from streaming import config as cfg
from streaming.settings import derive
from tests.cli_runner import cli_command, cli_env, tierlog, write_config
from tests.kv_helpers import append, kv_messages
from tests.oracle import replay, written_rows

HOSTILE_TOPICS = ["../../escape", "/abs/olute", "..", "a/b\\c", "%2e%2e%2f", "sp ace:colon*star?", "\u65e5\u672c",
                  "t" * 200]


def _files_under(root) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), root) for d, _dirs, files in os.walk(root) for f in files}


def test_hostile_topic_names_are_escaped_and_nothing_lands_outside_the_tier(tmp_path):
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    before_parent = set(os.listdir(tmp_path.parent))
    (tmp_path / "deploy").mkdir()
    config = write_config(tmp_path / "deploy", tier={"segment_messages": 3})
    conf = cfg.load(str(config), env={})
    append(conf, [Message(topic=t, queue_id=i % 2, body=b"%d" % i, properties={"KEYS": f"k{i}"})
                  for i in range(40) for t in HOSTILE_TOPICS])
    result = tierlog("run", "--until-caught-up", "--config", str(config))
    assert result.returncode == 0, result.stderr[-3000:]

    assert set(os.listdir(tmp_path.parent)) == before_parent and not outside.exists()
    assert set(os.listdir(tmp_path)) == {"deploy"}
    assert set(os.listdir(tmp_path / "deploy")) == {"commitlog", "tier", "state", "checkpoints", "tierlog.toml"}
    for name in _files_under(tmp_path / "deploy" / "tier"):
        assert ".." not in name.split(os.sep) and "\\" not in name, name
    reader = TierReader(conf.tier.location)
    for topic in HOSTILE_TOPICS:
        assert unescape_topic(escape_topic(topic)) == topic
        got = reader.get(topic, 0, 0, 100)
        assert [bytes(r["body"]) for r in got.messages.to_pylist()] == [b"%d" % i for i in range(0, 40, 2)]
    assert len(reader.read_all()) == len(written_rows(conf.commitlog.dir)) == 40 * len(HOSTILE_TOPICS)


def test_topic_names_kafka_refuses_get_a_legal_name_and_a_collision_stops_naming_both():
    """RocketMQ allows '%' and '|' (its retry and dead-letter topics are %RETRY%group and %DLQ%group);
    Kafka does not. Such a topic gets a deterministic legal name (Debezium's rule: '_' for each
    other character); two topics that would share one stop the sink with both and the setting named."""
    from connectors.kafka.errors import KafkaSinkError, TopicNameError
    from connectors.kafka.settings import TopicRouter, legal_topic

    route = TopicRouter("{topic}", {"%DLQ%g": "dlq-g"}, "kafka.mirror_topic")
    assert route("orders") == "orders" and route("%DLQ%g") == "dlq-g"
    assert route("%RETRY%g") == "_RETRY_g" and route("a|b") == "a_b" and route(".") == "_"
    long = route("%DLQ%" + "x" * 250)
    assert legal_topic(long) and len(long) <= 249 and long == TopicRouter("{topic}", {}, "s")("%DLQ%" + "x" * 250)
    for topic in ("../x", "üx", "c d"):
        assert legal_topic(route(topic)), topic
    with pytest.raises(TopicNameError) as caught:
        route("_RETRY_g")  # a legal topic of its own, where %RETRY%g went
    assert isinstance(caught.value, KafkaSinkError) and not caught.value.retriable
    assert "'%RETRY%g'" in str(caught.value) and "'_RETRY_g'" in str(caught.value)
    assert "kafka.mirror_topic_map" in str(caught.value)
    with pytest.raises(TopicNameError, match="kafka.mirror_topic_map maps"):
        TopicRouter("{topic}", {"a": "b%c"}, "kafka.mirror_topic")("a")


# A compaction batch that Spark has started but that has not yet reached its sink (injected: it
# sleeps first).  The tiering query fails meanwhile; the service must still stop, not wait on it.
SLOW_COMPACTION_BATCHES = """
import time
from streaming.queries.compaction import handler as compaction
process = compaction.CompactionHandler.process
def slow_process(self, batch):
    time.sleep(2.0)
    return process(self, batch)
compaction.CompactionHandler.process = slow_process
"""


@pytest.mark.parametrize("slow_compaction", [False, True], ids=["", "while-a-compaction-batch-starts"])
def test_a_corrupt_commitlog_stops_the_job_naming_the_file_and_offset(tmp_path, slow_compaction):
    config = write_config(tmp_path, source={"max_bytes_per_trigger": 20000})
    conf = cfg.load(str(config), env={})
    append(conf, kv_messages(400, keys=50, seed=3, delete_ratio=0))
    rows = replay(conf.commitlog.dir)
    victim = rows[250]
    path = os.path.join(conf.commitlog.dir, file_name(0))
    with open(path, "r+b") as fh:  # flip one byte of the body: only the CRC can tell
        data = bytearray(fh.read())
        body_at = data.index(victim["body"], victim["phy_offset"])
        data[body_at] ^= 0xFF
        fh.seek(0)
        fh.write(data)
    result = tierlog("run", "--until-caught-up", "--config", str(config),
                     prelude=SLOW_COMPACTION_BATCHES if slow_compaction else None)
    assert result.returncode == 3  # corrupt input: its own exit code, through the failed query
    assert f"{path} at physical offset {victim['phy_offset']}" in result.stderr and "CRC" in result.stderr
    assert "Traceback" not in result.stderr and "at org.apache" not in result.stderr  # one line, not Spark's trace
    tiered = sorted(TierReader(conf.tier.location).read_all()["phy_offset"].to_pylist())
    assert tiered == [r["phy_offset"] for r in rows[: len(tiered)]] and len(tiered) <= 250  # nothing past it


CANARIES = {"AWS_SECRET_ACCESS_KEY": "canary-aws-S3CR3T", "AWS_SESSION_TOKEN": "canary-aws-T0KEN",
            "TIERLOG_KAFKA_SASL_PASSWORD": "canary-kafka-PA55"}


def test_canary_credentials_never_show_in_logs_status_errors_or_metrics(tmp_path, s3_location, kafka_bootstrap,
                                                                          kafka_prefix):
    port = free_port()
    config = write_config(tmp_path, tier={"location": s3_location}, metrics={"port": port},
                          kafka={"bootstrap": kafka_bootstrap, "mirror_topic": f"{kafka_prefix}.{{topic}}",
                                 "changelog_topic": f"{kafka_prefix}.{{topic}}.changelog", "partitions": 2})
    conf = cfg.load(str(config), env={})
    append(conf, kv_messages(500, keys=50, seed=4))
    env = {"AWS_ACCESS_KEY_ID": "testing", **CANARIES}
    out = tmp_path / "service.log"
    with open(out, "w") as fh:
        service = subprocess.Popen(cli_command("run", "--config", str(config)), env=cli_env(env),
                                   stdout=fh, stderr=subprocess.STDOUT)
    texts = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
                    metrics = resp.read().decode()
                if any(line.startswith("tierlog_rows_in_total{") and float(line.split()[-1]) > 0
                       for line in metrics.splitlines()):  # a batch went through S3 and Kafka
                    texts.append(metrics)
                    break
            except OSError:
                pass
            time.sleep(1)
        assert texts, "the metrics endpoint never answered"
        for argv in (["status"], ["status", "--format", "json"], ["config", "show"], ["config", "check"]):
            r = tierlog(*argv, "--config", str(config), env=env)
            texts += [r.stdout, r.stderr]
    finally:
        service.send_signal(signal.SIGTERM)
        service.wait(timeout=120)
    texts.append(out.read_text())
    # An error path: a bucket that does not exist, and a broker that is not there.
    for i, section in enumerate([{"tier": {"location": "s3://no-such-bucket-canary/x"}},
                                 {"tier": {"location": s3_location}, "kafka": {"bootstrap": "127.0.0.1:1"}}]):
        (tmp_path / f"bad{i}").mkdir()
        bad = write_config(tmp_path / f"bad{i}", **section)
        r = tierlog("run", "--until-caught-up", "--config", str(bad), env=env)
        assert r.returncode != 0
        texts += [r.stdout, r.stderr]
    everything = "\n".join(texts)
    assert "tierlog_rows_in" in everything and "safepoint" in everything
    for name, secret in CANARIES.items():
        assert secret not in everything, f"{name} leaked"


def test_quarantine_skips_corrupt_records_records_them_and_goes_on(tmp_path):
    import json

    from tests.kv_helpers import view_contents
    from tests.tiering_helpers import tier_rows

    config = write_config(tmp_path, commitlog={"on_corrupt": "quarantine"}, source={"max_bytes_per_trigger": 20000},
                          tier={"segment_messages": 30})  # seals across the gaps the skipped records leave
    conf = cfg.load(str(config), env={})
    append(conf, kv_messages(400, keys=50, seed=5, delete_ratio=0))
    rows = replay(conf.commitlog.dir)
    crc_victim, magic_victim = rows[100], rows[300]
    path = os.path.join(conf.commitlog.dir, file_name(0))
    with open(path, "r+b") as fh:
        data = bytearray(fh.read())
        data[data.index(crc_victim["body"], crc_victim["phy_offset"])] ^= 0xFF  # only the CRC can tell
        data[magic_victim["phy_offset"] + 4 : magic_victim["phy_offset"] + 8] = b"\xde\xad\xbe\xef"
        fh.seek(0)
        fh.write(data)
    result = tierlog("run", "--until-caught-up", "--config", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "quarantined commitlog bytes" in result.stderr

    victims = {crc_victim["phy_offset"], magic_victim["phy_offset"]}
    expected = [r for r in rows if r["phy_offset"] not in victims]
    assert tier_rows(conf.tier.location) == expected  # everything else, exactly once
    assert not victims & {v["phy_offset"] for v in view_contents(conf).values()}
    status = [json.loads(line) for line in tierlog("status", "--format", "json", "--config", str(config)).stdout.splitlines()]
    quarantined = [r for r in status if r["kind"] == "quarantined"]
    assert [(q["file"], q["start_phy"], q["end_phy"]) for q in quarantined] == [
        (path, v["phy_offset"], v["phy_offset"] + v["size"]) for v in (crc_victim, magic_victim)]
    assert "CRC" in quarantined[0]["reason"] and "magic" in quarantined[1]["reason"]
    assert next(r for r in status if r["kind"] == "summary")["quarantined"] == 2

    # The tier's commit records hold the ranges too: a metadata store rebuilt from the tier lists them again.
    shutil.rmtree(derive(conf).paths.metadata)
    assert tierlog("tier", "rebuild-metadata", "--config", str(config)).returncode == 0
    status = [json.loads(line) for line in tierlog("status", "--format", "json", "--config", str(config)).stdout.splitlines()]
    assert [(r["file"], r["start_phy"], r["reason"]) for r in status if r["kind"] == "quarantined"] == [
        (q["file"], q["start_phy"], q["reason"]) for q in quarantined]

"""Stop the Kafka broker for 30 s while the service runs and a producer appends; start it again.

The broker is tansu with its topics in S3 (a moto server of its own), so they
survive the restart.  While it is down the mirror and changelog wait with
backoff and say so in ``tierlog status``, the tier keeps going, and the
safepoint stays at what Kafka has.  After it is back, everything arrives
exactly once.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import boto3
import pytest

from connectors.kafka.embedded import EmbeddedBroker, free_port
from streaming import config as cfg
from tests.cli_runner import cli_command, cli_env, tierlog
from tests.kafka_helpers import assert_mirror_equals_oracle, changelog_oracle, changelog_records, compacted
from tests.kv_helpers import append, kv_messages
from tests.test_kafka_crash import TOPICS, assert_no_duplicates

OUTAGE_S = 30


@pytest.fixture
def durable_broker(tmp_path):
    """tansu keeping its topics in a bucket of a moto server of its own, so a restart keeps them."""
    port = free_port()
    moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    creds = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}
    deadline = time.monotonic() + 30
    while True:
        try:
            boto3.client("s3", endpoint_url=endpoint, **creds).create_bucket(Bucket="tansu")
            break
        except Exception:  # noqa: BLE001 - not listening yet
            assert time.monotonic() < deadline, "moto did not start"
            time.sleep(0.2)
    # Every endpoint variable, or the session's S3 fixture (AWS_ENDPOINT_URL_S3 in os.environ) wins.
    env = {"AWS_ENDPOINT": endpoint, "AWS_ENDPOINT_URL": endpoint, "AWS_ENDPOINT_URL_S3": endpoint,
           "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}
    broker = EmbeddedBroker("s3://tansu/", env=env, log_path=str(tmp_path / "tansu.log")).start()
    yield broker
    broker.stop()
    moto.kill()
    moto.wait()


def status(config) -> dict | None:
    """``tierlog status --format json``, or None before the service has created its metadata."""
    result = tierlog("status", "--format", "json", "--config", str(config))
    if "no metadata store" in result.stderr:
        return None
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    return {"sinks": {r["sink"]: r for r in rows if r["kind"] == "sink"},
            "summary": next(r for r in rows if r["kind"] == "summary")}


def keep_appending(conf, stop: threading.Event, per_second: int = 100) -> None:
    seed = 1000
    while not stop.is_set():
        append(conf, kv_messages(per_second // 5, keys=200, seed=seed))
        seed += 1
        time.sleep(0.2)


@pytest.mark.timeout(900)
def test_a_30s_broker_outage_loses_and_duplicates_nothing(tmp_path, durable_broker, kafka_prefix):
    from tests.test_kafka_crash import write_config

    config = write_config(tmp_path, durable_broker.bootstrap, kafka_prefix)
    with open(config, "a") as fh:
        fh.write("delivery_timeout_s = 10\n[spark]\ntrigger_interval_s = 0.5\n")
    conf = cfg.load(str(config), env={})
    append(conf, kv_messages(500, keys=200, seed=1))
    stop = threading.Event()
    producer = threading.Thread(target=keep_appending, args=(conf, stop))
    service = subprocess.Popen(cli_command("run", "--config", str(config)), env=cli_env(),
                               stdout=subprocess.DEVNULL, stderr=open(tmp_path / "service.log", "w"))
    try:
        wait_for(lambda: (status(config) or {"sinks": {"mirror": {}}})["sinks"]["mirror"].get("applied_phy"), 120,
                 "the mirror's first batch")
        producer.start()
        time.sleep(5)
        durable_broker.stop()
        down_at = time.monotonic()
        seen_waiting = None
        while time.monotonic() - down_at < OUTAGE_S:
            time.sleep(3)
            now = status(config)
            if now["sinks"]["mirror"]["state"] == "waiting":
                seen_waiting = now
        durable_broker.start()
        assert seen_waiting is not None, "status never said the mirror was waiting for Kafka"
        sinks = seen_waiting["sinks"]
        assert sinks["mirror"]["error"] and sinks["tier"]["applied_phy"] > sinks["mirror"]["applied_phy"]
        assert seen_waiting["summary"]["safepoint"] <= sinks["mirror"]["applied_phy"]  # GC holds for Kafka
        time.sleep(5)
        stop.set()
        producer.join()
        end = status(config)["summary"]["commitlog_end_phy"]
        last: list[dict] = []

        def caught_up() -> bool:
            last[:] = [status(config)]
            return all(s["applied_phy"] == end and s["state"] == "ok" for s in last[0]["sinks"].values())

        try:
            wait_for(caught_up, 300, "every sink to reach the end of the log")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nend {end}, last status {json.dumps(last[0]['sinks'])}\nservice log:\n"
                                 + _tail(tmp_path / "service.log") + "\ntansu log:\n" + _tail(tmp_path / "tansu.log")) from None
    finally:
        stop.set()
        service.send_signal(signal.SIGTERM)
        code = service.wait(timeout=120)
    assert code == 0, (tmp_path / "service.log").read_text()[-3000:]
    assert_mirror_equals_oracle(conf, TOPICS)
    assert compacted(changelog_records(conf, TOPICS)) == changelog_oracle(conf)
    assert_no_duplicates(conf)


def _tail(path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(none)"


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(1)

"""Stop the Kafka broker (Apache Kafka, SIGKILL) for 30 s, and until ``tierlog status`` has said the
mirror waits for it, while the service runs and a producer appends; start it again on the same
port and data.

Clients lose their connections and their requests in flight, and batches the transaction
coordinator had open are aborted on its restart.  While Kafka is down the mirror and changelog
wait with backoff and say so in ``tierlog status``, the tier keeps going, and the safepoint moves
on past them: compaction (the changelog rides on it) and the mirror read the tier's committed
batches, which the tier keeps for them.  After it is back, everything arrives exactly once.

A second test turns the TTL on across an outage: keys that expire while Kafka is away stay in the
KV view until their tombstones are in the changelog, and get there once Kafka is back.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import pytest

from streaming import config as cfg
from tests.kafka_broker import ApacheKafka
from tests.cli_runner import cli_command, cli_env, tierlog
from tests.cli_runner import write_config as shared_config
from tests.kafka_helpers import assert_mirror_equals_oracle, changelog_oracle, changelog_records, compacted
from tests.kv_helpers import append, kv_messages, view_contents
from tests.oracle import latest_per_key
from tests.test_kafka_crash import TOPICS, TTL, assert_no_duplicates, write_config

OUTAGE_S = 30
EXPIRE_IN_S = 30  # the TTL test's keys expire this long after they are appended
TTL_MS = int(TTL["t0"] * 1000)  # compaction.ttl = "t0=1h"
WAITING_WITHIN_S = 180


@pytest.fixture
def kafka(tmp_path):
    """A Kafka of this test's own, since the test stops it."""
    with ApacheKafka(tmp_path / "kafka") as broker:
        yield broker


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


def outage_config(tmp_path, kafka, kafka_prefix):
    """Both tests' service: Kafka's delivery timeout short enough that an outage shows as waiting."""
    config = write_config(tmp_path, kafka.bootstrap, kafka_prefix)
    with open(config, "a") as fh:
        fh.write("delivery_timeout_s = 10\n[spark]\ntrigger_interval_s = 0.5\n")
    return config, cfg.load(str(config), env={})


@pytest.mark.heavy
@pytest.mark.timeout(900)
def test_a_30s_broker_outage_loses_and_duplicates_nothing(tmp_path, kafka, kafka_prefix):
    config, conf = outage_config(tmp_path, kafka, kafka_prefix)
    append(conf, kv_messages(500, keys=200, seed=1))
    stop = threading.Event()
    producer = threading.Thread(target=keep_appending, args=(conf, stop))
    service = subprocess.Popen(cli_command("run", "--config", str(config)), env=cli_env(),
                               stdout=subprocess.DEVNULL, stderr=open(tmp_path / "service.log", "w"))
    try:
        # On a busy host the queries may start late, with backoff, for up to spark.late_start_s: the
        # service is up once its first batch is, and this waits as long as the service itself would.
        wait_for(lambda: (status(config) or {"sinks": {"mirror": {}}})["sinks"]["mirror"].get("applied_phy"),
                 conf.spark.late_start_s + 60, "the mirror's first batch",
                 alive=lambda: service.poll() is None, log=tmp_path / "service.log")
        first = status(config)["sinks"]["mirror"]["applied_phy"]
        producer.start()
        # Kafka goes away while messages are flowing: once the mirror has sent some of the producer's.
        wait_for(lambda: status(config)["sinks"]["mirror"]["applied_phy"] > first, 60, "the mirror to send new messages")
        kafka.stop(kill=True)
        down_at = time.monotonic()
        seen_waiting = None
        # Down for 30 s, and until status has said the mirror waits: on a busy machine the mirror
        # may reach Kafka's delivery timeout only late in the 30 s, and say so only for a moment.
        while time.monotonic() - down_at < OUTAGE_S or seen_waiting is None:
            assert time.monotonic() - down_at < WAITING_WITHIN_S, \
                f"status never said the mirror was waiting for Kafka in {WAITING_WITHIN_S} s of the outage"
            time.sleep(1)
            now = status(config)
            if now["sinks"]["mirror"]["state"] == "waiting":
                seen_waiting = now
        kafka.start()
        sinks = seen_waiting["sinks"]
        assert sinks["mirror"]["error"] and sinks["tier"]["applied_phy"] > sinks["mirror"]["applied_phy"]
        # The changelog rides on compaction, which reads the tier's committed batches, as the mirror
        # does: GC does not hold for either (the tier keeps their staging objects instead).
        assert seen_waiting["summary"]["safepoint"] > sinks["changelog"]["applied_phy"]
        # The producer goes on until the mirror is sending again, so the recovery too has new messages.
        wait_for(lambda: status(config)["sinks"]["mirror"]["state"] == "ok", 120, "the mirror to send again")
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
                                 + _tail(tmp_path / "service.log") + "\nkafka log:\n" + _tail(tmp_path / "kafka" / "kafka.out")) from None
    finally:
        stop.set()
        service.send_signal(signal.SIGTERM)
        code = service.wait(timeout=120)
    assert code == 0, (tmp_path / "service.log").read_text()[-3000:]
    assert_mirror_equals_oracle(conf, TOPICS)
    assert compacted(changelog_records(conf, TOPICS)) == changelog_oracle(conf)
    assert_no_duplicates(conf)


@pytest.mark.heavy
@pytest.mark.timeout(900)
def test_keys_that_expire_while_kafka_is_away_stay_until_their_tombstones_are_in_the_changelog(
        tmp_path, kafka, kafka_prefix):
    config, conf = outage_config(tmp_path, kafka, kafka_prefix)
    append(conf, kv_messages(300, keys=100, seed=1))
    service = subprocess.Popen(cli_command("run", "--config", str(config)), env=cli_env(),
                               stdout=subprocess.DEVNULL, stderr=open(tmp_path / "service.log", "w"))
    alive = lambda: service.poll() is None  # noqa: E731
    log = tmp_path / "service.log"
    try:
        wait_for(lambda: _changelog_caught_up(config), conf.spark.late_start_s + 60,
                 "the changelog to hold the first messages", alive=alive, log=log)
        # Keys of t0 (TTL 1 h) stored 1 h minus EXPIRE_IN_S ago: they expire once Kafka is away.  On
        # a busy host the changelog may take longer than that to hold them; then try a new round.
        for attempt in range(3):
            expires_at = time.time() + EXPIRE_IN_S
            expiring = list(kv_messages(200, keys=400, seed=10 + attempt, topics=1, delete_ratio=0,
                                        store_ts=int(expires_at * 1000) - TTL_MS))
            append(conf, expiring)
            wait_for(lambda: _changelog_caught_up(config), 120, "the changelog to hold the keys",
                     alive=alive, log=log)
            if time.time() < expires_at - 5:
                break
        else:
            pytest.fail(f"the changelog never held the expiring keys {EXPIRE_IN_S} s before they expired")
        doomed = {("t0", m.properties["KEYS"]) for m in expiring if "KEYS" in m.properties}
        assert doomed <= set(view_contents(conf))
        kafka.stop(kill=True)
        wait_for(lambda: time.time() > expires_at + 5 and status(config)["sinks"]["changelog"]["state"] == "waiting",
                 120, "the changelog to wait for Kafka with the keys' tombstones", alive=alive, log=log)
        # Expired, but their tombstones could not be sent: the view keeps them, so none is lost.
        assert doomed <= set(view_contents(conf)), "the view forgot expired keys before their tombstones were sent"
        kafka.start()
        wait_for(lambda: not doomed & set(view_contents(conf)), 180, "the keys to leave the view once Kafka is back",
                 alive=alive, log=log)
    finally:
        service.send_signal(signal.SIGTERM)
        code = service.wait(timeout=120)
    assert code == 0, log.read_text()[-3000:]
    expected = latest_per_key(conf.commitlog.dir, ttl=TTL, now_ms=int(time.time() * 1000))
    got = compacted(changelog_records(conf, TOPICS))
    assert {k: v for k, v in got.items() if v is not None} == {k: v["body"] for k, v in expected.items()}
    assert view_contents(conf) == expected
    assert {k for k, v in got.items() if v is None} >= doomed  # each expired key ends as a tombstone
    assert doomed, "no key expired: the TTL was not exercised"
    assert_no_duplicates(conf)


@pytest.mark.heavy
@pytest.mark.timeout(900)
def test_the_safepoint_moves_while_kafka_is_away_and_the_mirror_sends_every_message_once_after(
        tmp_path, kafka, kafka_prefix):
    """The mirror reads the tier's committed batches, not the commitlog: while Kafka is away the
    safepoint (what `commitlog gc` may delete below) passes what the mirror has sent, and the tier
    keeps the staging objects the mirror still needs, though it seals and folds past them."""
    # Compaction off: the mirror is the tier's one consumer here; the tier seals, retires and folds
    # often, with no grace: only the feed's hold-back keeps what the mirror has not sent.
    config = shared_config(tmp_path, source={"max_bytes_per_trigger": 60000}, compaction={"enabled": False},
                           tier={"delete_grace_s": 0, "segment_messages": 100, "fold_every": 4},
                           spark={"trigger_interval_s": 0.5},
                           kafka={"bootstrap": kafka.bootstrap, "mirror_topic": f"{kafka_prefix}.{{topic}}",
                                  "partitions": 4, "linger_ms": 2, "delivery_timeout_s": 10})
    conf = cfg.load(str(config), env={})
    append(conf, kv_messages(500, keys=200, seed=1))
    stop = threading.Event()
    producer = threading.Thread(target=keep_appending, args=(conf, stop))
    service = subprocess.Popen(cli_command("run", "--config", str(config)), env=cli_env(),
                               stdout=subprocess.DEVNULL, stderr=open(tmp_path / "service.log", "w"))
    alive, log = (lambda: service.poll() is None), tmp_path / "service.log"
    end = held = during = None
    try:
        wait_for(lambda: (status(config) or {"sinks": {"mirror": {}}})["sinks"]["mirror"].get("applied_phy"),
                 conf.spark.late_start_s + 60, "the mirror's first batch", alive=alive, log=log)
        producer.start()
        kafka.stop(kill=True)
        wait_for(lambda: status(config)["sinks"]["mirror"]["state"] == "waiting", WAITING_WITHIN_S,
                 "the mirror to wait for Kafka", alive=alive, log=log)
        held = status(config)["sinks"]["mirror"]["applied_phy"]
        wait_for(lambda: (status(config)["summary"]["safepoint"] or 0) > held + 50_000, 120,
                 "the safepoint to pass what the mirror has sent", alive=alive, log=log)
        during = status(config)
        assert during["sinks"]["mirror"]["applied_phy"] == held  # still waiting, and the tier went on
        assert during["summary"]["held_batches"] > 1 and during["summary"]["held_bytes"] > 0  # kept for it
        assert "mirror" in during["sinks"] and "kv" not in during["sinks"] and "changelog" not in during["sinks"]
        kafka.start()
        wait_for(lambda: status(config)["sinks"]["mirror"]["state"] == "ok", 120, "the mirror to send again",
                 alive=alive, log=log)
        stop.set()
        producer.join()
        end = status(config)["summary"]["commitlog_end_phy"]
        wait_for(lambda: status(config)["sinks"]["mirror"]["applied_phy"] == end, 300,
                 "the mirror to reach the end of the log", alive=alive, log=log)
    finally:
        stop.set()
        service.send_signal(signal.SIGTERM)
        code = service.wait(timeout=120)
    assert code == 0, log.read_text()[-3000:]
    assert end > during["summary"]["safepoint"] > held  # the producer appended through the outage
    assert_mirror_equals_oracle(conf, TOPICS)  # every message once, in order: none missing, extra or twice


def _changelog_caught_up(config) -> bool:
    """One ``status`` (a CLI process) per poll: the changelog has applied the whole commitlog."""
    now = status(config)
    return bool(now) and now["sinks"].get("changelog", {}).get("applied_phy") == now["summary"]["commitlog_end_phy"]


def _tail(path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(none)"


def wait_for(condition, timeout_s: float, what: str, alive=None, log=None) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        tail = f"; the service's log ends:\n{_tail(log)}" if log is not None else ""
        assert alive is None or alive(), f"the service exited while waiting for {what}{tail}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}{tail}"
        time.sleep(1)

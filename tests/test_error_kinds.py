"""Every kind of known error, as a person meets it from the command line: one plain paragraph that
names the file, offset, topic or setting and says what to do; the exit code of its kind
(``connectors.errors.EXIT_CODES``); no traceback.  The kinds a Spark run meets (corrupt input in a
query, a replica behind, a checkpoint of another configuration, files deleted before they were read)
are checked where those runs are: test_hostile_input, test_failover, test_checkpoints,
test_retention_outran, and test_service_cli (another service holding the metadata store)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from connectors.errors import EXIT_CODES, TierlogError
from tests.cli_runner import tierlog


def produce(log: Path, messages: int = 40, **env) -> None:
    r = tierlog("produce", "--commitlog-dir", str(log), "--messages", str(messages), "--body-size", "200", env=env)
    assert r.returncode == 0, r.stderr


def corrupt(tmp_path: Path) -> list[str]:
    log = tmp_path / "cl"
    produce(log)
    path = log / "00000000000000000000"
    data = bytearray(path.read_bytes())
    data[int.from_bytes(data[0:4], "big") + 100] ^= 0xFF  # in the second message's body
    path.write_bytes(bytes(data))
    return ["inspect", "--commitlog-dir", str(log)]


def deleted(tmp_path: Path) -> list[str]:
    log = tmp_path / "cl"
    produce(log, 3000, TIERLOG_COMMITLOG_FILE_SIZE="65536")
    os.remove(log / "00000000000000000000")
    return ["inspect", "--commitlog-dir", str(log), "--from-phy", "100"]


def writer_locked(tmp_path: Path) -> list[str]:
    from connectors.commitlog.writer import CommitLogWriter

    log = tmp_path / "cl"
    writer_locked.held = CommitLogWriter(str(log))  # held by this process while the command runs
    return ["produce", "--commitlog-dir", str(log), "--messages", "5"]


CASES = {
    "a bad setting": (lambda t: ["status"], {"TIERLOG_SPARK_TRIGGER_INTERVAL_S": "soon"}, 2,
                      ["spark.trigger_interval_s", "environment variable TIERLOG_SPARK_TRIGGER_INTERVAL_S"]),
    "a missing config file": (lambda t: ["status", "--config", "nope.toml"], {}, 2, ["nope.toml", "--config"]),
    "a mistyped command": (lambda t: ["kv", "gte"], {}, 2, ["did you mean get?"]),
    "a missing commitlog": (lambda t: ["run", "--commitlog-dir", str(t / "nowhere")], {}, 2,
                            ["does not exist", "tierlog produce", "store/commitlog"]),
    "a corrupt record": (corrupt, {}, 3, ["at physical offset", "CRC mismatch", "tierlog inspect --from-phy"]),
    # inspect names where to start; run's --on-missing advice is checked in test_retention_outran.
    "files deleted before they were read": (deleted, {}, 4, ["deleted before they were read",
                                                             "start at 65536, the first retained record"]),
    "a tier that is not there": (lambda t: ["key", "topic-0", "k"], {}, 1, ["holds nothing", "--config"]),
    "a KV view that is not there": (lambda t: ["kv", "get", "orders", "k"], {}, 1, ["no KV view", "--config"]),
    "an unreachable Kafka": (lambda t: ["config", "check"], {"TIERLOG_KAFKA_BOOTSTRAP": "127.0.0.1:1"}, 1,
                             ["kafka.bootstrap '127.0.0.1:1' is unreachable"]),
    "an unreachable S3 tier": (lambda t: ["config", "check"], {"TIERLOG_TIER_LOCATION": "s3://bucket/tier",
                                                              "AWS_ENDPOINT_URL_S3": "http://127.0.0.1:1",
                                                              "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
                                                              "AWS_DEFAULT_REGION": "us-east-1"}, 1,
                               ["tier.location"]),
    "another producer's writer lock": (writer_locked, {}, 75, ["already open for writing", "Stop the other producer"]),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_each_known_error_is_one_plain_paragraph_with_its_exit_code(tmp_path, kind):
    setup, env, code, says = CASES[kind]
    argv = setup(tmp_path)
    try:
        r = tierlog(*argv, cwd=tmp_path, env=env, timeout=120)
    finally:
        for held in (getattr(setup, "held", None),):
            if held is not None:
                held.close()
                del setup.held
    errors = [line for line in r.stderr.splitlines() if line.startswith("tierlog")]
    assert r.returncode == code, (kind, r.returncode, r.stderr[-2000:])
    assert code in EXIT_CODES and "Traceback" not in r.stderr + r.stdout
    assert errors, r.stderr[-2000:]
    for text in says:
        assert any(text in line for line in errors), (kind, text, errors)


def test_a_python_failure_inside_a_spark_query_is_named_by_its_exception_not_by_the_trace():
    """What a query's failure says when the error is not one of tierlog's: Spark's line, then the
    exception Python's trace ends with, never "Traceback (most recent call last):"."""
    from streaming.service import _root_cause

    text = ("[PYTHON_STREAMING_DATA_SOURCE_RUNTIME_ERROR] Failed when Python streaming data source perform "
            "latestOffset: Traceback (most recent call last):\n"
            '  File "/work/streaming/feed_source.py", line 67, in batch_ends\n'
            "    self.db.try_catch_up_with_primary()\n"
            "Exception: IO error: No such file or directory: MANIFEST-000012\n"
            "\tat org.apache.spark.sql.execution.python.PythonStreamingSourceRunner.latestOffset(...)\n")
    message, kind = _root_cause(text)
    assert message == ("[PYTHON_STREAMING_DATA_SOURCE_RUNTIME_ERROR] Failed when Python streaming data source "
                       "perform latestOffset: Exception: IO error: No such file or directory: MANIFEST-000012")
    assert kind is TierlogError

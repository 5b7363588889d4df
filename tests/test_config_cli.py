"""Configuration layering and the CLI commands of the foundation (produce, inspect, config)."""

from __future__ import annotations

import base64
import io
import json

import pytest

from connectors.errors import ConfigError
from streaming import cli
from streaming.cli.output import emit
from streaming.cli.parser import build_parser
from streaming import config as cfg
from tests.cli_runner import tierlog
from tests.oracle import replay


def test_layers_override_in_order(tmp_path):
    file = tmp_path / "t.toml"
    file.write_text('[commitlog]\ndir = "from-file"\nfile_size = "64MiB"\n[tier]\nlocation = "file-tier"\n')
    env = {"TIERLOG_TIER_LOCATION": "env-tier", "TIERLOG_SOURCE_MAX_RECORDS_PER_TRIGGER": "500"}
    conf = cfg.load(str(file), env=env, overrides={"tier.location": "flag-tier"})
    assert conf.commitlog.dir == "from-file" and conf.commitlog.file_size == 64 << 20
    assert conf.tier.location == "flag-tier" and conf.source.max_records_per_trigger == 500
    assert cfg.load(None, env={}).commitlog.dir == "data/commitlog"


@pytest.mark.parametrize(
    "toml,env,match",
    [
        ('[commitlog]\nfile_size = "big"\n', {}, r"commitlog\.file_size \(from .*t\.toml\): expected a whole number"),
        ("[commitlog]\nbogus = 1\n", {}, r"unknown setting commitlog\.bogus"),
        ("[nosuch]\nx = 1\n", {}, r"unknown section \[nosuch\]"),
        ("[tier]\ncompact_every = 5\n", {}, r"tier\.compact_every \(from .*t\.toml\) is now tier\.fold_every"),
        ("", {"TIERLOG_TIER_COMPACT_EVERY": "5"}, r"tier\.compact_every \(from environment .*is now tier\.fold_every"),
        ("commitlog = 3\n", {}, r"`commitlog` must be a \[section\] table"),
        ("[commitlog\n", {}, "not valid TOML"),
        ("", {"TIERLOG_COMMITLOG_CHECK_CRC": "perhaps"}, r"commitlog\.check_crc \(from environment variable"),
        ("", {"TIERLOG_WHATEVER": "1"}, "TIERLOG_WHATEVER is not a tierlog setting"),
        ("", {"TIERLOG_COMMITLOG_FSYNC": "weekly"}, "must be one of always, interval, never"),
        ("", {"TIERLOG_SOURCE_PARTITION_BYTES": "-5"}, "must not be negative"),
    ],
)
def test_bad_settings_are_named(tmp_path, toml, env, match):
    file = tmp_path / "t.toml"
    file.write_text(toml)
    with pytest.raises(ConfigError, match=match):
        cfg.load(str(file), env=env)


def test_a_deprecated_name_still_sets_its_new_setting_and_says_so(tmp_path, caplog):
    file = tmp_path / "t.toml"
    file.write_text("[tier]\ncheckpoint_every = 7\n")
    with caplog.at_level("WARNING", logger="tierlog.config"):
        assert cfg.load(str(file), env={}).tier.fold_every == 7
        assert cfg.load(None, env={"TIERLOG_TIER_CHECKPOINT_EVERY": "9"}).tier.fold_every == 9
    assert [r.getMessage() for r in caplog.records] == [
        f"setting tier.checkpoint_every (from {file}) is now tier.fold_every: it still works, rename it there",
        "setting tier.checkpoint_every (from environment variable TIERLOG_TIER_CHECKPOINT_EVERY) is now "
        "tier.fold_every: it still works, rename it there"]


def test_every_setting_is_documented_and_shown():
    text = cfg.to_toml(cfg.Config())
    for name, _type, _default, doc in cfg.settings_reference():
        assert doc and doc.endswith("."), name
        assert f"\n{name.split('.')[1]} = " in text
    assert cfg.load(None, env={}) == cfg.Config()


def test_produce_then_inspect_round_trips_through_json(tmp_path):
    log = str(tmp_path / "cl")
    r = tierlog("produce", "--commitlog-dir", log, "--messages", "300", "--topics", "3", "--queues", "2",
                "--keys", "20", "--body-size", "64", "--delete-ratio", "0.2", "--format", "json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["messages"] == 300
    r = tierlog("inspect", "--commitlog-dir", log, "--limit", "1000", "--format", "json")
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    oracle = replay(log)
    assert len(rows) == 300 == len(oracle)
    for row, exp in zip(rows, oracle):
        assert base64.b64decode(row["body"]) == exp["body"]
        assert {k: row[k] for k in ("phy_offset", "queue_offset", "key", "op", "properties")} == {
            k: exp[k] for k in ("phy_offset", "queue_offset", "key", "op", "properties")
        }
    deletes = [r for r in oracle if r["op"] == "delete"]
    assert 20 < len(deletes) < 100 and all(r["body"] == b"" for r in deletes)
    assert len({r["topic"] for r in oracle}) == 3 and summary["end_phy"] == oracle[-1]["phy_offset"] + oracle[-1]["size"]


def test_inspect_from_queue_offset(tmp_path):
    log = str(tmp_path / "cl")
    assert tierlog("produce", "--commitlog-dir", log, "--messages", "200", "--topics", "1", "--queues", "2").returncode == 0
    r = tierlog("inspect", "--commitlog-dir", log, "--topic", "topic-0", "--queue", "1",
                "--from-queue-offset", "10", "--limit", "3", "--format", "json")
    assert [json.loads(x)["queue_offset"] for x in r.stdout.splitlines()] == [10, 11, 12]


def test_produce_from_stdin(tmp_path):
    log = str(tmp_path / "cl")
    lines = "\n".join([
        json.dumps({"topic": "orders", "queue_id": 1, "body": "hello", "keys": "o-1", "tags": "new"}),
        json.dumps({"topic": "orders", "queue_id": 1, "body_b64": base64.b64encode(b"\x00\xff").decode(),
                    "properties": {"KV_OP": "DELETE", "KEYS": "o-1"}}),
    ])
    assert tierlog("produce", "--stdin", "--commitlog-dir", log, stdin=lines).returncode == 0
    rows = replay(log)
    assert [(r["body"], r["key"], r["tags"], r["op"], r["queue_offset"]) for r in rows] == [
        (b"hello", "o-1", "new", "put", 0), (b"\x00\xff", "o-1", None, "delete", 1),
    ]
    r = tierlog("produce", "--stdin", "--commitlog-dir", log, stdin='{"queue_id": 1}\n')
    assert r.returncode == 2 and "stdin line 1" in r.stderr


def test_errors_are_one_line_with_exit_codes(tmp_path):
    r = tierlog("inspect", "--commitlog-dir", str(tmp_path / "none"))
    assert r.returncode == 2 and r.stderr.strip().startswith("tierlog: error: commitlog.dir")
    r = tierlog("config", "show", "--config", str(tmp_path / "missing.toml"))
    assert r.returncode == 2 and "missing.toml" in r.stderr and "--config" in r.stderr
    (tmp_path / "afile").write_text("")
    (tmp_path / "tierlog.toml").write_text('[kafka]\nbootstrap = "127.0.0.1:1"\n[commitlog]\ndir = "afile/log"\n')
    r = tierlog("config", "check", cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 2
    assert any("kafka.bootstrap" in x and "unreachable" in x for x in lines)
    assert any("commitlog.dir" in x for x in lines)


@pytest.mark.parametrize("command", [["status"], ["config", "check"], ["key", "orders", "k"]])
@pytest.mark.parametrize("toml,setting,bad", [
    ('[compaction]\nttl = "sessions=soon"\n', "compaction.ttl", "'soon'"),
    ('[commitlog]\nlocal_retention = "a while"\n', "commitlog.local_retention", "'a while'"),
    ('[tier]\nretention = "7d"\n', "tier.retention", "TOPIC=DURATION"),
    ('[tier]\nretention_bytes = "*=lots"\n', "tier.retention_bytes", "TOPIC=SIZE"),
    ('[topics]\nmirror = "business,weird"\n', "topics.mirror", "'weird'"),
])
def test_every_value_is_checked_at_load_naming_its_source(tmp_path, command, toml, setting, bad):
    """Whatever the command, a bad value stops it at load with exit 2, naming the setting and the file."""
    (tmp_path / "tierlog.toml").write_text(toml)
    r = tierlog(*command, cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, lines)
    assert setting in lines[0] and bad in lines[0] and "(from tierlog.toml)" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tierlog.toml"]  # nothing created


def test_corrupt_log_makes_inspect_fail_with_file_and_offset(tmp_path):
    log = tmp_path / "cl"
    assert tierlog("produce", "--commitlog-dir", str(log), "--messages", "20", "--body-size", "50").returncode == 0
    path = log / "00000000000000000000"
    data = bytearray(path.read_bytes())
    second = int.from_bytes(data[0:4], "big")
    data[second + 100] ^= 0xFF  # inside the second message's body
    path.write_bytes(bytes(data))
    r = tierlog("inspect", "--commitlog-dir", str(log))
    assert r.returncode == 3  # corrupt input: its own exit code
    assert f"{path} at physical offset {second}" in r.stderr and "CRC mismatch" in r.stderr


@pytest.mark.parametrize("command", [[], ["produce"], ["inspect"], ["config"]])
def test_help_explains_every_command(command, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([*command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "usage: tierlog" in out and len(out.splitlines()) > 8


def test_table_output_aligns_columns():
    out = io.StringIO()
    emit([{"a": 1, "b": b"xyz"}, {"a": 22, "b": None}], "table", out=out)
    assert out.getvalue().splitlines() == ["a   b", "1   xyz", "22  -"]


def test_the_docs_document_every_setting_and_command():
    docs = __import__("pathlib").Path(__file__).parents[1] / "docs"
    reference = (docs / "configuration.md").read_text()
    for name, _type, _default, _doc in cfg.settings_reference():
        assert f"`{name}`" in reference, f"docs/configuration.md misses {name}"
    commands = build_parser()._subparsers._group_actions[0].choices
    cli_reference = (docs / "cli.md").read_text()
    for command in commands:
        assert f"`tierlog {command}" in cli_reference, f"docs/cli.md misses `tierlog {command}`"


def a_commitlog(directory) -> None:
    """A commitlog of one record in ``directory``: `config check` finds an empty one wrong."""
    from connectors.commitlog.format import Message
    from connectors.commitlog.writer import CommitLogWriter

    with CommitLogWriter(str(directory), fsync="never") as writer:
        writer.append(Message(topic="t", queue_id=0, body=b"x"))


def test_kafka_settings_are_checked_one_line_each(tmp_path):
    a_commitlog(tmp_path / "data" / "commitlog")
    (tmp_path / "tierlog.toml").write_text(
        '[kafka]\nbootstrap = "127.0.0.1:1"\ncompression = "snappy"\nsecurity_protocol = "SASL_SSL"\n'
        'mirror_topic_map = "orders"\n[compaction]\nenabled = false\n')
    r = tierlog("config", "check", cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 5, lines
    for setting in ("kafka.bootstrap", "kafka.compression", "kafka.changelog", "kafka.security_protocol",
                    "kafka.mirror_topic_map"):
        assert sum(setting in line for line in lines) >= 1, (setting, lines)


def test_the_kafka_password_never_shows(tmp_path):
    from streaming.settings import kafka_settings

    env = {"TIERLOG_KAFKA_BOOTSTRAP": "127.0.0.1:1", "TIERLOG_KAFKA_SASL_PASSWORD": "canary-5ecret"}
    conf = cfg.load(env=env)
    assert conf.kafka.sasl_password == "canary-5ecret"
    for text in (repr(conf), cfg.to_toml(conf), repr(kafka_settings(conf))):
        assert "canary-5ecret" not in text
    r = tierlog("config", "show", cwd=tmp_path, env=env)
    assert r.returncode == 0 and "canary-5ecret" not in r.stdout + r.stderr and "****" in r.stdout


@pytest.mark.parametrize("toml,code,setting", [
    ('[commitlog]\nfile_size = "big"\n', 2, "commitlog.file_size"),  # a type error
    ('[tier]\nsegment_mesages = 5\n', 2, "tier.segment_mesages"),  # an unknown key
    ('[spark]\ntrigger_interval_s = "soon"\n', 2, "spark.trigger_interval_s"),
    ('[state]\ndir = "afile/state"\n', 1, "state.dir"),  # a path that cannot be created
    ('[checkpoint]\ndir = "afile/checkpoints"\n', 1, "checkpoint.dir"),
    ('[tier]\nlocation = "s3://no-such-bucket-here/tier"\n', 1, "no-such-bucket-here"),  # a missing bucket
    ('[kafka]\nbootstrap = "no-port-here"\n', 1, "kafka.bootstrap"),  # a malformed bootstrap
    ('[kafka]\nbootstrap = "127.0.0.1:1"\n', 75, "kafka.bootstrap"),  # an unreachable one: away, not wrong
    ('[metrics]\nport = 70000\n', 1, "metrics.port"),
])
def test_config_check_names_each_invalid_setting_in_one_line(tmp_path, s3_endpoint, toml, code, setting):
    (tmp_path / "afile").write_text("")
    a_commitlog(tmp_path / "commitlog")
    (tmp_path / "tierlog.toml").write_text(f'[commitlog]\ndir = "commitlog"\n{toml}'.replace(
        '[commitlog]\ndir = "commitlog"\n[commitlog]\n', '[commitlog]\ndir = "commitlog"\n'))
    r = tierlog("config", "check", cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code and len(lines) == 1, (r.returncode, lines)
    assert setting in lines[0], lines


@pytest.mark.parametrize("missing, says", [("mvn", "dev: Maven not found"), ("javac", "dev: javac not found")])
def test_dev_says_in_one_line_what_the_tests_java_parts_lack(tmp_path, missing, says):
    """``./dev test`` needs Maven and a JDK for the brokers it starts; without one it stops at once."""
    import os
    import shutil
    import subprocess
    import sys

    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").symlink_to(os.path.realpath(sys.executable))  # not a version manager's shim
    for tool in ("bash", "java", "javac", "mvn", "sha1sum", "cat", "cut", "dirname", "basename", "sed", "head"):
        if tool != missing and shutil.which(tool):
            (bindir / tool).symlink_to(shutil.which(tool))
    root = __import__("pathlib").Path(__file__).parents[1]
    result = subprocess.run([shutil.which("bash"), str(root / "dev"), "setup"], env={"PATH": str(bindir), "HOME": str(tmp_path)},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith(says), result.stderr

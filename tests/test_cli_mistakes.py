"""The mistakes people make on their first day, and what tierlog says to each: one plain line that
says what is wrong and what to do, the exit code of its kind, no traceback, and nothing created.

A wrong topic used to succeed quietly ("0 message(s)"), a read command without --config created an
empty tier, and argparse named its internal destinations (`argument kv_command`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.cli_runner import tierlog

pytestmark = pytest.mark.xdist_group("cli-mistakes")  # one worker tiers the small log once


def tree(root: Path) -> set[str]:
    """Every path under ``root``, but RocksDB's info logs, which even a read-only open rotates."""
    return {str(p.relative_to(root)) for p in root.rglob("*") if not p.name.startswith("LOG")}


@pytest.fixture(scope="module")
def tiered(tmp_path_factory) -> Path:
    """A directory with a tierlog.toml whose tier, KV view and metadata hold topics topic-0, topic-1."""
    root = tmp_path_factory.mktemp("tiered")
    (root / "tierlog.toml").write_text('[spark]\nshuffle_partitions = 2\n')
    produced = tierlog("produce", "--messages", "400", "--topics", "2", "--keys", "50", cwd=root)
    assert produced.returncode == 0, produced.stderr[-2000:]
    ran = tierlog("run", "--until-caught-up", cwd=root)
    assert ran.returncode == 0, ran.stderr[-3000:]
    return root


TOPIC_LIST = "topics: topic-0, topic-1"

# (argv, exit code, what the one line must say) on the tiered directory
ON_A_TIER = [
    (["key", "orders", "order-42"], 1, ["no topic 'orders' in the tier", TOPIC_LIST]),
    (["queues", "--topic", "orders"], 1, ["no topic 'orders' in the tier", TOPIC_LIST]),
    (["get", "orders", "0", "0"], 1, ["no topic 'orders' in the tier", TOPIC_LIST]),
    (["offset-for-time", "orders", "0", "0"], 1, ["no topic 'orders' in the tier", TOPIC_LIST]),
    (["kv", "get", "orders", "k"], 1, ["no topic 'orders' in the KV view", TOPIC_LIST]),
    (["kv", "scan", "orders"], 1, ["no topic 'orders' in the KV view", TOPIC_LIST]),
    (["status", "--topic", "orders"], 1, ["no topic 'orders' in the metadata store", TOPIC_LIST]),
    (["get", "topic-0", "99", "0"], 1, ["has no queue topic-0/99", "tierlog queues --topic topic-0"]),
    (["kv", "gte", "topic-0", "k"], 2, ["'gte' is not a command of `tierlog kv`", "did you mean get?",
                                        "get, scan, history, snapshot or rebuild"]),
    (["config"], 2, ["`tierlog config` needs a command (show or check)"]),
    (["sttus"], 2, ["'sttus' is not a command of `tierlog`", "did you mean status?"]),
    (["key", "topic-0", "k", "--since", "yesterday"], 2, ["time 'yesterday'", "ISO 8601"]),
]

# the same commands where nothing was ever run: no tierlog.toml, the defaults point at data/
IN_AN_EMPTY_DIRECTORY = [
    (["key", "topic-0", "k"], 1, ["the tier at 'data/tier' (tier.location, the default) holds nothing",
                                  "--config data/demo/tierlog.toml"]),
    (["queues"], 1, ["holds nothing", "--config"]),
    (["kv", "get", "topic-0", "k"], 1, ["no KV view at data/state/kv (under state.dir, the default;", "--config"]),
    (["status"], 1, ["no metadata store at data/state/metadata", "--config"]),
    (["commitlog", "gc", "--dry-run"], 1, ["no metadata store", "--config"]),
    (["status", "--config", "missing.toml"], 2, ["config file 'missing.toml' (--config) does not exist"]),
]


def assert_one_plain_line(result, code: int, says: list[str]) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == code, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr + result.stdout
    assert len(lines) == 1 and lines[0].startswith("tierlog"), lines
    for text in says:
        assert text in lines[0], (text, lines[0])


@pytest.mark.parametrize("argv,code,says", ON_A_TIER, ids=[" ".join(a) for a, _, _ in ON_A_TIER])
def test_a_mistake_on_a_tier_gets_one_line_and_changes_nothing(tiered, argv, code, says):
    before = tree(tiered)
    assert_one_plain_line(tierlog(*argv, cwd=tiered), code, says)
    assert tree(tiered) == before


@pytest.mark.parametrize("argv,code,says", IN_AN_EMPTY_DIRECTORY,
                         ids=[" ".join(a) for a, _, _ in IN_AN_EMPTY_DIRECTORY])
def test_a_read_where_nothing_ran_says_where_and_creates_nothing(tmp_path, argv, code, says):
    assert_one_plain_line(tierlog(*argv, cwd=tmp_path), code, says)
    assert os.listdir(tmp_path) == []


def test_a_bad_value_in_the_environment_names_the_variable(tmp_path):
    r = tierlog("status", cwd=tmp_path, env={"TIERLOG_TIER_RETENTION": "7d"})
    assert_one_plain_line(r, 2, ["tier.retention", "environment variable TIERLOG_TIER_RETENTION",
                                 "TOPIC=DURATION"])
    assert os.listdir(tmp_path) == []


def test_the_right_topic_still_reads(tiered):
    """The checks above cost a bucket read: the real topic still answers, in one command each."""
    for argv in (["queues", "--topic", "topic-0"], ["key", "topic-0", "key-00000001"], ["kv", "scan", "topic-1"],
                 ["status", "--topic", "topic-1"]):
        r = tierlog(*argv, cwd=tiered)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (argv, r.stderr[-2000:])
        assert r.stdout.strip(), argv


def test_binary_bodies_show_as_base64_and_text_as_text(tiered, tmp_path):
    """The synthetic workload's bodies are random bytes after a "N:" prefix: base64 in a table."""
    r = tierlog("get", "topic-0", "0", "0", "--max", "2", cwd=tiered)
    assert r.returncode == 0 and "base64:" in r.stdout
    log = tmp_path / "log"
    stdin = '{"topic": "notes", "queue_id": 0, "body": "hello\\tworld", "keys": "n1"}\n'
    assert tierlog("produce", "--stdin", "--commitlog-dir", str(log), stdin=stdin).returncode == 0
    shown = tierlog("inspect", "--commitlog-dir", str(log))
    assert shown.returncode == 0 and "hello\\tworld" in shown.stdout and "base64:" not in shown.stdout

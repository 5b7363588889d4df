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
    produced = tierlog("produce", "--messages", "400", "--topics", "2", "--keys", "50", "--delete-ratio", "0.2",
                       cwd=root)
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
    # An offset inside a record, below 0, or past the data: a usage error that says where records are,
    # not "corrupt", not "retention outran", not the file's size.
    (["inspect", "--from-phy", "7"], 2, ["--from-phy 7 is inside the record that starts at 0", "give one of those"]),
    (["inspect", "--from-phy", "-5"], 2, ["--from-phy: -5 is below 0"]),
    (["inspect", "--from-phy", "999999999999"], 2, ["past the end of the commitlog's data, at"]),
    (["get", "topic-0", "0", "0", "--broker", "broker-x"], 1, ["no broker 'broker-x'", "brokers: broker-a"]),
    (["kv", "get", "topic-0", "k", "--as-of", "now", "--broker", "broker-x"], 1, ["no broker 'broker-x'"]),
    (["get", "topic-0", "0", "-1"], 2, ["OFFSET: -1 is below 0"]),
    (["kv", "history", "topic-0", "key-00000001", "--from", "2026-12-07T10:00:00Z", "--to", "2026-12-07T09:00:00Z"],
     2, ["the window ends before it starts"]),
    (["kv", "get", "topic-0", "key-00000001", "--as-of", "2999-01-01T00:00:00Z"], 2,
     ["is in the future", "the tier answers up to now"]),
    (["key", "topic-0", "k", "--since", "1796600000"], 2, ["looks like epoch seconds", "1796600000000"]),
    (["queues", "--limit", "-1"], 2, ["--limit: -1 is below 1"]),
    (["status", "--limit", "-1"], 2, ["--limit: -1 is below 1"]),
    (["get", "topic-0", "0", "0", "--max", "-3"], 2, ["--max: -3 is below 1"]),
    (["get", "topic-0", "0", "0", "--max", "0"], 2, ["--max: 0 is below 1"]),
    (["kv", "scan", "topic-0", "--limit", "-1"], 2, ["--limit: -1 is below 0"]),
    (["get", "topic-0", "0", "0", "--format", "csv"], 2, ["--format 'csv' is not one of its choices: table or json",
                                                          "`tierlog get --help` explains"]),
    (["status", "--limt", "3"], 2, ["`tierlog status` takes no '--limt 3' (did you mean --limit?)",
                                    "`tierlog status --help` explains"]),
    # Another tier under an existing checkpoint: refused before the JVM starts or a store opens, so
    # nothing is rewritten and the other tier is not made (the tree is compared).
    (["run", "--tier", "other-tier"], 2, ["was made with tier.location", "other-tier"]),
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
    (["table", "info"], 1, ["the tier at 'data/tier' (tier.location, the default) holds nothing"]),
    (["table", "rebuild"], 1, ["holds nothing"]),
    (["run", "--until-caught-up"], 2, ["commitlog.dir 'data/commitlog' does not exist",
                                       "point it at the broker's store/commitlog"]),
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


def test_a_deleted_key_says_which_message_deleted_it_without_as_of(tiered):
    """`kv get` of a deleted key names the delete, as `--as-of now` does, and not "is not in topic"."""
    from state.kv import KVView

    with KVView(str(tiered / "data" / "state" / "kv"), read_only=True) as kv:
        deleted = next(k for t, k in ((t, f"key-{i:08d}") for t in ("topic-0",) for i in range(50))
                       if kv.tombstone(t, k) is not None)
        _, phy, _ = kv.tombstone("topic-0", deleted)
    r = tierlog("kv", "get", "topic-0", deleted, cwd=tiered)
    assert_one_plain_line(r, 1, [f"key {deleted!r} of topic 'topic-0' has no value: deleted by the message",
                                 f"at physical offset {phy}"])
    assert "is not in topic" not in r.stderr
    as_of = tierlog("kv", "get", "topic-0", deleted, "--as-of", "now", cwd=tiered)
    assert as_of.returncode == 1 and f"physical offset {phy}" in as_of.stderr


@pytest.mark.parametrize("layout,says", [
    ("missing", "does not exist: point it at the broker's store/commitlog"),
    ("empty", "holds no commitlog files (files named by their 20-digit offset"),
    ("store", "it looks like a broker's store/; point commitlog.dir at"),
])
def test_config_check_finds_a_commitlog_dir_that_holds_no_log(tmp_path, layout, says):
    """`config check` reaches the commitlog directory: a missing one, an empty one, and a broker's
    store/ (the parent of commitlog/) are each a problem named in one line; none is created."""
    target = tmp_path / "store"
    if layout != "missing":
        target.mkdir()
    if layout == "store":
        (target / "commitlog").mkdir()
    before = tree(tmp_path)
    r = tierlog("config", "check", "--commitlog-dir", str(target), cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and "Traceback" not in r.stderr and len(lines) == 1, lines
    assert "commitlog.dir" in lines[0] and says in lines[0], lines
    assert "configuration OK" not in r.stdout
    assert tree(tmp_path) == before


def test_config_check_finds_a_tier_it_cannot_write(tmp_path):
    """An unwritable tier is named, whatever the permission bits say to root (a file stands where
    the tier's parent directory would be made)."""
    (tmp_path / "afile").write_text("")
    r = tierlog("config", "check", "--tier", str(tmp_path / "afile" / "tier"), cwd=tmp_path)
    assert r.returncode == 1 and "tier.location" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "configuration OK" not in r.stdout


def test_a_read_against_an_s3_endpoint_that_refuses_fails_within_seconds_naming_it(tmp_path):
    """A person's read command gives up in seconds (the service's own retries stay long), exits 75
    and names the endpoint; `config check` does the same."""
    import time

    env = {"AWS_ENDPOINT_URL_S3": "http://127.0.0.1:1", "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y",
           "AWS_REGION": "us-east-1"}
    for argv in (["queues", "--tier", "s3://bucket/tier"], ["config", "check", "--tier", "s3://bucket/tier"]):
        t0 = time.monotonic()
        r = tierlog(*argv, cwd=tmp_path, env=env)
        took = time.monotonic() - t0
        assert took < 30, (argv, took)
        assert "http://127.0.0.1:1" in r.stderr and "Traceback" not in r.stderr, r.stderr
        if argv[0] == "queues":
            assert_one_plain_line(r, 75, ["endpoint unreachable, http://127.0.0.1:1"])
    assert os.listdir(tmp_path) == []

"""``tierlog kv`` from the command line: get, scan, snapshot and rebuild, checked against the oracle."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

from streaming import config as cfg
from streaming.settings import derive
from tests.cli_runner import tierlog
from tests.kv_helpers import append, kv_messages, snapshot_contents, view_contents
from tests.oracle import latest_per_key


def write_config(tmp_path: Path, compaction: bool = True) -> Path:
    path = tmp_path / "tierlog.toml"
    path.write_text(f"""
[commitlog]
dir = "{tmp_path / 'commitlog'}"
[tier]
location = "{tmp_path / 'tier'}"
segment_messages = 200
[state]
dir = "{tmp_path / 'state'}"
[checkpoint]
dir = "{tmp_path / 'checkpoints'}"
[compaction]
enabled = {str(compaction).lower()}
snapshot_interval_s = 0
""")
    return path


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_get_scan_snapshot_and_rebuild(tmp_path):
    config = write_config(tmp_path)
    conf = cfg.load(str(config), env={})
    append(conf, kv_messages(3000, keys=400, seed=11))
    r = tierlog("run", "--until-caught-up", "--config", str(config))
    assert r.returncode == 0, r.stderr[-3000:]
    expected = latest_per_key(conf.commitlog.dir)

    (topic, key), value = next(iter(expected.items()))
    got = json_lines(tierlog("kv", "get", topic, key, "--format", "json", "--config", str(config)).stdout)
    assert len(got) == 1 and base64.b64decode(got[0]["body"]) == value["body"]
    assert got[0]["phy_offset"] == value["phy_offset"]
    missing = tierlog("kv", "get", topic, "no-such-key", "--config", str(config))
    assert missing.returncode == 1 and "no-such-key" in missing.stderr

    scanned = json_lines(tierlog("kv", "scan", "t1", "--prefix", "k00001", "--format", "json",
                                 "--config", str(config)).stdout)
    want = sorted(k for t, k in expected if t == "t1" and k.startswith("k00001"))
    assert [row["key"] for row in scanned] == want and want

    r = tierlog("kv", "snapshot", "--format", "json", "--config", str(config))
    assert r.returncode == 0, r.stderr[-2000:]
    snap, through = snapshot_contents(conf)
    assert snap == expected and json_lines(r.stdout)[0]["keys"] == len(expected)

    # More messages after the snapshot; tiering only, so the view falls behind.
    tiering_only = write_config(tmp_path, compaction=False)
    append(conf, kv_messages(1000, keys=400, seed=12))
    assert tierlog("run", "--until-caught-up", "--config", str(tiering_only)).returncode == 0
    expected = latest_per_key(conf.commitlog.dir)
    assert view_contents(conf) != expected

    for source in ("snapshot", "tier", "commitlog"):
        shutil.rmtree(derive(conf).paths.kv)
        r = tierlog("kv", "rebuild", "--from", source, "--format", "json", "--config", str(config))
        assert r.returncode == 0, r.stderr[-2000:]
        report = json_lines(r.stdout)[0]
        assert view_contents(conf) == expected, source
        if source == "snapshot":
            assert report["snapshot_keys"] > 0 and through is not None


def test_kv_commands_explain_a_missing_view(tmp_path):
    config = write_config(tmp_path)
    r = tierlog("kv", "get", "t", "k", "--config", str(config))
    assert r.returncode == 1 and "no KV view" in r.stderr and "compaction" in r.stderr

"""Every command a newcomer copies runs as printed: each fenced shell and Python block of the README
and of docs/*.md, and each line `tierlog demo` prints under "Try next", against a real demo tier.

A block that cannot run here (Docker Compose, a Spark cluster, a service outside this machine) says so
on the line before it: ``<!-- docs-test: skip (the reason) -->``.  The blocks run from the directory
the demo ran in, as a user who ran ``./dev demo`` and activated ``.venv`` would run them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_runner import ROOT, cli_env, tierlog

pytestmark = pytest.mark.xdist_group("docs")  # one worker builds the demo once for every block

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SKIP = re.compile(r"<!-- docs-test: skip \((.+)\) -->\s*$")
RUNNABLE = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python"}
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def fenced_blocks():
    for path in DOCS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            kind = RUNNABLE.get(m.group(1))
            if kind is None:
                continue
            line = text.count("\n", 0, m.start()) + 1
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            skip = SKIP.search(before)
            marks = [pytest.mark.skip(reason=f"{path.name}:{line}: {skip.group(1)}")] if skip else []
            yield pytest.param(kind, m.group(2), id=f"{path.relative_to(ROOT)}:{line}", marks=marks)


def run_block(kind: str, code: str, cwd: Path) -> subprocess.CompletedProcess:
    argv = ["bash", "-euo", "pipefail", "-c", code] if kind == "bash" else [sys.executable, "-c", code]
    return subprocess.run(argv, cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=300)


def demo(root: Path, *args: str) -> list[str]:
    """Run `tierlog demo` in ``root`` (so it writes ``data/demo`` there); its "Try next" commands."""
    root.mkdir(parents=True, exist_ok=True)
    r = tierlog("demo", *args, cwd=root, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.split("Try next", 1)[1].splitlines()[1:]
    commands = [x.strip() for x in lines if x.startswith("  ") and not x.startswith("  (")]
    assert len(commands) >= 7, r.stdout
    return commands


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory):
    """A user's directory after `tierlog demo` at its default size; the Try-next lines it printed."""
    root = tmp_path_factory.mktemp("newcomer")
    return root, demo(root)


@pytest.mark.parametrize("kind,code", list(fenced_blocks()))
def test_every_fenced_block_runs_as_printed(demo_root, kind, code):
    root, _ = demo_root
    r = run_block(kind, code, root)
    assert r.returncode == 0 and "Traceback" not in r.stderr, f"stdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-3000:]}"


def test_the_demos_try_next_lines_run_as_printed(demo_root):
    root, commands = demo_root
    assert any("duckdb" in c for c in commands) and any("pyarrow" in c for c in commands)  # 50,000: sealed
    for command in commands:
        r = run_block("bash", command, root)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (command, r.stderr[-3000:])
        assert r.stdout.strip(), command  # each shows something


def test_the_demos_table_queries_return_the_ledgers_counts(demo_root):
    """The demo's DuckDB lines over topic-0's Iceberg tables print, per queue, the messages the
    commitlog holds below the queue's committed offset (sealed or not: the tables take every
    committed message within seconds), and the keys live in the compacted snapshot
    the latest-per-key table holds (the commitlog replayed to that snapshot's physical offset)."""
    import json

    from connectors.tier.reader import TierReader
    from tests.oracle import entered_a_queue, message_row, view_fields, written_messages

    root, commands = demo_root
    demo_dir = root / "data" / "demo"
    scans = [c for c in commands if "iceberg_scan" in c and "orders" not in c]
    assert len(scans) == 2, commands
    outputs = [run_block("bash", c, root) for c in scans]
    assert all(r.returncode == 0 for r in outputs), [r.stderr[-2000:] for r in outputs]
    data_row = re.compile(r"^│\s*(\d+)\s*│\s*(\d+)?")  # DuckDB's box: the header and type lines hold letters
    numbers = [[[int(n) for n in m.groups() if n] for m in map(data_row.match, r.stdout.splitlines()) if m]
               for r in outputs]
    messages, latest = (numbers[0], numbers[1]) if "messages" in outputs[0].stdout else (numbers[1], numbers[0])
    written = written_messages(str(demo_dir / "commitlog"))
    states = TierReader(str(demo_dir / "tier")).committed().queue_states()
    want = {}
    for m in written:
        row = message_row(m)
        if row["topic"] == "topic-0" and entered_a_queue(row) and row["queue_offset"] < states[("topic-0", row["queue_id"])].commit:
            want[row["queue_id"]] = want.get(row["queue_id"], 0) + 1
    assert {q: n for q, n in (r[:2] for r in messages if len(r) >= 2)} == want and want
    info = tierlog("table", "info", "--format", "json", "--config", str(demo_dir / "tierlog.toml"), cwd=root)
    through = next(json.loads(x)["through_phy"] for x in info.stdout.splitlines()
                   if json.loads(x)["kind"] == "latest" and json.loads(x)["topic"] == "topic-0")
    keys = {}
    for m in written:
        if m.topic == "topic-0" and m.key("KEYS") is not None and m.dispatched and m.phy_offset < through:
            keys[m.key("KEYS")] = view_fields(m)["deleted"]
    assert latest[0][0] == sum(1 for deleted in keys.values() if not deleted) > 0, (latest, len(keys))


def test_the_demos_typed_query_counts_what_the_standard_library_parses_in_the_ledger(demo_root):
    """orders-0's bodies are JSON: the demo's SQL over its typed columns (``where amount > 100 and
    paid``) counts the committed orders whose body, parsed by the standard library, says so."""
    import json

    from connectors.tier.reader import TierReader
    from tests.oracle import entered_a_queue, message_row, written_messages

    root, commands = demo_root
    demo_dir = root / "data" / "demo"
    [query] = [c for c in commands if "iceberg_scan" in c and "orders" in c]
    r = run_block("bash", query, root)
    assert r.returncode == 0, r.stderr[-2000:]
    [got] = [[float(n) for n in m.groups() if n] for m in map(re.compile(r"^│\s*(\d+)\s*│\s*([\d.]+)\s*│\s*(\d+)").match,
                                                              r.stdout.splitlines()) if m]
    states = TierReader(str(demo_dir / "tier")).committed().queue_states()
    count = total = coupons = 0
    for m in written_messages(str(demo_dir / "commitlog")):
        row = message_row(m)
        if row["topic"] != "orders-0" or not entered_a_queue(row) or \
                row["queue_offset"] >= states[("orders-0", row["queue_id"])].commit:
            continue
        try:
            body = json.loads(row["body"])
        except ValueError:
            continue
        amount = body.get("amount") if isinstance(body, dict) else None
        if type(amount) in (int, float) and amount > 100 and body.get("paid") is True:
            count, total, coupons = count + 1, total + amount, coupons + isinstance(body.get("coupon"), str)
    assert count > 0 and got == [count, round(total, 2), coupons], (got, count, total, coupons)
    # `tierlog get` of the JSON topic prints each body parsed beside the raw one
    import base64

    [get] = [c for c in commands if " get orders-0 " in c]
    lines = [json.loads(x) for x in run_block("bash", get.split("#")[0], root).stdout.splitlines()]
    assert lines and all(x["value"] == json.loads(base64.b64decode(x["body"])) for x in lines), lines


def test_a_small_demos_try_next_lines_run_as_printed(tmp_path):
    """5,000 messages seal nothing, so no glob reader finds a file: the demo must not offer one."""
    commands = demo(tmp_path, "--messages", "5000")
    for command in commands:
        r = run_block("bash", command, tmp_path)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (command, r.stderr[-3000:])


def test_the_readme_reads_in_five_minutes():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, len(lines)
    assert any(x.startswith("## Quickstart") for x in lines[:30])
    benchmarks = lines[next(i for i, x in enumerate(lines) if x.startswith("## Benchmarks")):]
    rows = [x for x in benchmarks if x.startswith("|")][2:]  # below the header and its rule
    assert 0 < len(rows) <= 10

"""The service from the command line: run, status, rebuild-metadata, commitlog gc, SIGTERM, demo."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from connectors.commitlog.reader import list_files
from connectors.tier.reader import TierReader
from streaming import config as cfg
from tests.cli_runner import cli_command, cli_env, processes_marked, tierlog
from tests.cli_runner import write_config as shared_config
from tests.kv_helpers import view_contents
from tests.oracle import latest_per_key
from tests.tiering_helpers import assert_tier_equals_commitlog, oracle_rows, produce, tier_rows

def write_config(tmp_path: Path) -> Path:
    return shared_config(tmp_path, commitlog={"local_retention": "0s"}, source={"max_bytes_per_trigger": 100000},
                         tier={"segment_messages": 100, "delete_grace_s": 0}, spark={"trigger_interval_s": 0.3})


def run_to_its_exit(tmp_path: Path, *argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``tierlog argv``, its output to files, not pipes: the command's own exit is then its end (a pipe
    ends when its last writer has gone).  Nothing it started may still be running at that moment:
    its JVM exited first, so the command's last line is the last line printed."""
    mark = str(os.getpid()) + tmp_path.name
    with open(tmp_path / "run.out", "w+") as out, open(tmp_path / "run.err", "w+") as err:
        proc = subprocess.run(cli_command(*argv), stdin=subprocess.DEVNULL, stdout=out, stderr=err, timeout=300,
                              env=cli_env({**(env or {}), "TEST_RUN_MARK": mark}))
        left = processes_marked(mark)
        out.seek(0)
        err.seek(0)
        r = subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())
    assert left == [], f"still running after `tierlog {' '.join(argv)}` returned: {left}\n{r.stderr[-2000:]}"
    return r


def test_run_status_rebuild_and_gc(tmp_path):
    config = write_config(tmp_path)
    conf = cfg.load(str(config), env={})
    produce(conf, 1500)
    r = run_to_its_exit(tmp_path, "run", "--until-caught-up", "--config", str(config))
    assert r.returncode == 0, r.stderr[-3000:]
    batch_lines = [json.loads(x.split("batch ", 1)[1]) for x in r.stderr.splitlines() if "tierlog.service: batch {" in x and '"query": "tiering"' in x]
    assert len(batch_lines) > 3 and all({"rows", "bytes", "lag_bytes", "lag_msgs", "lag_s"} <= set(b) for b in batch_lines)
    assert batch_lines[-1]["lag_bytes"] == 0 and sum(b["rows"] for b in batch_lines) == 1500
    # Quiet by default: none of Spark's start-up notes, none of its log4j banner lines.
    for note in ("resolves to a loopback address", "native-hadoop", "Disabling AQE", "adaptive.enabled",
                 "log4j2-defaults.properties", "Setting default log level"):
        assert note not in r.stderr, note
    assert_tier_equals_commitlog(conf)

    state = TierReader(conf.tier.location).committed()
    r = tierlog("status", "--config", str(config), "--format", "json")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    queues = {(x["topic"], x["queue"]): x for x in lines if x["kind"] == "queue"}
    summary = next(x for x in lines if x["kind"] == "summary")
    assert queues.keys() == state.queues.keys()
    for key, q in state.queues.items():
        assert (queues[key]["commit"], queues[key]["sealed"], queues[key]["lag"]) == (q.commit, q.sealed, 0)
        assert queues[key]["segments"] == len(state.segments_for(key))
    assert summary["safepoint"] == summary["tiered_to_phy"] == state.source_end
    # Tables are on by default, and a run that stopped caught up left them in step, shown beside the sinks.
    tables = {x["topic"]: x for x in lines if x["kind"] == "table" and x["table_kind"] == "messages"}
    assert tables.keys() == {t for t, _ in state.queues} and all(x["lag_messages"] == 0 for x in tables.values())

    produce(conf, 300, start=1500)  # not tiered yet: status shows the lag per queue
    lines = [json.loads(x) for x in tierlog("status", "--config", str(config), "--format", "json").stdout.splitlines()]
    assert sum(x["lag"] for x in lines if x["kind"] == "queue") == 300

    # A stop between the KV view's apply and Spark's commit (as --until-caught-up's may make) leaves
    # compaction's last batch to run again: the store rebuilt below must still list it for the run
    # after it (CI met "not listed in the metadata store" when the stop had landed there).
    commits = Path(conf.checkpoint.dir, "compaction", "commits")
    last = max(int(p.name) for p in commits.iterdir() if p.name.isdigit())
    for name in (str(last), f".{last}.crc"):
        (commits / name).unlink(missing_ok=True)

    r = tierlog("tier", "rebuild-metadata", "--config", str(config), "--format", "json")
    assert r.returncode == 0 and json.loads(r.stdout)["segments"] == len(state.segments)

    before = list_files(conf.commitlog.dir)
    r = tierlog("commitlog", "gc", "--config", str(config), "--format", "json")
    assert r.returncode == 0, r.stderr
    after = list_files(conf.commitlog.dir)
    assert after and after[-1] == before[-1] and len(after) < len(before)
    assert all(f.end <= summary["safepoint"] for f in before if f not in after)  # only below the safepoint
    # With tables off, nothing touches the catalog, though this run seals segments.
    catalog = Path(conf.state.dir) / "tables.db"
    touched = lambda: (catalog.stat().st_mtime_ns, sorted(p.name for p in Path(conf.tier.location, "_tables").rglob("*")))  # noqa: E731
    before_tables = touched()
    produce(conf, 1200, start=1800)  # enough for every queue to seal
    r = tierlog("run", "--until-caught-up", "--config", str(config), env={"TIERLOG_TABLES_ENABLED": "false"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert TierReader(conf.tier.location).read_all().num_rows == 3000
    assert TierReader(conf.tier.location).committed().segments.keys() - state.segments.keys(), "the run sealed nothing"
    assert touched() == before_tables
    assert view_contents(conf) == latest_per_key(conf.commitlog.dir)  # the batch run again included


def test_sigterm_finishes_the_batch_and_exits_zero(tmp_path):
    config = write_config(tmp_path)
    conf = cfg.load(str(config), env={})
    produce(conf, 200)
    proc = subprocess.Popen(cli_command("run", "--config", str(config)), env=cli_env(),
                            stderr=subprocess.PIPE, text=True)
    try:
        def tiered_to() -> int:
            state = TierReader(conf.tier.location).committed() if os.path.exists(conf.tier.location) else None
            return (state.source_end or 0) if state else 0

        deadline = time.time() + 120
        while not tiered_to() and time.time() < deadline:
            time.sleep(0.2)
        first = tiered_to()
        assert first, "the service never tiered the first messages"
        produce(conf, 2000, start=200)  # keep it busy when the signal lands
        while tiered_to() == first and time.time() < deadline:  # it is tiering the new messages
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "finishing the batch in flight" in err
    # Stopped mid-stream, cleanly: the tier holds exactly what was written up to where it got.
    stopped_at = tiered_to()
    assert stopped_at > first
    assert tier_rows(conf.tier.location) == [r for r in oracle_rows(conf) if r["phy_offset"] < stopped_at]
    r = tierlog("run", "--until-caught-up", "--config", str(config))
    assert r.returncode == 0, r.stderr[-2000:]
    assert_tier_equals_commitlog(conf)


def test_sigterm_while_a_batch_waits_for_a_full_disk_stops_in_a_few_lines(tmp_path):
    """A full tier disk is retried, not failed; a SIGTERM then stops the run at the retry's next wait
    (the batch is abandoned, to be redone), in at most 3 lines and no traceback."""
    config = write_config(tmp_path)
    conf = cfg.load(str(config), env={})
    produce(conf, 200)
    flag, hits, err_path = tmp_path / "full", tmp_path / "full.hits", tmp_path / "stderr"
    flag.write_text("")
    with open(err_path, "w") as err:
        proc = subprocess.Popen(cli_command("run", "--config", str(config)), stdout=subprocess.DEVNULL, stderr=err,
                                env=cli_env({"TIERLOG_FAULT_DISK_FULL": str(flag)}))
    try:
        deadline = time.time() + 120
        while (not hits.exists() or hits.stat().st_size < 4) and time.time() < deadline:  # retrying, backing off
            time.sleep(0.1)
        assert hits.exists(), err_path.read_text()[-3000:]
        before = len(err_path.read_text().splitlines())
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    after = err_path.read_text().splitlines()[before:]
    assert proc.returncode == 0, after
    assert len(after) <= 3 and "Traceback" not in "\n".join(after), after
    flag.unlink()
    r = tierlog("run", "--until-caught-up", "--config", str(config))  # the abandoned batch is redone
    assert r.returncode == 0, r.stderr[-2000:]
    assert_tier_equals_commitlog(conf)


def late_python(tmp_path, starts: int):
    """A Python whose first ``starts`` streaming-source runners start 12 s late, past Spark's fixed
    10 s (each once: ``mkdir`` is atomic)."""
    late = tmp_path / "late-python"
    late.write_text(f"""#!/bin/sh
if [ "$2" = pyspark.sql.streaming.python_streaming_source_runner ]; then
  for i in $(seq 1 {starts}); do
    if mkdir "{tmp_path}/late-$i" 2>/dev/null; then sleep 12; break; fi
  done
fi
exec {sys.executable} "$@"
""")
    late.chmod(0o755)
    return late


def test_a_query_spark_could_not_start_in_time_is_started_again_with_backoff(tmp_path):
    """Spark gives the Python process that runs a Python streaming source a fixed 10 s to start and
    connect back; on a busy host it can be late, and the query fails before its first batch.  The
    fault: two late runners in a row, both for the tiering query (the only one: compaction is off).
    The schedule past them (4, 8, 16, then 30 s until ``spark.late_start_s``) is
    ``tests/test_late_start.py``'s, on a test clock: six real late starts here cost two minutes."""
    config = shared_config(tmp_path, source={"max_bytes_per_trigger": 100000}, compaction={"enabled": False},
                           tier={"segment_messages": 100, "delete_grace_s": 0}, spark={"trigger_interval_s": 0.3})
    conf = cfg.load(str(config), env={})
    produce(conf, 800)
    late = late_python(tmp_path, 2)
    r = tierlog("run", "--until-caught-up", "--config", str(config), env={"PYSPARK_PYTHON": str(late)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert all((tmp_path / f"late-{i}").exists() for i in range(1, 3)), "the late starts never happened"
    waits = [x for x in r.stderr.splitlines() if "waits to start again: Spark's Python worker did not connect back" in x]
    assert [w.split("; start ")[1].split(",")[0] for w in waits] == ["2 in 1 s", "3 in 2 s"], r.stderr[-3000:]
    assert all("the tiering query waits to start again" in w for w in waits)
    assert_tier_equals_commitlog(conf)


def test_a_query_that_cannot_start_within_its_budget_ends_the_run_saying_why(tmp_path):
    config = write_config(tmp_path)
    conf = cfg.load(str(config), env={})
    produce(conf, 100)
    late = late_python(tmp_path, 1)
    r = tierlog("run", "--until-caught-up", "--config", str(config),
                env={"PYSPARK_PYTHON": str(late), "TIERLOG_SPARK_LATE_START_S": "0"})
    assert r.returncode != 0
    assert "query could not start for 0 s: in 1 starts, Spark's Python worker never connected back" in r.stderr
    assert "spark.late_start_s (now 0)" in r.stderr.splitlines()[-1], r.stderr[-2000:]
    assert TierReader(conf.tier.location).committed().seq == -1  # nothing was committed


def test_a_query_whose_python_worker_is_late_after_it_ran_batches_starts_again_from_its_checkpoint(tmp_path):
    """A late Python worker can fail a batch, not only a start (CI: the tiering query's first batch
    of the RocketMQ replica test).  The fault fails the tiering query's second batch and the
    compaction query's second, each after the batch began; both are built afresh, resume from
    their checkpoints and sinks' records, and the tier and the KV view equal the writer's ledger."""
    config = shared_config(tmp_path, source={"max_bytes_per_trigger": 100000},
                           tier={"segment_messages": 100, "delete_grace_s": 0}, spark={"trigger_interval_s": 0.3})
    conf = cfg.load(str(config), env={})
    produce(conf, 800)
    r = tierlog("run", "--until-caught-up", "--config", str(config),
                env={"TIERLOG_FAULT_LATE_WORKER": "tiering:2,compaction:2"})
    assert r.returncode == 0, r.stderr[-3000:]
    for name in ("tiering", "compaction"):
        assert f"the {name} query waits to start again: Spark's Python worker did not connect back" in r.stderr, r.stderr[-3000:]
        assert f"the {name} query starts again from its checkpoint" in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert_tier_equals_commitlog(conf)
    assert view_contents(conf) == latest_per_key(conf.commitlog.dir)


def test_second_service_on_the_same_state_is_refused(tmp_path):
    config = write_config(tmp_path)
    conf = cfg.load(str(config), env={})
    produce(conf, 50)
    from state.metadata import MetadataStore
    from streaming.settings import derive

    held = MetadataStore(derive(conf).paths.metadata)
    try:
        r = tierlog("run", "--until-caught-up", "--config", str(config))
    finally:
        held.close()
    assert r.returncode == 1
    assert "in use by another tierlog process" in r.stderr and "metadata" in r.stderr


def test_demo_runs_the_main_job(tmp_path):
    r = tierlog("demo", "--messages", "3000", "--dir", str(tmp_path / "demo"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "3000 messages tiered" in r.stderr and "tierlog status --config" in r.stdout
    assert "dispatch" in r.stdout and "safepoint" in r.stdout  # the status table itself
    conf = cfg.load(str(tmp_path / "demo" / "tierlog.toml"), env={})
    assert_tier_equals_commitlog(conf)
    assert view_contents(conf) == latest_per_key(conf.commitlog.dir)  # the compaction query ran too
    assert "tierlog kv scan" in r.stdout
    def suggested(prefix: str) -> list[str]:
        [line] = [x for x in r.stdout.splitlines() if x.startswith(f"  tierlog {prefix} ")]
        return line.split()[1:]

    got = tierlog(*suggested("get topic-0"), "--format", "json", cwd=tmp_path)  # its paths are relative to where it ran
    assert got.returncode == 0 and len(got.stdout.splitlines()) == 5
    kv_get = suggested("kv get")
    kv = tierlog(*kv_get, "--format", "json", cwd=tmp_path)  # the key it names has a value
    assert kv.returncode == 0 and json.loads(kv.stdout)["key"] == kv_get[3]

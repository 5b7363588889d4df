"""The metrics endpoint and `tierlog status` of a running service, against the oracle and the metadata store."""

from __future__ import annotations

import gc
import os
import json
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from connectors.kafka.embedded import free_port
from connectors.tier.reader import TierReader
from state.metadata import MetadataStore
from streaming import config as cfg
from streaming.settings import derive
from tests.cli_runner import cli_command, cli_env, tierlog, write_config
from tests.kafka_helpers import changelog_records
from tests.kv_helpers import append, kv_messages
from tests.oracle import written_rows

MESSAGES = 3000


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample on /metrics, by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            result = condition()
            if result:
                return result
        except (OSError, KeyError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def thread_niceness(pid: int) -> dict[str, set[int]]:
    """Each thread name of process ``pid`` (``/proc``'s comm) with the niceness its threads have."""
    out: dict[str, set[int]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as fh:
                out.setdefault(fh.read().strip(), set()).add(os.getpriority(os.PRIO_PROCESS, int(tid)))
        except OSError:
            continue  # ended meanwhile
    return out


def spark_jvm(parent: int) -> int:
    """The pid of the Spark JVM that process ``parent`` started."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"SparkSubmit" in cmdline:
            return int(pid)
    raise AssertionError(f"process {parent} has no Spark JVM")


def test_metrics_and_status_of_a_running_service(tmp_path, kafka_bootstrap, kafka_prefix):
    port = free_port()
    config = write_config(tmp_path, source={"max_bytes_per_trigger": 60000}, tier={"segment_messages": 200},
                          compaction={"snapshot_interval_s": 0}, metrics={"port": port},
                          spark={"trigger_interval_s": 0.5},
                          kafka={"bootstrap": kafka_bootstrap, "mirror_topic": f"{kafka_prefix}.{{topic}}",
                                 "changelog_topic": f"{kafka_prefix}.{{topic}}.changelog", "partitions": 4})
    conf = cfg.load(str(config), env={})
    append(conf, kv_messages(MESSAGES, topics=2, keys=40, seed=11))
    proc = subprocess.Popen(cli_command("run", "--config", str(config)), env=cli_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        rows = written_rows(conf.commitlog.dir)
        keyed = {(r["topic"], r["key"]) for r in rows if r["key"] is not None}
        end = rows[-1]["phy_offset"] + rows[-1]["size"]

        def kv_applied() -> int | None:
            store = MetadataStore(derive(conf).paths.metadata, read_only=True)
            try:
                return store.journal.sinks().get("kv")
            finally:
                store.close()

        def caught_up():
            s = scrape(port)
            done = (value(s, "tierlog_rows_in_total", query="tiering") >= MESSAGES
                    and value(s, "tierlog_kafka_records_sent_total", sink="mirror") >= MESSAGES
                    and value(s, "tierlog_safepoint_offset") == end and kv_applied() == end)
            if not done:
                return None
            time.sleep(3)  # the runner's next ticks count what the last batches sent (poll_metrics)
            return scrape(port)

        s = wait_for(caught_up, 240, "the service to tier, mirror and apply every message")
        # compaction.nice at its default: the KV view's threads and the JVM's task threads run at
        # niceness 10, the tier's, the mirror's, the main thread and Arrow's pool (started from a
        # thread named arrow-pool: connectors/threads.py) at 0, as Spark's stream threads.
        driver, jvm = thread_niceness(proc.pid), thread_niceness(spark_jvm(proc.pid))
        main = open(f"/proc/{proc.pid}/comm").read().strip()
        assert driver["kv-apply_0"] == driver["kv-resolve_0"] == {10}, driver
        assert driver[main] == driver["tiering"] == driver["mirror"] == driver["arrow-pool"] == {0}, driver
        assert {n for name, ns in jvm.items() if name.startswith("Executor task") for n in ns} == {10}, jvm
        assert {n for name, ns in jvm.items() if name.startswith("stream executio") for n in ns} == {0}, jvm
        status = [json.loads(line) for line in tierlog("status", "--format", "json", "--config", str(config)).stdout.splitlines()]
        store = MetadataStore(derive(conf).paths.metadata, read_only=True)
        try:
            queues, sinks = store.queues(), store.journal.sinks()
        finally:
            store.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]

    # Rows and bytes in equal the ledger; nothing is left behind.
    assert value(s, "tierlog_rows_in_total", query="tiering") == MESSAGES
    assert value(s, "tierlog_bytes_in_total", query="tiering") == sum(r["size"] for r in rows)
    # Compaction's source gives Spark each key's last message of each staging object: every key
    # at least once, and fewer rows than messages (keys repeat within an object).
    assert len(keyed) <= value(s, "tierlog_rows_in_total", query="compaction") < MESSAGES
    assert value(s, "tierlog_dispatch_behind_messages") == 0 and value(s, "tierlog_dispatch_behind_seconds") == 0
    # Every tiering batch, upload, object and seal was counted.
    assert value(s, "tierlog_batch_duration_seconds_count", query="tiering") >= 2
    assert value(s, "tierlog_batch_duration_seconds_sum", query="tiering") > 0
    state = TierReader(conf.tier.location).committed()
    assert value(s, "tierlog_seals_total") == len(state.segments) > 0
    for kind in ("segment", "key_index"):
        assert value(s, "tierlog_objects_written_total", kind=kind) == len(state.segments)
    staged = value(s, "tierlog_objects_written_total", kind="staging")
    assert staged >= 2 and value(s, "tierlog_upload_duration_seconds_count", kind="staging") == staged
    assert value(s, "tierlog_objects_written_total", kind="commit_record") >= 2
    # Kafka: each message mirrored once, each change sent once, no errors, a send rate.
    assert value(s, "tierlog_kafka_records_sent_total", sink="mirror") == MESSAGES
    assert value(s, "tierlog_kafka_records_sent_total", sink="changelog") == len(
        changelog_records(conf, ["t0", "t1"]))
    assert value(s, "tierlog_kafka_errors_total", sink="mirror") == 0
    assert value(s, "tierlog_kafka_send_rate", sink="mirror") > 0
    # The view holds one row per key (RocksDB's estimate also counts overwrites in the memtable).
    assert len(keyed) <= value(s, "tierlog_state_rows", store="kv") <= MESSAGES + 10
    assert value(s, "tierlog_safepoint_offset") == end
    assert ("tierlog_read_cache_hit_ratio", ()) not in s  # run reads no tiered queues: no always-0 series
    # What each RocksDB store holds in memory: something, and within its bounds (the driver's stores:
    # RocksDB's default 2 x 64 MiB of memtables and 32 MiB of block cache; Spark's: at most
    # state.rocksdb_memory_mb for each of its partitions, however it splits their shared cache).
    for store in ("kv", "metadata"):
        assert 0 < value(s, "tierlog_state_memory_bytes", store=store) <= 160 << 20, store
    assert 0 < value(s, "tierlog_state_memory_bytes", store="spark") <= (
        conf.state.rocksdb_memory_mb * conf.spark.shuffle_partitions) << 20

    # Status JSON says what the metadata store holds.
    by_kind: dict = {}
    for row in status:
        by_kind.setdefault(row["kind"], []).append(row)
    assert {(q["topic"], q["queue"], q["dispatch"], q["commit"], q["sealed"], q["low"], q["segments"])
            for q in by_kind["queue"]} == {
        (q.topic, q.queue_id, q.dispatch, q.commit, q.sealed, q.low, q.segments) for q in queues}
    assert {r["sink"]: r["applied_phy"] for r in by_kind["sink"]} == sinks
    [summary] = by_kind["summary"]
    assert summary["safepoint"] == min(sinks.values()) == end


def test_the_cache_hit_ratio_metric_reads_the_caches_of_the_process(tmp_path):
    from prometheus_client import CollectorRegistry

    from connectors.commitlog.format import Message
    from connectors.tier.cache import ReadAheadCache
    from streaming.runtime.metrics import register_read_cache_metrics
    from tests.tiering_helpers import make_conf

    conf = make_conf(tmp_path, str(tmp_path / "tier"))
    append(conf, (Message(topic="t", queue_id=0, body=b"x", properties={}) for _ in range(10)))
    gc.collect()  # caches of earlier tests are gone
    registry = CollectorRegistry()  # what an application serving consumers from the tier registers
    register_read_cache_metrics(registry)
    assert registry.get_sample_value("tierlog_read_cache_hit_ratio") == 0
    env = {"TIERLOG_STATE_DIR": conf.state.dir, "TIERLOG_CHECKPOINT_DIR": conf.checkpoint.dir,
           "TIERLOG_COMPACTION_ENABLED": "false", "TIERLOG_METRICS_PORT": "0", "TIERLOG_TIER_LOCATION": conf.tier.location,
           "TIERLOG_COMMITLOG_DIR": conf.commitlog.dir}
    assert tierlog("run", "--until-caught-up", env=env).returncode == 0
    cache = ReadAheadCache(TierReader(conf.tier.location))
    for offset in range(0, 10, 2):
        cache.get("g", "t", 0, offset, 2)
    assert registry.get_sample_value("tierlog_read_cache_hit_ratio") == cache.stats.hit_ratio > 0


def test_status_watch_refreshes(tmp_path):
    from tests.tiering_helpers import make_conf, produce

    conf = make_conf(tmp_path, str(tmp_path / "tier"))
    produce(conf, 30)
    env = {"TIERLOG_STATE_DIR": conf.state.dir, "TIERLOG_CHECKPOINT_DIR": conf.checkpoint.dir,
           "TIERLOG_COMPACTION_ENABLED": "false", "TIERLOG_METRICS_PORT": "0", "TIERLOG_TIER_LOCATION": conf.tier.location,
           "TIERLOG_COMMITLOG_DIR": conf.commitlog.dir}
    assert tierlog("run", "--until-caught-up", env=env).returncode == 0
    table = tierlog("status", "--watch", "0.2", "--count", "3", env=env)
    assert table.returncode == 0, table.stderr
    assert table.stdout.count("tierlog status every 0.2 s") == 3
    assert table.stdout.count("\x1b[H\x1b[2J") == 2  # redrawn in place (not a terminal: the first is not cleared)
    lines = [json.loads(line) for line in tierlog("status", "--watch", "0.2", "--count", "2", "--format", "json",
                                                  env=env).stdout.splitlines()]
    summaries = [line for line in lines if line["kind"] == "summary"]
    assert len(summaries) == 2 and summaries[0]["tiered_to_phy"] == summaries[1]["tiered_to_phy"] > 0
    bad = tierlog("status", "--watch", "0", env=env)
    assert bad.returncode == 2 and "--watch" in bad.stderr


def _burn(seconds: float) -> None:
    until = time.process_time() + seconds
    while time.process_time() < until:
        pass


def test_task_cpu_counts_a_tasks_own_steps_not_its_consumers_time(tmp_path, monkeypatch):
    """The cost ledger's split of Spark's Python workers by task kind (``connectors.task_cpu``)."""
    from connectors.task_cpu import TASK_CPU, counted

    steps = iter([1, 2, 3])
    monkeypatch.delenv(TASK_CPU, raising=False)
    assert counted("stage", steps) is steps  # off: nothing added to a task

    def task():
        for item in (1, 2, 3):
            _burn(0.03)
            yield item

    path = tmp_path / "task-cpu"
    monkeypatch.setenv(TASK_CPU, str(path))
    seen = []
    for item in counted("tierfeed read", task()):
        seen.append(item)
        _burn(0.1)  # PySpark's work on what the task yielded: not the task's
    assert seen == [1, 2, 3]
    [line] = path.read_text().splitlines()
    kind, _, rest = line.rpartition(" ")[0].rpartition(" ")
    assert kind == "tierfeed read" and line.endswith(f" {os.getpid()}")
    assert 0.08 <= float(rest) < 0.2  # the task's 0.09 s, not the consumer's 0.3 s


def test_task_cpu_to_a_path_a_task_cannot_write_warns_and_the_task_goes_on(tmp_path, monkeypatch, caplog):
    from connectors.task_cpu import TASK_CPU, counted

    path = tmp_path / "no such directory" / "task-cpu"
    monkeypatch.setenv(TASK_CPU, str(path))
    assert list(counted("stage", iter([1, 2]))) == [1, 2]
    assert list(counted("stage", iter([3]))) == [3]
    warnings = [r.getMessage() for r in caplog.records if r.name == "tierlog.ledger"]
    assert len(warnings) == 1 and str(path) in warnings[0], warnings  # once a process, naming the path
    assert not path.exists()


def test_every_metric_the_grafana_dashboard_names_is_one_the_service_exports():
    """docs/grafana/tierlog.json: each panel's queries name only series `tierlog run` exports (a
    counter as ``_total``, a histogram as ``_bucket``, ``_sum`` or ``_count``), and it has the panels
    an operator looks for."""
    import re

    from streaming.runtime.metrics import Metrics

    exported = set()
    for family in Metrics().registry.collect():
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "info": ("_info",)}
        exported |= {family.name + s for s in suffixes.get(family.type, ("",))}
    dashboard = json.loads((Path(__file__).parents[1] / "docs" / "grafana" / "tierlog.json").read_text())
    named = {name for panel in dashboard["panels"] for target in panel["targets"]
             for name in re.findall(r"\btierlog_[a-z_]+", target["expr"])}
    assert named and named <= exported, sorted(named - exported)
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for wanted in ("lag per sink", "freshness", "headroom", "batch times", "table lag", "errors", "quarantines"):
        assert wanted in titles, wanted

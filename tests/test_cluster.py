"""The tiering job on a Spark standalone cluster: a master and a worker on loopback, started from
pyspark's bundled ``spark-class``, and ``tierlog run`` submitted to ``spark://127.0.0.1:PORT``."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from connectors.kafka.embedded import free_port
from streaming import config as cfg
from tests.cli_runner import cli_env, tierlog, write_config
from tests.tiering_helpers import assert_tier_equals_commitlog, produce


def spark_class() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent / "bin" / "spark-class"


def cluster_env(tmp_path: Path) -> dict:
    import pyspark

    return cli_env({"SPARK_LOCAL_IP": "127.0.0.1", "SPARK_HOME": str(Path(pyspark.__file__).parent),
                    "PYSPARK_PYTHON": sys.executable, "SPARK_LOG_DIR": str(tmp_path / "logs"),
                    "SPARK_NO_DAEMONIZE": "1"})


def master_state(ui_port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/json/", timeout=5) as response:
        return json.loads(response.read())


def start_cluster(tmp_path: Path, attempt: int):
    """A master and one 2-core worker; returns (procs, logs, master port, UI port), or None if the master
    lost a port it was given to another process before it bound it."""
    env = cluster_env(tmp_path)
    # Without retries the master fails at once on a port taken since free_port() saw it free, where by
    # default it binds the next port and the test asks someone else's server (CI met another test's Spark
    # UI there, which answered HTML).
    env["SPARK_MASTER_OPTS"] = "-Dspark.port.maxRetries=0"
    port, ui = free_port(), free_port()
    logs = (tmp_path / f"master-{attempt}.log").open("w"), (tmp_path / f"worker-{attempt}.log").open("w")
    procs = [subprocess.Popen([str(spark_class()), "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                               "--port", str(port), "--webui-port", str(ui)], env=env, stdout=logs[0],
                              stderr=subprocess.STDOUT)]
    procs.append(subprocess.Popen(
        [str(spark_class()), "org.apache.spark.deploy.worker.Worker", f"spark://127.0.0.1:{port}",
         "--host", "127.0.0.1", "--cores", "2", "--memory", "2g", "--webui-port", str(free_port()),
         "--work-dir", str(tmp_path / "work")], env=env, stdout=logs[1], stderr=subprocess.STDOUT))
    deadline = time.monotonic() + 120
    while True:
        try:
            if master_state(ui).get("aliveworkers", 0) >= 1:
                return procs, logs, port, ui
        except OSError:
            pass
        text = (tmp_path / f"master-{attempt}.log").read_text()
        if "BindException" in text:  # the master may live on without its UI, so its log says
            stop_cluster(procs, logs)
            return None
        if procs[0].poll() is not None or time.monotonic() > deadline or procs[1].poll() is not None:
            stop_cluster(procs, logs)
            raise AssertionError("the standalone cluster did not come up: " + text[-2000:]
                                 + (tmp_path / f"worker-{attempt}.log").read_text()[-2000:])
        time.sleep(0.5)


def stop_cluster(procs, logs) -> None:
    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
    for f in logs:
        f.close()


@pytest.fixture
def standalone_cluster(tmp_path):
    """A master and one 2-core worker on loopback; yields (master URL, master web UI port)."""
    for attempt in range(3):
        started = start_cluster(tmp_path, attempt)
        if started is not None:
            break
    else:
        raise AssertionError("the standalone master lost its free ports to other processes three times")
    procs, logs, port, ui = started
    try:
        yield f"spark://127.0.0.1:{port}", ui
    finally:
        stop_cluster(procs, logs)


def test_tiering_on_a_standalone_cluster_equals_the_commitlog(tmp_path, standalone_cluster):
    master, ui = standalone_cluster
    config = write_config(tmp_path, source={"max_bytes_per_trigger": 200000, "partition_bytes": 65536},
                          tier={"segment_messages": 300}, compaction={"enabled": False}, spark={"master": master})
    conf = cfg.load(str(config), env={})
    produce(conf, 2000)
    r = tierlog("run", "--until-caught-up", "--config", str(config), env={"SPARK_LOCAL_IP": "127.0.0.1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert_tier_equals_commitlog(conf)
    apps = master_state(ui)["completedapps"]
    assert [a["name"] for a in apps] == ["tierlog"]  # it ran on the cluster, not in a local master
    executors = list((tmp_path / "work").glob("app-*/*/stderr"))
    assert executors and any("Running task" in e.read_text() for e in executors)  # tasks ran in the worker

"""docker-compose.yml and the Dockerfile: consistent with each other and with tierlog's settings.

`docker compose config` validates the file where Docker Compose is installed; these checks run
everywhere and catch what it cannot: a setting tierlog would refuse, a bucket nobody creates, a
volume the executors cannot see.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from streaming import config as cfg
from tests.cli_runner import ROOT


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


BROKERS = {"broker-a": "tierlog-a", "broker-b": "tierlog-b"}


def test_every_tierlog_variable_is_a_valid_setting(compose):
    confs = {}
    for broker, name in BROKERS.items():
        env = compose["services"][name]["environment"]
        conf = confs[broker] = cfg.load(env={k: str(v) for k, v in env.items()})
        assert conf.broker.name == broker
        assert conf.tier.location.startswith("s3://") and conf.kafka.bootstrap and conf.spark.master.startswith("spark://")
        assert conf.metrics.host == "0.0.0.0"  # scraped from outside the container
        producer = compose["services"][f"producer-{broker[-1]}"]["environment"]
        assert producer == env  # the producer writes the commitlog its tierlog reads
        worker = compose["services"]["spark-worker"]["environment"]
        assert {k: v for k, v in env.items() if k in worker} == worker  # executors upload like the driver
    a, b = confs.values()
    assert a.tier.location == b.tier.location and a.kafka.bootstrap == b.kafka.bootstrap  # one tier, one Kafka
    for section, key in (("commitlog", "dir"), ("state", "dir"), ("checkpoint", "dir"), ("metrics", "port")):
        assert getattr(getattr(a, section), key) != getattr(getattr(b, section), key), f"{section}.{key} is shared"


def test_the_services_agree(compose):
    services = compose["services"]
    kafka = services["kafka"]["environment"]
    assert "controller" in kafka["KAFKA_PROCESS_ROLES"]  # KRaft, no ZooKeeper
    master = services["spark-master"]["command"]
    assert master[:2] == ["spark-class", "org.apache.spark.deploy.master.Master"]
    assert "spark.deploy.defaultCores=2" in services["spark-master"]["environment"]["SPARK_MASTER_OPTS"]
    worker_cores = int(services["spark-worker"]["command"][services["spark-worker"]["command"].index("--cores") + 1])
    assert worker_cores >= 2 * len(BROKERS)  # every broker's application gets its cores at once
    worker_mounts = set(services["spark-worker"]["volumes"])
    for name in BROKERS.values():
        env = services[name]["environment"]
        assert env["TIERLOG_KAFKA_BOOTSTRAP"] in kafka["KAFKA_ADVERTISED_LISTENERS"]
        bucket = env["TIERLOG_TIER_LOCATION"].removeprefix("s3://").split("/")[0]
        assert f"mc mb --ignore-existing local/{bucket}" in services["minio-bucket"]["command"][0]
        assert env["AWS_ACCESS_KEY_ID"] == services["minio"]["environment"]["MINIO_ROOT_USER"]
        assert env["AWS_SECRET_ACCESS_KEY"] == services["minio"]["environment"]["MINIO_ROOT_PASSWORD"]
        assert env["TIERLOG_SPARK_MASTER"] == f"spark://spark-master:{master[master.index('--port') + 1]}"
        assert env["TIERLOG_SPARK_MASTER"] in services["spark-worker"]["command"]
        assert services[name]["command"] == ["tierlog", "run"]
        # Executors read the commitlog and write the state checkpoints: both must be shared volumes.
        for path in (env["TIERLOG_COMMITLOG_DIR"], env["TIERLOG_CHECKPOINT_DIR"]):
            mounts = [m for m in services[name]["volumes"] if m.endswith(":" + path)]
            assert mounts and mounts[0] in worker_mounts, path
        port = env["TIERLOG_METRICS_PORT"]
        assert f"{port}:{port}" in services[name]["ports"]


def test_the_image_installs_tierlog_from_its_own_files():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "openjdk-17" in dockerfile and "pip install --no-cache-dir ." in dockerfile
    for folder in ("streaming", "connectors", "state"):
        assert f"COPY {folder} ./{folder}" in dockerfile


@pytest.mark.skipif(subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0
                    if shutil.which("docker") else True, reason="Docker Compose is not installed here")
def test_docker_compose_config_accepts_the_file():
    r = subprocess.run(["docker", "compose", "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr

"""Shared fixtures: the session SparkSession, the S3 endpoint, Apache Kafka, and per-test names."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from tests import jit
from tests.class_sharing import spark_options

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.register_profile("dev", max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Every Spark driver the tests start, in this process or in a `tierlog` process, maps its classes
# from the archive `./dev setup` wrote (tests/class_sharing.py) and compiles with C1 only
# (tests/jit.py): the same driver, started sooner and for less CPU.
_spark_opts = " ".join([os.environ.get("SPARK_SUBMIT_OPTS", ""), *spark_options(), *jit.options()]).strip()
if _spark_opts:
    os.environ["SPARK_SUBMIT_OPTS"] = _spark_opts


def pytest_itemcollected(item):
    """``./dev test`` runs the tests on two pytest-xdist workers (``--dist loadgroup``).  The heavy
    ones all go to one group, which one worker runs in turn: two of them side by side would ask
    two cores for the CPU of four, and every Spark driver, broker and Python worker they start
    would start that much slower.

    (At collection, because xdist reads the groups in its own ``pytest_collection_modifyitems``.)"""
    if item.get_closest_marker("heavy"):
        item.add_marker(pytest.mark.xdist_group("heavy"))


def pytest_runtest_setup(item):
    """xdist passes a test's group to its scheduler as a suffix of the test's id; with a pytest
    whose ids xdist cannot change (9.2: pytest-xdist issue 1386) heavy tests would run side by side."""
    if item.config.getoption("loadgroup", False) and item.get_closest_marker("heavy") and "@" not in item.nodeid:
        pytest.fail("pytest-xdist did not put this heavy test in its group: this pytest and pytest-xdist do not "
                    "work together (see the pin in pyproject.toml); `./dev test -n 0` runs the tests serially")


@pytest.fixture
def log_dir(tmp_path):
    path = tmp_path / "commitlog"
    path.mkdir()
    return str(path)


@pytest.fixture(scope="session")
def spark(tmp_path_factory, s3_endpoint):
    """One SparkSession for the whole run: it takes about 11 s to start here.

    It starts after the S3 endpoint, so that its Python workers inherit the AWS_* variables.
    """
    from streaming.runtime.checkpoints import LOCAL_FILE_MANAGER
    from streaming.runtime.session import build_session

    warehouse = tmp_path_factory.mktemp("warehouse")
    session = build_session(
        "tierlog-tests",
        "local[2]",
        # The checkpoint file manager the service uses for local checkpoints, as every test's are.
        {"spark.sql.shuffle.partitions": "2", "spark.sql.warehouse.dir": str(warehouse), **LOCAL_FILE_MANAGER},
    )
    yield session
    session.stop()


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 HTTP endpoint: the one in AWS_ENDPOINT_URL_S3 if set (MinIO), else moto's server on loopback."""
    external = os.environ.get("AWS_ENDPOINT_URL_S3")
    if external:
        yield external
        return
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")}
    os.environ.update(
        AWS_ENDPOINT_URL_S3=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_REGION="us-east-1"
    )
    yield endpoint
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    server.stop()


_bucket_counter = iter(range(10**9))


@pytest.fixture
def s3_location(s3_endpoint):
    """A fresh bucket (and prefix) on the S3 endpoint, as a tier location."""
    import boto3

    bucket = f"tierlog-test-{os.getpid()}-{next(_bucket_counter)}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/tier"


@pytest.fixture(params=["posix", "s3"])
def tier_location(request, tmp_path):
    """One tier test, two backends: a local directory and S3 over HTTP."""
    if request.param == "posix":
        return str(tmp_path / "tier")
    return request.getfixturevalue("s3_location")


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory):
    """A real Apache Kafka: TIERLOG_TEST_KAFKA (host:port, e.g. docker-compose's Kafka) if set, else
    one KRaft node from Maven Central (``tests/kafka_broker.py``) on free loopback ports."""
    external = os.environ.get("TIERLOG_TEST_KAFKA")
    if external:
        yield external
        return
    from tests.kafka_broker import ApacheKafka

    with ApacheKafka(tmp_path_factory.mktemp("kafka")) as broker:
        yield broker.bootstrap


_topic_counter = iter(range(10**9))


@pytest.fixture
def kafka_prefix():
    """A topic prefix of this test's own, so tests sharing the broker never see each other's records."""
    return f"test{os.getpid()}-{next(_topic_counter)}"

"""Shared fixtures.  Spark fixtures live in tests/spark/conftest.py so plain tests start fast."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.register_profile("dev", max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def log_dir(tmp_path):
    path = tmp_path / "commitlog"
    path.mkdir()
    return str(path)


@pytest.fixture(scope="session")
def spark(tmp_path_factory):
    """One SparkSession for the whole run: it takes about 11 s to start here."""
    from streaming.session import build_session

    warehouse = tmp_path_factory.mktemp("warehouse")
    session = build_session(
        "tierlog-tests",
        "local[2]",
        {"spark.sql.shuffle.partitions": "2", "spark.sql.warehouse.dir": str(warehouse)},
    )
    yield session
    session.stop()

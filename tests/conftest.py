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

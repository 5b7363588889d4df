"""The service's processes reset the memory Arrow's allocator hands back instead of decommitting it
(``streaming/__init__.py`` says why): set as the package is imported, before anything of it loads
pyarrow (mimalloc reads its options once, as it loads), and a value the user set wins; a cluster's
executors are given it through ``spark.executorEnv.*`` (``streaming/runtime/session.py``)."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = ("import sys, os\n"
         "import streaming\n"
         "print(os.environ.get('MIMALLOC_PURGE_DECOMMITS'), 'pyarrow' in sys.modules)\n"
         "import streaming.cli.main, streaming.service\n"
         "print('pyarrow' in sys.modules)")


def _probe(**env) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k != "MIMALLOC_PURGE_DECOMMITS"}
    return subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, cwd=os.getcwd(), check=True,
                          capture_output=True, text=True, timeout=120).stdout.split()


def test_the_allocator_setting_is_in_place_before_pyarrow_loads_and_the_users_own_wins():
    # The service's modules load pyarrow: the setting was there before them.
    assert _probe() == ["0", "False", "True"]
    assert _probe(MIMALLOC_PURGE_DECOMMITS="1") == ["1", "False", "True"]


def test_a_clusters_executors_are_given_the_setting(spark):
    # An executor on another host does not inherit the driver's environment: Spark starts its Python
    # workers with what spark.executorEnv.* holds, which PySpark keeps in the context's environment.
    assert spark.sparkContext.getConf().get("spark.executorEnv.MIMALLOC_PURGE_DECOMMITS") == "0"
    assert spark.sparkContext.environment["MIMALLOC_PURGE_DECOMMITS"] == "0"

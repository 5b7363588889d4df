"""The backoff of queries whose Python worker was late (``streaming.runtime.late_start``), on a test clock."""

from __future__ import annotations

from streaming.runtime.late_start import LateStarts

LATE = "org.apache.spark.SparkException: Python worker failed to connect back."


def test_a_late_query_is_started_again_after_growing_delays_until_its_budget_runs_out():
    now = [100.0]
    heard = []
    late = LateStarts(120.0, on_wait=lambda name, text: heard.append((name, text)), clock=lambda: now[0])
    delays = []
    while late.failed("tiering", LATE):
        assert late.waiting() == {"tiering"} and late.due() == []
        delay = late.pending["tiering"].start_at - now[0]
        delays.append(delay)
        now[0] += delay
        assert late.due() == ["tiering"] and late.waiting() == set()
        now[0] += 10  # the next start is late again: Spark waited its 10 s
    assert delays == [1, 2, 4, 8, 16, 30]  # the seventh failure comes 121 s after the first: past 120 s
    assert "could not start for 121 s: in 7 starts" in late.gave_up["tiering"]
    assert "spark.late_start_s (now 120)" in late.gave_up["tiering"]
    assert len(heard) == 6 and all(name == "tiering" and "start" in text for name, text in heard)


def test_only_a_late_worker_is_ridden_out():
    late = LateStarts(300.0)
    assert not late.failed("tiering", "TierlogError: the commitlog is corrupt")
    assert late.pending == {} and late.gave_up == {}


def test_a_query_that_ran_a_batch_starts_its_budget_afresh():
    now = [0.0]
    heard = []
    late = LateStarts(10.0, on_wait=lambda name, text: heard.append(text), clock=lambda: now[0])
    assert late.failed("mirror", LATE)
    now[0] = 5
    assert late.due() == ["mirror"]
    late.ran("mirror")
    assert heard[-1] is None and late.pending == {}
    now[0] = 50
    assert late.failed("mirror", LATE)  # a new wait, not 50 s into the old one


def test_spark_python_processes_import_the_installed_pyspark_not_its_zip(spark):
    """``streaming.runtime.session.worker_python``: Spark's Python processes compile nothing from
    pyspark.zip (0.8 s of CPU at every start, against 0.37 s from the installed package), so the
    runner that must connect back within Spark's 10 s starts in half the CPU on a busy host."""
    import os
    import sys

    import pyspark
    import pytest

    launcher = os.environ.get("PYSPARK_PYTHON", "")
    if os.path.basename(os.path.dirname(launcher)) != "tierlog":
        pytest.skip(f"PYSPARK_PYTHON is the user's own ({launcher}): tierlog leaves it as it is")
    assert launcher != sys.executable and "pyspark.zip" in open(launcher).read()

    def where(batches):
        import py4j as worker_py4j
        import pyarrow as pa
        import pyspark as worker_pyspark

        for _ in batches:
            yield pa.RecordBatch.from_pylist([{"file": worker_pyspark.__file__, "py4j": worker_py4j.__file__}])
    [row] = spark.range(1, numPartitions=1).mapInArrow(where, "file string, py4j string").collect()
    assert row.file == pyspark.__file__ and ".zip" not in row.file
    if "py4j-" in open(launcher).read():  # the installed py4j is the version Spark's zip holds
        assert ".zip" not in row.py4j, row.py4j


def test_a_streaming_source_runner_whose_jvm_end_closes_exits_without_a_traceback(tmp_path):
    """The launcher runs Spark's Python streaming-source runner so that a JVM end closed first (a
    query that failed, which says so itself) ends it quietly: Python printed chained EOFError and
    BrokenPipeError tracebacks on tierlog's stderr (CI: test_a_corrupt_commitlog_stops_the_job_...).
    The JVM here is a socket that takes the runner's process id and closes."""
    import os
    import socket
    import subprocess
    import sys
    import threading

    import pytest

    from streaming.runtime.session import worker_python

    launcher = worker_python("local[2]")
    if launcher == sys.executable:
        pytest.skip("Spark's Python is started as it is here (no launcher)")
    path = str(tmp_path / "jvm.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    took = []

    def jvm():
        conn, _ = server.accept()
        took.append(conn.recv(4))  # the runner's process id
        conn.shutdown(socket.SHUT_RDWR)
        conn.close()

    thread = threading.Thread(target=jvm, daemon=True)
    thread.start()
    env = {k: v for k, v in os.environ.items() if k != "PYTHON_WORKER_FACTORY_SECRET"}
    env["PYTHON_WORKER_FACTORY_SOCK_PATH"] = path
    try:
        r = subprocess.run([launcher, "-m", "pyspark.sql.streaming.python_streaming_source_runner"], env=env,
                           capture_output=True, text=True, timeout=60)
    finally:
        thread.join(10)
        server.close()
    assert took and len(took[0]) == 4, "the runner never connected"
    assert "Traceback" not in r.stderr and r.returncode == 0, r.stderr[-2000:]

"""Every SparkSession setting tierlog relies on, in one place."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys

from connectors.errors import ConfigError

JVM_OPTIONS = "-XX:+IgnoreUnrecognizedVMOptions -XX:TrimNativeHeapInterval=30000"

# Chosen for 2-core, 24 GB machines: few shuffle partitions (each is one RocksDB
# instance per stateful operator), Arrow on, the UI off unless asked for.
BASE_CONF = {
    "spark.sql.shuffle.partitions": "4",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.sql.streaming.stateStore.providerClass": (
        "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
    ),
    "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": "true",
    # One memory budget for every RocksDB state store of an executor (block cache, memtables,
    # index and filter blocks), so state memory stays flat however many keys there are; the
    # size is state.rocksdb_memory_mb.  Counting rows would cost a read before every write.
    "spark.sql.streaming.stateStore.rocksdb.boundedMemoryUsage": "true",
    "spark.sql.streaming.stateStore.rocksdb.maxMemoryUsageMB": "512",
    "spark.sql.streaming.stateStore.rocksdb.trackTotalNumberOfRows": "false",
    # RocksDB frees memory in many small pieces from many threads, and glibc keeps what it
    # frees in per-thread arenas instead of giving it back: in an hour's soak the JVM's
    # memory outside anything Java tracks kept rising after the RocksDB budget was full.  Trimming the C heap every 30 s levels it (docs/benchmarks.md, soak rows).  The
    # flag needs JDK 17.0.9+ or 21; older JVMs ignore it rather than refuse to start.
    "spark.driver.extraJavaOptions": JVM_OPTIONS,
    "spark.executor.extraJavaOptions": JVM_OPTIONS,
    # A partial aggregation that finds nearly every key distinct (many keys, each changed
    # once per batch) is skipped after this many rows instead of 100,000, which the compaction
    # query gains from (docs/benchmarks.md).  With repeated keys the partial aggregation stays on.
    "spark.sql.aggregate.skipPartialAggregateMinNumRows": "5000",
    "spark.sql.session.timeZone": "UTC",
    "spark.python.worker.reuse": "true",
    # The tier source prunes objects and row groups by the filters Spark pushes to it.
    "spark.sql.python.filterPushdown.enabled": "true",
}


def check_java() -> None:
    """Fail with instructions, not a Py4J stack trace, when no Java runtime is installed."""
    if os.environ.get("JAVA_HOME") or shutil.which("java"):
        return
    raise ConfigError(
        "Java was not found: Spark needs a Java 17 or 21 runtime. Install one "
        "(for example `apt-get install openjdk-17-jre-headless`) or set JAVA_HOME."
    )


def local_driver(master: str) -> dict:
    """A local master keeps the driver on loopback; on a cluster, executors must reach it at the
    address SPARK_LOCAL_IP (or the host name) gives."""
    if master.startswith("local"):
        return {"spark.driver.bindAddress": "127.0.0.1", "spark.driver.host": "127.0.0.1"}
    return {}


# Spark's log configuration without its start-up notes; --log-level DEBUG keeps Spark's own.
QUIET_LOG4J = os.path.join(os.path.dirname(os.path.abspath(__file__)), "log4j2.properties")


# The JIT's first tier only (C1).  Why: the driver's JVM plans and commits micro-batches and moves
# Arrow batches; little of its code runs hot for long, and the second tier (C2) kept compiling
# afresh as plans came and went, a good part of a quiet broker's CPU.  With C1 only the service
# used less, and catching up was no slower (docs/benchmarks.md).
C1_ONLY = "-XX:TieredStopAtLevel=1"


def java_options(verbose: bool, c1_only: bool = True) -> str:
    """The driver's JVM options; quiet unless ``verbose``; the JIT's first tier only unless not ``c1_only``."""
    options = f"{JVM_OPTIONS} {C1_ONLY}" if c1_only else JVM_OPTIONS
    return options if verbose else f"{options} -Dlog4j2.configurationFile=file:{QUIET_LOG4J}"


PR_SET_THP_DISABLE = 41  # <linux/prctl.h>


def no_huge_pages() -> bool:
    """Turn the kernel's transparent huge pages off for this process and every process it starts
    from now on (the JVM, Spark's Python workers, the stagers); False where that is not possible.

    Why (``spark.transparent_huge_pages``): each batch the driver allocates hundreds of MB of Arrow
    buffers afresh (a batch's bodies, read, taken, joined), and freshly faulted memory is what its
    threads spent their kernel time on: a fresh huge page costs more per byte than 4 KiB pages, and
    catching up spent a third more system CPU with them (docs/benchmarks.md).  Nothing else changes:
    the page size is the kernel's business."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def worker_python(master: str) -> str:
    """The Python that Spark starts for its Python processes: on a local master, a launcher that
    takes the installed pyspark's own ``pyspark.zip`` off their ``PYTHONPATH`` first.

    Why: Spark puts that zip first, and Python compiles a module imported from a zip afresh at
    every start (no ``.pyc`` is written into it).  A streaming source's runner then takes twice the
    CPU to start that the installed package's compiled modules take, and it must connect back to
    the JVM within Spark's fixed 10 s, which a busy host stretches (docs/benchmarks.md).  The zip is a copy of the installed package, so
    nothing else changes.  A cluster's executors keep their own Spark's Python as it is."""
    import pyspark

    zip_path = os.path.join(os.path.dirname(pyspark.__file__), "python", "lib", "pyspark.zip")
    spark_home = os.environ.get("SPARK_HOME")
    if not master.startswith("local") or not os.path.exists(zip_path) or (
            spark_home and os.path.realpath(spark_home) != os.path.realpath(os.path.dirname(pyspark.__file__))):
        return sys.executable
    script = WORKER_PYTHON.format(python=sys.executable, py4j=_py4j_zip_case(os.path.dirname(zip_path)),
                                  quiet_runner=QUIET_RUNNER)
    digest = hashlib.sha1(script.encode()).hexdigest()[:12]
    # Not in /tmp, whose cleaners delete files unused for days under a service that runs for months.
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(cache, "tierlog", f"python-{digest}")
    try:
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}"
            with open(tmp, "w") as fh:
                fh.write(script)
            os.chmod(tmp, 0o755)
            os.replace(tmp, path)  # whole or not at all, for processes starting Spark side by side
    except OSError:  # no writable cache: Spark starts this Python as it is
        return sys.executable
    # access() says no on a file system mounted noexec: then Spark starts this Python as it is.
    return path if os.access(path, os.X_OK) else sys.executable


def _py4j_zip_case(lib: str) -> str:
    """The launcher's line that also drops Spark's py4j zip, when the installed py4j is the very
    same version (pyspark accepts a range): it too starts faster from compiled modules."""
    try:
        from py4j.version import __version__ as installed
    except ImportError:
        return ""
    name = f"py4j-{installed}-src.zip"
    if not os.path.exists(os.path.join(lib, name)):
        return ""
    return f"        */python/lib/{name}) ;;  # the same version as the installed py4j\n"


WORKER_PYTHON = """#!/bin/sh
# Written by tierlog (streaming/runtime/session.py, worker_python): Spark's Python processes import the
# installed pyspark's (and py4j's) compiled modules instead of compiling the same packages from zips.
set -f
kept=
IFS=:
for entry in $PYTHONPATH; do
    case $entry in
        */python/lib/pyspark.zip) ;;  # the installed pyspark's own copy (SPARK_HOME is that package)
{py4j}        *) kept="${{kept:+$kept:}}$entry" ;;
    esac
done
unset IFS
PYTHONPATH=$kept
export PYTHONPATH
if [ "$1" = -m ] && [ "$2" = pyspark.sql.streaming.python_streaming_source_runner ]; then
    # A streaming source's runner whose JVM end closes first (a query that failed or stopped, which
    # says so itself) fails writing to it, and Python printed that as tracebacks on tierlog's stderr.
    shift 2
    exec "{python}" -c '{quiet_runner}' "$@"
fi
exec "{python}" "$@"
"""

QUIET_RUNNER = """import runpy, sys
try:
    runpy.run_module("pyspark.sql.streaming.python_streaming_source_runner", run_name="__main__", alter_sys=True)
except (BrokenPipeError, ConnectionResetError, EOFError):
    sys.exit(0)
"""


# The environment variables a cluster's executors need as the driver has them.  A local master's
# Python workers inherit the driver's environment anyway; an executor on another host does not, and
# it starts its Python workers with the variables of ``spark.executorEnv.*``.
EXECUTOR_ENV = ("MIMALLOC_PURGE_DECOMMITS",)  # Arrow's allocator resets freed memory: streaming/__init__.py


def executor_env() -> dict[str, str]:
    """``spark.executorEnv.*`` for each of ``EXECUTOR_ENV`` this process has (a session's own
    setting of one wins)."""
    return {f"spark.executorEnv.{name}": os.environ[name] for name in EXECUTOR_ENV if name in os.environ}


def build_session(app_name: str = "tierlog", master: str = "local[2]", extra: dict | None = None,
                  c1_only: bool = True, huge_pages: bool = False):
    """Create (or reuse) the SparkSession with tierlog's settings and data sources registered;
    ``c1_only``: the driver's JVM compiles with the JIT's first tier only (``spark.jit_c1_only``);
    ``huge_pages``: leave the kernel's transparent huge pages on (``spark.transparent_huge_pages``).

    Spark's start-up notes are hidden unless the ``tierlog`` logger is at DEBUG (``--log-level
    DEBUG``)."""
    import logging

    check_java()
    if not huge_pages:
        no_huge_pages()  # before the JVM starts, so it and the processes it starts inherit it
    # The driver's only: a cluster's executors keep Spark's own logging, in the worker's files.
    options = java_options(logging.getLogger("tierlog").isEnabledFor(logging.DEBUG), c1_only)
    extra = {"spark.driver.extraJavaOptions": options, **executor_env(), **(extra or {})}
    if "PYSPARK_PYTHON" not in os.environ:
        os.environ["PYSPARK_PYTHON"] = worker_python(master)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app_name).master(master)
    for key, value in {**BASE_CONF, **local_driver(master), **(extra or {})}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    import streaming

    streaming.register(spark)
    return spark


def jvm_running() -> bool:
    """Whether this process has a Spark JVM already (a session built now would reuse it)."""
    from pyspark import SparkContext

    return SparkContext._gateway is not None


def end_jvm(timeout_s: float = 60.0) -> int | None:
    """After the session's ``stop()``: end the JVM this process started for it and wait until it has
    exited.  Returns its exit status (negative: the signal that ended it), or None when there was
    none, or it took longer than ``timeout_s`` (it then ends when this process does, as PySpark
    leaves it).  Call it only where this process started the JVM: every session in the process is
    gone with it, and the next ``build_session`` starts a new one.

    Why: PySpark's JVM exits once this process has gone (its stdin closes), so a command returned
    while its JVM was still running its shutdown hooks and exiting, longer on a busy host.
    A run started right after could meet it holding its files, and whatever the JVM printed as it
    exited came after tierlog's last line (a full run of the tests met a C++ runtime's abort,
    ``std::bad_alloc``, after an error's paragraph)."""
    import subprocess

    from pyspark import SparkContext

    gateway = SparkContext._gateway
    proc = getattr(gateway, "proc", None)
    if gateway is None or proc is None or proc.stdin is None:
        return None
    try:
        gateway.shutdown()  # the callback server's threads, and the connections to the JVM
    except Exception:  # noqa: BLE001 - the JVM is ending anyway
        pass
    SparkContext._gateway = SparkContext._jvm = None
    try:
        proc.stdin.close()  # PySpark's gateway server ends the JVM (System.exit) when its stdin closes
        return proc.wait(timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None

"""Class data sharing for the JVMs the tests start: the same programs, started sooner.

JDK 17's class data sharing (CDS) lets a JVM map the classes an earlier run of the same program
loaded, parsed and verified from an archive, instead of reading them from the jars again.  The
program does exactly what it did; it only starts sooner.  Here a Spark driver is ready about 3 s
sooner, a quarter of a short ``tierlog run --until-caught-up``, and the three crash tests alone
start 29 of them.

Archives live in ``.cache/jvm/cds``, one per program, Java runtime and class path.  The JVM checks
an archive against all three and quietly starts without it on any mismatch, so a stale archive
costs time, never correctness.  A Kafka or RocketMQ JVM that finds no archive writes one when it
exits normally; the Spark archive is written by ``./dev setup`` (``python -m tests.class_sharing``),
from a short ``tierlog run``.  ``TIERLOG_TEST_CDS=off`` turns all of it off.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).parents[1]
ARCHIVES = ROOT / ".cache" / "jvm" / "cds"
# The JVM logs each class it cannot archive (signed jars, old bytecode) and any archive it
# cannot use: expected here, and noise in the programs' output.
QUIET = ["-Xlog:cds=off", "-Xlog:cds+dynamic=off"]


def enabled() -> bool:
    return os.environ.get("TIERLOG_TEST_CDS", "on") != "off"


def _java() -> str:
    home = os.environ.get("JAVA_HOME")
    return os.path.realpath(os.path.join(home, "bin", "java") if home else shutil.which("java") or "java")


def archive_for(program: str, *identity: str) -> Path:
    """The archive of ``program`` under this Java runtime, for the class path etc. in ``identity``."""
    key = hashlib.sha1("\0".join([_java(), *identity]).encode()).hexdigest()[:12]
    return ARCHIVES / f"{program}-{key}.jsa"


class Sharing:
    """The JVM options of one run of a program: use its archive, or write one at exit.

    ``adopt(returncode)`` after the JVM ended keeps a newly written archive, unless the JVM was
    killed (it may have died mid-write)."""

    def __init__(self, archive: Path | None):
        self.archive, self.writing = archive, None
        if archive is None or not enabled():
            self.options: list[str] = []
        elif archive.exists():
            self.options = [f"-XX:SharedArchiveFile={archive}", *QUIET]
        else:
            archive.parent.mkdir(parents=True, exist_ok=True)
            self.writing = archive.with_name(f"{archive.name}.{uuid.uuid4().hex[:8]}.tmp")
            self.options = [f"-XX:ArchiveClassesAtExit={self.writing}", *QUIET]

    def adopt(self, returncode: int | None) -> None:
        if self.writing is None or not self.writing.exists():
            return
        if returncode is not None and returncode >= 0 and not self.archive.exists():
            os.replace(self.writing, self.archive)
        else:
            self.writing.unlink(missing_ok=True)
        self.writing = None


def spark_archive() -> Path:
    import pyspark

    return archive_for("spark-driver", pyspark.__version__, os.path.dirname(pyspark.__file__))


def spark_options() -> list[str]:
    """The driver options that make a Spark driver use the Spark archive, if ``./dev setup`` wrote it."""
    if not enabled() or not spark_archive().exists():
        return []
    return [f"-XX:SharedArchiveFile={spark_archive()}", *QUIET]


def write_spark_archive() -> None:
    """Runs ``tierlog run --until-caught-up`` over a small log, with compaction on, and keeps the
    classes its driver loaded as the Spark archive."""
    import tempfile

    from streaming import config as cfg
    from tests.cli_runner import cli_command, cli_env, write_config
    from tests.tiering_helpers import produce

    archive = spark_archive()
    if not enabled() or archive.exists():
        return
    sharing = Sharing(archive)
    with tempfile.TemporaryDirectory(prefix="tierlog-cds-") as tmp:
        config = write_config(Path(tmp), source={"max_bytes_per_trigger": 60000}, compaction={"enabled": True})
        produce(cfg.load(str(config), env={}), 300)
        opts = " ".join([os.environ.get("SPARK_SUBMIT_OPTS", ""), *sharing.options]).strip()
        result = subprocess.run(cli_command("run", "--until-caught-up", "--config", str(config)),
                                env=cli_env({"SPARK_SUBMIT_OPTS": opts}), capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        sharing.adopt(-1)
        sys.exit(f"writing the Spark class archive failed: `tierlog run` exited with {result.returncode}:\n"
                 f"{result.stderr[-3000:]}")
    sharing.adopt(result.returncode)


if __name__ == "__main__":
    write_spark_archive()

"""Apache Kafka for the tests: one KRaft node (broker and controller in one JVM) on loopback.

The jars come from Maven Central through ``./dev`` (``tests/jvm/kafka/pom.xml``).  The log
cleaner really runs, fast: segments roll every 2 s and a compacted partition is cleaned as soon
as 1% of it is dirty, so a changelog read back after a few seconds is the compacted topic a
user's consumer would see.  ``stop()`` and ``start()`` again keep the data and the port.
"""

from __future__ import annotations

import base64
import uuid
from pathlib import Path

from tests.jvm import JavaProcess, accepts, classpath, free_ports

SETTINGS = {
    "process.roles": "broker,controller", "node.id": 1,
    "controller.listener.names": "CONTROLLER", "inter.broker.listener.name": "PLAINTEXT",
    "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
    "offsets.topic.replication.factor": 1, "offsets.topic.num.partitions": 4,
    "transaction.state.log.replication.factor": 1, "transaction.state.log.min.isr": 1,
    "transaction.state.log.num.partitions": 4, "group.initial.rebalance.delay.ms": 0,
    "num.partitions": 1, "auto.create.topics.enable": "true",
    "log.roll.ms": 2000, "log.cleaner.backoff.ms": 500, "log.cleaner.min.cleanable.ratio": 0.01,
    "log.cleaner.min.compaction.lag.ms": 0, "log.cleaner.dedupe.buffer.size": 8 << 20,
    "log.retention.check.interval.ms": 2000,
}


class ApacheKafka:
    """``start()``, then ``bootstrap``; clients may reach it through a proxy on ``advertised_port``."""

    def __init__(self, root: Path, *, advertised_port: int | None = None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._advertised = advertised_port
        self._configure()
        self.jvm = JavaProcess("Apache Kafka", ["-Xms256m", "-Xmx768m", "-XX:+UseSerialGC", "-cp", classpath("kafka"),
                                                "kafka.Kafka", str(self.config)], self.root / "kafka.out")
        self._formatted = False

    def _configure(self) -> None:
        self.port, self.controller_port = free_ports(2)
        self.advertised_port = self._advertised or self.port
        settings = {
            **SETTINGS, "log.dirs": self.root / "data",
            "controller.quorum.voters": f"1@127.0.0.1:{self.controller_port}",
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.advertised_port}",
        }
        self.config = self.root / "server.properties"
        self.config.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.advertised_port}"

    def start(self, timeout_s: float = 90) -> "ApacheKafka":
        if not self._formatted:
            cluster_id = "-"
            while cluster_id.startswith("-"):  # as Kafka's Uuid.randomUuid: a leading "-" reads as a flag
                cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
            fmt = JavaProcess("kafka-storage format", ["-cp", classpath("kafka"), "kafka.tools.StorageTool", "format",
                                                      "-t", cluster_id, "-c", str(self.config)], self.root / "format.out")
            fmt.start()
            if fmt.wait(60) != 0:
                raise RuntimeError(f"formatting Kafka's log directory failed: see {fmt.log}")
            self._formatted = True
        self.jvm.start_listening(lambda: accepts(self.port), timeout_s, "listening broker", new_ports=self._configure)
        return self

    def stop(self, *, kill: bool = False) -> None:
        """A clean shutdown (SIGTERM), or ``kill`` (SIGKILL)."""
        self.jvm.stop(kill=kill, timeout_s=60)

    def __enter__(self) -> "ApacheKafka":
        return self.start()

    def __exit__(self, *exc) -> None:
        # Killed, for a quick end; stopped cleanly only while the JVM writes its class archive.
        self.stop(kill=self.jvm.sharing is None or self.jvm.sharing.writing is None)

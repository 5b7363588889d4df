"""A real Apache RocketMQ for the tests: a name server and brokers on loopback, and RocketMQ's own
Java client (``tests/jvm/rocketmq/RocketMQHelper.java``) to send to them and read them back.

The broker writes its commitlog under ``root/<broker>/store/commitlog``, which is what tierlog is
pointed at.  Its files are small (``file_size``) so the log rolls within a test, and its delay
levels are all 1 s so delayed messages and consumer retries arrive quickly.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.jvm import CACHE, JavaProcess, accepts, classpath, free_ports, run_java

# Broker JVMs: small heaps for a 2-core test machine; the disk ratios keep a nearly full CI disk
# from switching the broker to read-only.
JVM_OPTS = ["-Xms128m", "-Xmx384m", "-XX:MaxDirectMemorySize=256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
            "-Drocketmq.broker.diskSpaceWarningLevelRatio=0.99", "-Drocketmq.broker.diskSpaceCleanForciblyRatio=0.99"]


class NameServer:
    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        conf = root / "namesrv.conf"
        self._listen = lambda: conf.write_text(f"listenPort={self._pick()}\n")
        self._listen()
        self.jvm = JavaProcess("RocketMQ name server", [*JVM_OPTS, f"-Duser.home={root}", "-cp", classpath("rocketmq"),
                                                       "org.apache.rocketmq.namesrv.NamesrvStartup", "-c", str(conf)],
                               root / "namesrv.out", env={"ROCKETMQ_HOME": str(root)})

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _pick(self) -> int:
        (self.port,) = free_ports()
        return self.port

    def start(self) -> "NameServer":
        self.jvm.start_listening(lambda: accepts(self.port), 60, "listening name server", new_ports=self._listen)
        return self

    def stop(self) -> None:
        self.jvm.stop()


class Broker:
    """One broker of ``name``: ``broker_id`` 0 is the master; a replica (``broker_id`` 1) copies the
    master's commitlog over RocketMQ's classic HA replication."""

    def __init__(self, root: Path, namesrv: NameServer, *, name: str = "broker-a", broker_id: int = 0,
                 file_size: int = 1 << 20, cluster: str = "tierlog"):
        self.root = root / f"{name}-{broker_id}"
        self.root.mkdir(parents=True, exist_ok=True)
        self.name, self.broker_id = name, broker_id
        self.namesrv, self.cluster, self.file_size = namesrv, cluster, file_size
        self.conf = self.root / "broker.conf"
        self._configure()
        self.jvm = JavaProcess(f"RocketMQ broker {name}/{broker_id}",
                               [*JVM_OPTS, f"-Duser.home={self.root}", "-cp", classpath("rocketmq"),
                                "org.apache.rocketmq.broker.BrokerStartup", "-c", str(self.conf)],
                               self.root / "broker.out", env={"ROCKETMQ_HOME": str(self.root)})

    def _configure(self) -> None:
        (self.port,) = free_ports(around=(-2, 0, 1))  # the broker, its fast port (-2) and HA (+1)
        name, broker_id, cluster, namesrv, file_size = self.name, self.broker_id, self.cluster, self.namesrv, self.file_size
        store = self.root / "store"
        settings = {
            "brokerClusterName": cluster, "brokerName": name, "brokerId": broker_id,
            "brokerRole": "ASYNC_MASTER" if broker_id == 0 else "SLAVE",
            "brokerIP1": "127.0.0.1", "brokerIP2": "127.0.0.1", "listenPort": self.port,
            "haListenPort": self.port + 1, "namesrvAddr": namesrv.address,
            "storePathRootDir": store, "storePathCommitLog": store / "commitlog",
            "mappedFileSizeCommitLog": file_size, "autoCreateTopicEnable": "true",
            "flushDiskType": "ASYNC_FLUSH", "diskMaxUsedSpaceRatio": 95,
            "messageDelayLevel": " ".join(["1s"] * 18),
            "transactionCheckInterval": 3000, "transactionTimeOut": 2000,
        }
        self.conf.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))

    @property
    def commitlog(self) -> str:
        return str(self.root / "store" / "commitlog")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "Broker":
        boots = self.jvm.log.read_text(errors="replace").count("boot success") if self.jvm.log.exists() else 0
        booted = lambda: self.jvm.log.read_text(errors="replace").count("boot success") > boots  # noqa: E731
        self.jvm.start_listening(booted, 90, "'boot success' line", new_ports=self._configure)
        return self

    def stop(self, *, kill: bool = False) -> None:
        self.jvm.stop(kill=kill)


class Client:
    """RocketMQ's Java client, through the helper: each call is one JVM run that prints JSON lines."""

    def __init__(self, namesrv: NameServer, root: Path):
        self.namesrv, self.root = namesrv, root

    def _run(self, *args: str, timeout_s: float = 180) -> list[dict]:
        result = run_java(
            ["-Xmx256m", "-XX:TieredStopAtLevel=1", f"-Duser.home={self.root}",
             "-cp", f"{CACHE / 'rocketmq-helper.jar'}:{classpath('rocketmq')}", "RocketMQHelper", args[0], self.namesrv.address,
             *args[1:]],
            capture_output=True, text=True, timeout=timeout_s)
        if result.returncode != 0:
            raise RuntimeError(f"RocketMQHelper {args[0]} exited with {result.returncode}:\n{result.stderr[-4000:]}")
        return [json.loads(line) for line in result.stdout.splitlines()]

    def create_topics(self, broker: Broker, topics: dict[str, int]) -> None:
        """Creates ``topics`` (name: queue count) on ``broker`` and waits until the name server routes them."""
        self._run("topics", broker.address, *(f"{t}:{q}" for t, q in topics.items()))

    def send(self, *, seed: int, topics: list[str], messages: int, queues: int = 4, keys: int = 20, batches: int = 0,
             delayed: int = 0, large: int = 0, transactions: int = 0) -> list[dict]:
        """Sends the workload; returns the sender's ledger, one entry per message the broker accepted."""
        spec = {"seed": seed, "topics": topics, "messages": messages, "queues": queues, "keys": keys,
                "batches": batches, "delayed": delayed, "large": large, "transactions": transactions}
        return self._run("send", json.dumps(spec))

    def fail(self, group: str, topic: str, n: int, max_reconsume: int = 1) -> list[dict]:
        """A consumer group that fails ``n`` messages of ``topic`` until the broker dead-letters them."""
        return self._run("fail", group, topic, str(n), str(max_reconsume))

    def read(self, *topics: str) -> list[dict]:
        """Every message the broker serves for ``topics``, through its consume path."""
        return self._run("read", *topics)

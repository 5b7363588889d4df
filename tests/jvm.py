"""The Java programs the tests run, fetched by ``./dev`` from Maven Central (see ``tests/jvm/``).

``./dev test`` resolves each ``tests/jvm/NAME/pom.xml`` once into ``.cache/jvm/NAME.classpath``
(the jars stay in Maven's local repository) and compiles the RocketMQ helper into
``.cache/jvm/rocketmq-helper.jar``.  Nothing here downloads.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import time
from pathlib import Path

from tests import jit
from tests.class_sharing import Sharing, archive_for

ROOT = Path(__file__).parents[1]
CACHE = ROOT / ".cache" / "jvm"


class JvmMissing(RuntimeError):
    pass


def classpath(name: str) -> str:
    """The class path of ``tests/jvm/NAME``; raises naming the command that makes it."""
    path = CACHE / f"{name}.classpath"
    if not path.exists():
        raise JvmMissing(f"{path} is missing: run `./dev setup` (it fetches tests/jvm/{name}/pom.xml "
                         "from Maven Central once, with Maven and a JDK 17)")
    return path.read_text().strip()


def java() -> str:
    home = os.environ.get("JAVA_HOME")
    return os.path.join(home, "bin", "java") if home else "java"


def free_ports(n: int = 1, *, around: tuple[int, ...] = (0,)) -> list[int]:
    """``n`` loopback ports, each with ``port + d`` free for every ``d`` in ``around`` (a RocketMQ
    broker also listens on its port - 2 and + 1).

    Why below the kernel's ephemeral range: a port found free there can be taken, before the JVM
    binds it, as the source port of any outgoing connection on the machine (Spark, Kafka clients of
    another test worker); CI lost a replica broker's HA port that way.  Ports below the range are
    taken only by a listener that asks for them, so a clash needs another worker's random pick of
    the same port, and ``JavaProcess.start_listening`` covers that."""
    low, _ = _ephemeral_range()
    span = (max(1024, low - 16384) - min(around), low - max(around))
    found: list[int] = []
    while len(found) < n:
        port = random.randrange(*span)
        if all(_free(port + d) for d in around) and not {p + e for p in found for e in around} & {port + d for d in around}:
            found.append(port)
    return found


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def address_in_use(log: Path, since: int) -> bool:
    """Whether a JVM's output past byte ``since`` says a port it wanted was taken."""
    with open(log, "rb") as f:
        f.seek(since)
        return b"Address already in use" in f.read()


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def sharing(argv: list[str]) -> Sharing:
    """Class data sharing for a run of ``java argv`` (``-cp CLASSPATH MainClass ...``): see
    ``tests/class_sharing.py``."""
    at = argv.index("-cp")
    path, main = argv[at + 1], argv[at + 2]
    if any(os.path.isdir(entry) for entry in path.split(os.pathsep)):
        return Sharing(None)  # the JVM refuses to share classes from a directory
    # The JVM ignores an archive whose jars changed since; a rebuilt helper jar gets a new one.
    stats = [os.stat(e) for e in path.split(os.pathsep) if os.path.exists(e)]
    stamps = [f"{st.st_size}:{st.st_mtime_ns}" for st in stats]
    return Sharing(archive_for(main.rsplit(".", 1)[-1], path, main, *stamps))


def run_java(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` of ``java argv``, with class data sharing."""
    shared = sharing(argv)
    returncode = None  # a run that timed out keeps no archive
    try:
        result = subprocess.run([java(), *shared.options, *jit.options(), *argv], **kwargs)
        returncode = result.returncode
    finally:
        shared.adopt(returncode)
    return result


class JavaProcess:
    """One JVM started in the background with its output in ``log``; ``stop()`` or ``wait()`` ends it."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict | None = None):
        self.name, self.argv, self.log, self.env = name, argv, log, env
        self.process: subprocess.Popen | None = None
        self.sharing: Sharing | None = None

    def start(self) -> None:
        self.sharing = sharing(self.argv)
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen([java(), *self.sharing.options, *jit.options(), *self.argv], stdout=out,
                                            stderr=subprocess.STDOUT, env={**os.environ, **(self.env or {})},
                                            start_new_session=True)

    def wait(self, timeout_s: float) -> int:
        """Waits for the JVM to exit by itself; its exit code."""
        code = self.process.wait(timeout_s)
        self.sharing.adopt(code)
        return code

    def start_listening(self, ready, timeout_s: float, what: str, *, new_ports, attempts: int = 4) -> None:
        """``start()`` then ``wait_until``; when the JVM lost a port to another process between
        ``free_ports`` and its bind, ``new_ports()`` (which rewrites its configuration) and again.
        A restart (it ran before) keeps its ports: clients and peers know that address."""
        if self.process is not None:
            self.start()
            return self.wait_until(ready, timeout_s, what)
        for attempt in range(attempts):
            since = self.log.stat().st_size if self.log.exists() else 0
            self.start()
            try:
                return self.wait_until(ready, timeout_s, what)
            except RuntimeError:
                if attempt == attempts - 1 or not address_in_use(self.log, since):
                    raise
                self.stop(kill=True)
                new_ports()

    def wait_until(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode} before {what}: see {self.log}")
            if time.monotonic() > deadline:
                self.stop(kill=True)
                raise RuntimeError(f"{self.name}: no {what} within {timeout_s:.0f} s: see {self.log}")
            time.sleep(0.1)

    def stop(self, *, kill: bool = False, timeout_s: float = 30.0) -> None:
        """SIGTERM (the JVM's shutdown hooks run) or, with ``kill``, SIGKILL; then wait."""
        if self.process is None:
            return
        if self.process.poll() is None:
            if kill:
                self.process.kill()
            else:
                self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.sharing.adopt(self.process.returncode)

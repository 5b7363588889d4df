"""A TCP proxy on loopback that can cut a broker off: the Kafka outage of the chaos harness.

The broker advertises the proxy's address, so every client connection goes
through it.  ``down()`` closes the port and every open connection (clients see
connection refused and their in-flight requests fail, as when a broker stops);
``up()`` opens it again on the same port.  The broker itself keeps running, so
cuts can come many times a run and cost no broker restart; the outage test in
``tests/test_kafka_outage.py`` stops and restarts the broker itself.
"""

from __future__ import annotations

import socket
import threading
import time

from pathlib import Path

from tests.jvm import free_ports
from tests.kafka_broker import ApacheKafka


class TcpFaultProxy:
    def __init__(self, upstream_port: int, port: int = 0):
        self.upstream = ("127.0.0.1", upstream_port)
        self.port = port
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.cut = 0  # client connections open when down() closed them

    @property
    def is_up(self) -> bool:
        return self._listener is not None

    @property
    def connections(self) -> int:
        """Client connections open through the proxy now."""
        with self._lock:
            return len(self._conns) // 2

    def up(self) -> "TcpFaultProxy":
        deadline = time.monotonic() + 30
        while True:
            try:
                listener = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
                break
            except OSError:  # the port is still being released
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def down(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            # close() alone leaves a thread blocked in accept() holding the socket open, and the
            # next client got through during the "outage" (a kafka-python producer sent a whole
            # batch so); shutdown() wakes that accept() with an error.
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
            self.cut += len(conns) // 2  # each a client's socket and its upstream one
        for conn in conns:
            _close(conn)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed by down()
            if self._listener is not listener:  # accepted as down() ran
                _close(client)
                return
            try:
                server = socket.create_connection(self.upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._conns.update((client, server))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                _close(s)
                with self._lock:
                    self._conns.discard(s)


def proxied_broker(root: Path) -> tuple[ApacheKafka, TcpFaultProxy]:
    """A started Apache Kafka under ``root`` that advertises a proxy in front of it, and that proxy, up."""
    (port,) = free_ports()  # below the ephemeral range: no outgoing connection takes it before the proxy binds
    broker = ApacheKafka(root, advertised_port=port)
    broker.start()
    try:
        proxy = TcpFaultProxy(broker.port, port=port)  # after start: a port lost to another process is replaced
        proxy.up()
    except BaseException:
        broker.stop(kill=True)
        raise
    return broker, proxy


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()

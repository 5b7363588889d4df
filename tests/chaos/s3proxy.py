"""A faulty S3 endpoint: an HTTP proxy on loopback in front of a real S3 server (moto), that fails on demand.

The service talks to it through ``AWS_ENDPOINT_URL_S3`` like any S3 endpoint.
Its modes are what a real store does on a bad day:

* ``ok``: every request is forwarded;
* ``errors``: a share of requests get ``500 InternalError`` or ``503 ServiceUnavailable``;
* ``throttle``: a share get ``503 SlowDown``, and the rest are delayed;
* ``timeouts``: a share are held past the client's read timeout, then dropped;
* ``down``: the port is closed (connection refused) until the mode changes.

Nothing is mocked: the requests that pass reach a real S3 HTTP server.
"""

from __future__ import annotations

import http.client
import random
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}
_ERROR = b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>%s</Code><Message>%s</Message></Error>'


class S3FaultProxy:
    """``start()``; ``endpoint``; ``set_mode(mode, share)``; ``stop()``.

    Counts what it did in ``injected``: each error code and timeout it caused, and under
    ``retried`` each request it failed that later came again and went through; ``requests`` lists
    every request it forwarded.  The first
    request after a switch to a failing mode always fails, so a short window still injects.
    """

    def __init__(self, upstream: str, *, seed: int = 0, hold_s: float = 35.0):
        host, _, port = upstream.removeprefix("http://").partition(":")
        self.upstream = (host, int(port))
        self.rng = random.Random(seed)
        self.hold_s = hold_s  # longer than the service's S3 read timeout (30 s)
        self.mode, self.share = "ok", 0.0
        self.injected: dict[str, int] = {}
        self.port = 0
        self._server: ThreadingHTTPServer | None = None
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._fail_next = False
        self._failed: set[tuple[str, str]] = set()  # (method, path) of requests failed and not yet redone
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request it forwarded

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "S3FaultProxy":
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def setup(self):
                super().setup()
                proxy._connections.add(self.connection)

            def finish(self):
                proxy._connections.discard(self.connection)
                super().finish()

            def _any(self):
                if proxy.mode == "down":  # a connection opened before the port closed
                    self.close_connection = True
                    return
                proxy._handle(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        """Close the port and every open connection, as a store that went away would."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        for conn in list(self._connections):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def set_mode(self, mode: str, share: float = 0.0) -> None:
        """Switch modes; ``down`` closes the port, leaving it reopens it on the same port."""
        with self._lock:
            was_down = self.mode == "down"
            self.mode, self.share = mode, share
            self._fail_next = mode in ("errors", "throttle", "timeouts")
            if mode == "down" and not was_down:
                self.stop()
            elif was_down and mode != "down":
                self._reopen()

    def _reopen(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                self.start()
                return
            except OSError:  # the port is still being released
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _count(self, what: str, request: tuple[str, str]) -> None:
        with self._lock:
            self.injected[what] = self.injected.get(what, 0) + 1
            self._failed.add(request)

    def _handle(self, req: BaseHTTPRequestHandler) -> None:
        body = _read_body(req)
        with self._lock:
            mode, share, first = self.mode, self.share, self._fail_next
            self._fail_next = False
        hit = first or self.rng.random() < share
        request = (req.command, req.path)
        if mode == "errors" and hit:
            code, status = self.rng.choice([("InternalError", 500), ("ServiceUnavailable", 503)])
            return self._fail(req, status, code, request)
        if mode == "throttle":
            if hit:
                return self._fail(req, 503, "SlowDown", request)
            time.sleep(self.rng.uniform(0.05, 0.5))
        if mode == "timeouts" and hit:
            self._count("timeout", request)
            time.sleep(self.hold_s)
            req.close_connection = True
            return
        with self._lock:
            self.requests.append(request)
        if self._forward(req, body):
            with self._lock:
                if request in self._failed:
                    self._failed.discard(request)
                    self.injected["retried"] = self.injected.get("retried", 0) + 1

    def _fail(self, req: BaseHTTPRequestHandler, status: int, code: str, request: tuple[str, str]) -> None:
        self._count(code, request)
        payload = _ERROR % (code.encode(), b"injected by the chaos harness")
        req.send_response(status)
        req.send_header("Content-Type", "application/xml")
        req.send_header("Content-Length", str(len(payload)))
        req.end_headers()
        if req.command != "HEAD":
            req.wfile.write(payload)

    def _forward(self, req: BaseHTTPRequestHandler, body: bytes) -> bool:
        """Pass the request to the upstream; True when its answer was a success (2xx)."""
        conn = http.client.HTTPConnection(*self.upstream, timeout=120)
        try:
            headers = {k: v for k, v in req.headers.items() if k.lower() not in _HOP_BY_HOP | {"host"}}
            if body or req.command in ("PUT", "POST"):
                headers["Content-Length"] = str(len(body))
            conn.request(req.command, req.path, body=body or None, headers=headers)
            resp = conn.getresponse()
            payload = resp.read()
        except (OSError, http.client.HTTPException):
            req.close_connection = True  # the client sees a reset and retries
            return False
        finally:
            conn.close()
        req.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length":
                req.send_header(k, v)
        if req.command == "HEAD":
            req.send_header("Content-Length", resp.getheader("Content-Length", "0"))
        else:
            req.send_header("Content-Length", str(len(payload)))
        req.end_headers()
        if req.command != "HEAD":
            try:
                req.wfile.write(payload)
            except (BrokenPipeError, ConnectionResetError, socket.timeout):
                return False
        return 200 <= resp.status < 300


def _read_body(req: BaseHTTPRequestHandler) -> bytes:
    if req.headers.get("Transfer-Encoding", "").lower() == "chunked":
        chunks = []
        while True:
            size = int(req.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while req.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(chunks)
            chunks.append(req.rfile.read(size))
            req.rfile.readline()
    length = int(req.headers.get("Content-Length") or 0)
    return req.rfile.read(length) if length else b""

"""The mirror's driver-side sends, in a process of their own.

    MirrorHandler._send (the driver's mirror thread)
      -> SenderProcess.send(task)  -- a pickled SendTask on the child's stdin
         child: send_slot(task, 0, its open backend)  -- reads the staging objects, sends to Kafka
      <- the slot's outcome, and the log records the child wrote

Why a process: on the driver the mirror's sends (reading staging objects back, building records,
librdkafka's ``produce``) and the driver's staging of the tier's batches share one interpreter
lock, which at high rates is busy most of every second.  The child holds its own lock; what
crosses the pipe is a task of a few kilobytes and an outcome.  Why not by default
(``kafka.mirror_process``): on a full 2-core host the tier's p99 fell but Kafka's rose, the sender
no longer taking turns with the staging (docs/benchmarks.md); the CPU was the same.

Contract: ``send(task)`` returns ``send_slot(task, 0)``'s outcome, computed in the child, or the
outcome of a failed slot (``retriable``) when the child died mid-batch: the handler then reads the
positions back from Kafka and sends the batch again, as after any failed slot, so nothing is sent
twice.  A non-retriable error the child raised is raised here as a ``TierlogError`` with its
message and exit code.  A child that cannot start is a ``SenderGone`` naming the command; what it
printed is in tierlog's log.  The child
ends when its stdin closes (``close``, or the driver's death), after flushing its producer.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import traceback

from connectors.errors import TierlogError
from connectors.faults import DRIVER_PID

log = logging.getLogger("tierlog.mirror")

_HEADER = struct.Struct("<I")
_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 3))  # the checkout: streaming/queries/mirror/..
READY = "ready"


class SenderGone(TierlogError):
    """The mirror's sender process could not start."""


class SenderProcess:
    """One child process that runs the driver's mirror sends (see the module).  Thread-safe: one
    send at a time.  Started on the first ``send`` (or ``start``); started again after it died."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._closed = False  # a start after close (its thread came late) starts nothing
        self.pid: int | None = None

    def start(self) -> None:
        with self._lock:
            if not self._closed:
                self._ensure()

    def _ensure(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH", "")) if p)
        # A crash point in the child kills the driver, as one in the driver's own sends did.
        env.setdefault(DRIVER_PID, str(os.getpid()))
        cmd = [sys.executable, "-m", "streaming.queries.mirror.sender_process"]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env, cwd=_ROOT)
        threading.Thread(target=_forward_stderr, args=(proc.stderr,), name="mirror-sender-err", daemon=True).start()
        reply = _read(proc.stdout)
        if reply != READY:
            proc.kill()
            proc.wait()
            raise SenderGone(f"the mirror's sender process ({' '.join(cmd)}) did not start: it exited with "
                             f"code {proc.returncode}; its output is in tierlog's log. Check that this Python "
                             f"({sys.executable}) has tierlog's dependencies installed.")
        self._proc, self.pid = proc, proc.pid
        return proc

    def send(self, task) -> dict:
        """``send_slot(task, 0)``'s outcome, from the child (see the module's contract)."""
        with self._lock:
            proc = self._ensure()
            try:
                _write(proc.stdin, task)
                reply = _read(proc.stdout)
            except (BrokenPipeError, OSError):
                reply = None
            if reply is None:  # it died: killed, out of memory, a crash point
                code = proc.wait()
                self._proc = None
                return _failed(f"the mirror's sender process ended (exit code {code}) in the middle of a batch")
        kind, value, records = reply
        for name, level, message in records:
            logging.getLogger(name).log(level, "%s", message)
        if kind == "ok":
            return value
        message, retriable, code, ours, trace = value
        log.log(logging.DEBUG if ours else logging.ERROR, "the mirror's sender process failed:\n%s", trace)
        if retriable:
            return _failed(message)
        error = TierlogError(message)
        error.exit_code = code  # what `tierlog` exits with, as for the error the child met
        raise error

    def close(self, timeout_s: float = 15.0) -> None:
        """End the child: it flushes and closes its producer first; killed after ``timeout_s``."""
        with self._lock:
            proc, self._proc, self._closed = self._proc, None, True
            if proc is None:
                return
            try:
                proc.stdin.close()
            except OSError:
                pass
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("the mirror's sender process did not end within %.0f s; killed", timeout_s)
                proc.kill()
                proc.wait()


def _failed(message: str) -> dict:
    return {"slot": 0, "sent": 0, "skipped": 0, "bytes": 0, "partitions": "{}", "positions": "{}",
            "too_large": "[]", "error": message, "retriable": True}


def _forward_stderr(stream) -> None:
    """The child's stray output (a library's print, an interpreter's crash) into tierlog's log."""
    for line in stream:
        text = line.decode(errors="replace").rstrip()
        if text:
            log.warning("mirror sender: %s", text)


def _write(stream, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read(stream):
    """The next object, or None at the end of the stream (a frame cut short included)."""
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    size = _HEADER.unpack(head)[0]
    data = stream.read(size)
    if len(data) < size:  # the writer died in the middle of it
        return None
    return pickle.loads(data)


class _Records(logging.Handler):
    """The child's log records, handed back with each outcome for the driver's log."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[tuple[str, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + "".join(traceback.format_exception(*record.exc_info))
        self.records.append((record.name, record.levelno, message))

    def take(self) -> list:
        taken, self.records = self.records, []
        return taken


def main() -> None:
    """The child: tasks in on stdin, outcomes out on stdout, until stdin closes."""
    from connectors.kafka.sink import close_shared_producer
    from connectors.threads import name_native
    from connectors.tier.location import open_backend
    from streaming.queries.mirror.send import send_slot

    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a stray print must not corrupt the replies
    records = _Records()
    root = logging.getLogger()
    root.handlers[:] = [records]
    root.setLevel(logging.INFO)
    name_native("mirror-sender")
    # A terminal's Ctrl-C and a service manager's SIGTERM reach the whole group: the driver stops
    # gracefully and then closes stdin, which ends this loop after the batch in hand.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    backends, settings = {}, []
    _write(out, READY)
    try:
        while (task := _read(inp)) is not None:
            try:
                key = (task.location, task.copies)
                if key not in backends:
                    backends[key] = open_backend(task.location, copies=task.copies)
                if task.kafka not in settings:
                    settings.append(task.kafka)
                reply = ("ok", send_slot(task, 0, backends[key]), records.take())
            except Exception as exc:  # noqa: BLE001 - handed to the driver, which decides
                retriable = bool(getattr(exc, "retriable", False))
                ours = isinstance(exc, TierlogError)
                message = str(exc) if ours else f"the mirror's sender process failed: {type(exc).__name__}: {exc}"
                code = exc.exit_code if ours else 1
                reply = ("error", (message, retriable, code, ours, traceback.format_exc()), records.take())
            _write(out, reply)
    finally:
        for kafka in settings:
            close_shared_producer(kafka)
        for backend in backends.values():
            backend.close()


if __name__ == "__main__":
    main()

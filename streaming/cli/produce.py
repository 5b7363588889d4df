"""``tierlog produce``: append messages to the commitlog with the embedded producer (a workload, or JSON lines on stdin)."""

from __future__ import annotations

import base64
import json
import logging
import sys
import time
from typing import Iterator

from connectors.errors import ConfigError
from streaming import config as cfg
from streaming.cli.output import emit
from streaming.settings import Settings, derive

log = logging.getLogger("tierlog")


def _paced(messages: Iterator, rate: float, batch: int) -> Iterator[list]:
    """Group messages into batches, sleeping so that ``rate`` msgs/s is not exceeded (0: no limit)."""
    started = time.monotonic()
    sent = 0
    chunk: list = []
    for m in messages:
        chunk.append(m)
        if len(chunk) >= batch:
            yield chunk
            sent += len(chunk)
            chunk = []
            if rate:
                ahead = sent / rate - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)
    if chunk:
        yield chunk


def _stdin_messages(stream) -> Iterator:
    """JSON lines: {"topic", "queue_id", "body" | "body_b64", "properties", "keys", "tags"}."""
    from connectors.commitlog.format import Message

    for lineno, line in enumerate(stream, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            props = dict(obj.get("properties") or {})
            for name, prop in (("keys", "KEYS"), ("tags", "TAGS")):
                if obj.get(name) is not None:
                    props[prop] = str(obj[name])
            body = base64.b64decode(obj["body_b64"]) if "body_b64" in obj else str(obj.get("body", "")).encode()
            yield Message(topic=str(obj["topic"]), queue_id=int(obj.get("queue_id", 0)), body=body, properties=props)
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"stdin line {lineno}: not a message ({exc}); expected JSON with at least \"topic\"") from None


def cmd_produce(args, conf: cfg.Config) -> int:
    from connectors.commitlog.workload import Workload

    if args.stdin:
        messages, total = _stdin_messages(sys.stdin), None
    else:
        try:
            workload = Workload(
                messages=args.messages, topics=args.topics, queues=args.queues, keys=args.keys,
                body_size=args.body_size, delete_ratio=args.delete_ratio, seed=args.seed,
            )
        except ValueError as exc:
            raise ConfigError(f"tierlog produce: {exc}") from None
        messages, total = workload.generate(), args.messages
    emit([produce(derive(conf), messages, total, args.rate)], args.format)
    return 0


def produce(settings: Settings, messages: Iterator, total: int | None = None, rate: float = 0.0) -> dict:
    """Append ``messages`` to ``commitlog.dir`` at up to ``rate`` messages/s (0: no limit), logging
    progress every 2 s; what was appended, as one summary row."""
    from connectors.commitlog.writer import CommitLogWriter

    p, directory = settings.producer, settings.paths.commitlog
    produced = nbytes = 0
    last_report = started = time.monotonic()
    with CommitLogWriter(directory, file_size=p.file_size, fsync=p.fsync, fsync_interval_s=p.fsync_interval_s) as w:
        first = w.offset
        for chunk in _paced(messages, rate, max(1, min(1000, int(rate / 20) or 1000))):
            try:
                w.append_many(chunk)
            except ValueError as exc:
                raise ConfigError(
                    f"tierlog produce: a message after the first {produced} was refused: {exc}; the "
                    f"{produced} before its chunk of {len(chunk)} are in the commitlog, that chunk is not"
                ) from None
            produced += len(chunk)
            nbytes += sum(m.size for m in chunk)
            if time.monotonic() - last_report >= 2:
                last_report = time.monotonic()
                of = f"/{total}" if total else ""
                log.info("produced %d%s messages (%.0f msgs/s)", produced, of, produced / (last_report - started))
        end = w.offset
    elapsed = time.monotonic() - started
    return {"messages": produced, "bytes": nbytes, "from_phy": first, "end_phy": end,
            "seconds": round(elapsed, 3), "msgs_per_s": round(produced / elapsed) if elapsed else None,
            "commitlog": directory}

"""How the CLI prints rows: a table for people, or one JSON object per line for scripts."""

from __future__ import annotations

import base64
import json
import sys
from datetime import datetime, timezone
from typing import Iterable

from connectors.errors import ConfigError


def emit(rows: Iterable[dict], fmt: str, columns: list[str] | None = None, out=None) -> int:
    """Print rows as JSON lines or an aligned table; returns how many were printed."""
    out = out or sys.stdout
    rows = list(rows)
    if fmt == "json":
        for row in rows:
            out.write(json.dumps(row, default=_json_default, ensure_ascii=False) + "\n")
        return len(rows)
    columns = columns or (list(rows[0]) if rows else [])
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    out.write("  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip() + "\n")
    for r in cells:
        out.write("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() + "\n")
    return len(rows)


def parsed_body(body, typed: bool) -> dict:
    """What a JSON line adds for a body of a topic whose bodies are JSON (``topics.body_format``):
    ``value``, the body parsed, or null and ``value_error`` when it is not a JSON object (the raw
    ``body`` is printed beside it either way); nothing for other topics."""
    if not typed or body is None:
        return {}
    try:
        value = json.loads(bytes(body))
    except (ValueError, UnicodeDecodeError):
        value = None
    if isinstance(value, dict):
        return {"value": value}
    return {"value": None, "value_error": "the body is not a JSON object"}


def _json_default(value):
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode()
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"cannot encode {type(value).__name__}")


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes_cell(bytes(value))
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def ms_to_iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat(timespec="milliseconds")


def bytes_cell(value: bytes, width: int = 24) -> str:
    """A body in a table: its text when it is UTF-8 (control characters escaped), else ``base64:``
    and its base64, so binary never reaches a terminal raw; cut at ``width`` characters with ``…``."""
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        encoded = base64.b64encode(value[: width * 3 // 4]).decode()
        return "base64:" + encoded + ("…" if len(value) > width * 3 // 4 else "")
    shown = "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text[:width])
    return shown + ("…" if len(text) > width else "")


def parse_time(text: str) -> int:
    """Epoch milliseconds, an ISO 8601 / RFC 3339 time (UTC unless it says otherwise), or ``now``."""
    if text == "now":
        return int(datetime.now(timezone.utc).timestamp() * 1000)
    if text.lstrip("-").isdigit():
        value = int(text)
        if 10**9 <= abs(value) < 10**11:  # 2001 to 5138 in seconds; 1970-01-12 to 1973-03 in milliseconds
            raise ConfigError(f"time {text!r} looks like epoch seconds ({ms_to_iso(value * 1000)}); tierlog takes "
                              f"epoch milliseconds ({text}000) or ISO 8601")
        return value
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(f"time {text!r}: use epoch milliseconds, ISO 8601 like 2026-11-21T10:00:00Z, or now") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return int(parsed.timestamp() * 1000)

"""Reading a data source's options, which Spark hands over as strings: each bad one is a
``ConfigError`` naming the option and its value, never a bare ``ValueError``."""

from __future__ import annotations

from connectors.commitlog.arrow import project_ddl
from connectors.errors import ConfigError


def columns(raw: str | None) -> tuple[str, ...] | None:
    """The ``columns`` option: a comma-separated subset of the message row, checked here."""
    if raw is None or not str(raw).strip():
        return None
    columns = tuple(c.strip() for c in str(raw).split(",") if c.strip())
    try:
        project_ddl(columns)
    except ValueError as exc:
        raise ConfigError(f"option columns={raw!r}: {exc}") from None
    return columns


def positive(opts: dict, key: str, name: str) -> int | None:
    raw = opts.get(key)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ConfigError(f"option {name}={raw!r}: expected a positive whole number")
    return value


def flag(opts: dict, key: str, name: str, default: bool) -> bool:
    raw = opts.get(key)
    if raw is None:
        return default
    if str(raw).lower() in ("true", "false"):
        return str(raw).lower() == "true"
    raise ConfigError(f"option {name}={raw!r}: expected true or false")


def required_columns(raw: str | None) -> tuple[str, ...]:
    """The ``columns`` option of a source that yields nothing without it."""
    found = columns(raw)
    if not found:
        raise ConfigError("option columns: name the message columns to read (comma-separated)")
    return found


def offset(opts: dict, key: str, name: str) -> int:
    """A physical offset option (0 when not given)."""
    raw = opts.get(key)
    if raw is None or raw == "":
        return 0
    if not str(raw).strip().isdigit():
        raise ConfigError(f"option {name}={raw!r}: expected a physical offset (a whole number, 0 or more)")
    return int(raw)

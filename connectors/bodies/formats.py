"""Which body format each topic's bodies are in (``topics.body_format``)."""

from __future__ import annotations

import fnmatch

from connectors.bodies.base import BodyFormat, BytesFormat
from connectors.bodies.json_body import JsonFormat
from connectors.errors import ConfigError


def formats() -> dict[str, type[BodyFormat]]:
    """Every body format, by the name ``topics.body_format`` gives it."""
    return {"bytes": BytesFormat, "json": JsonFormat}


class BodyFormats:
    """Which format each topic's bodies are in: ``glob=format`` pairs (``orders=json,events-*=json``),
    the first matching glob wins, and ``bytes`` for every topic none matches."""

    def __init__(self, spec: str = "", source: str = "topics.body_format"):
        known = formats()
        self.rules: list[tuple[str, BodyFormat]] = []
        for item in filter(None, (part.strip() for part in spec.split(","))):
            glob, sep, name = item.partition("=")
            glob, name = glob.strip(), name.strip()
            if not sep or not glob or name not in known:
                raise ConfigError(f"setting {source}: {item!r} is not topic=format; give comma-separated "
                                  f"pairs such as orders=json,events-*=json, each format one of "
                                  f"{', '.join(sorted(known))}")
            self.rules.append((glob, known[name]()))
        self._default = BytesFormat()
        self._cache: dict[str, BodyFormat] = {}

    def of(self, topic: str) -> BodyFormat:
        found = self._cache.get(topic)
        if found is None:
            found = next((fmt for glob, fmt in self.rules if fnmatch.fnmatchcase(topic, glob)), self._default)
            self._cache[topic] = found
        return found

    def typed(self, topic: str) -> bool:
        """Whether ``topic``'s bodies get typed columns."""
        return not isinstance(self.of(topic), BytesFormat)

    def __bool__(self) -> bool:
        return any(not isinstance(fmt, BytesFormat) for _, fmt in self.rules)

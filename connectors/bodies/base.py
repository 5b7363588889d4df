"""A topic's body format: what turns its message bodies into typed columns beside the raw ``body``.

The contract of a format (one small class each): ``typed(bodies, known)`` takes a batch's bodies
(an Arrow binary array, one per message, in order) and the typed columns the topic's table has so
far (``known``, an Arrow schema; empty at first), and returns a :class:`Typed`: one column per
field of the evolved schema, in its order, one row per body, and ``_body_errors``, the fields of
each row that did not fit (null when all did).  The evolved schema only ever grows: new fields are
appended, and a type changes only by ``widened``.  Nothing is dropped: a body the format cannot
read keeps its typed columns null and says so in ``_body_errors``; the raw body is always kept by
the caller.  A format never raises for a body.
"""

from __future__ import annotations

import fnmatch
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import pyarrow as pa

from connectors.errors import ConfigError

ERRORS = "_body_errors"  # per row: the fields that did not fit its type, "$" for the body as a whole
WHOLE = "$"
ERRORS_TYPE = pa.list_(pa.string())


@dataclass
class Typed:
    """The typed columns of one batch of bodies."""

    columns: pa.Table  # the evolved schema's fields, then ERRORS
    schema: pa.Schema  # the evolved schema (without ERRORS): ``known`` grown
    widened: set[str] = field(default_factory=set)  # dotted paths of known fields whose type widened
    unreadable: int = 0  # bodies that were not what the format reads at all (their ERRORS is ["$"])


class BodyFormat(ABC):
    """How one topic's bodies are read.  Stateless: the schema lives in the topic's table."""

    name = ""

    @abstractmethod
    def typed(self, bodies: pa.Array, known: pa.Schema) -> Typed | None:
        """The typed columns of ``bodies`` given the ``known`` schema; None: this format has none."""


class BytesFormat(BodyFormat):
    """The default: the body stays bytes, with no typed columns."""

    name = "bytes"

    def typed(self, bodies: pa.Array, known: pa.Schema) -> Typed | None:
        return None


def formats() -> dict[str, type[BodyFormat]]:
    from connectors.bodies.json_body import JsonFormat

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

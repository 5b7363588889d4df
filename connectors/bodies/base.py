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

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

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
    dropped: bool = False  # some values were left out for want of a type (a field seen only as {} or [])


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


def to_type(arr, type_: pa.DataType):
    """``arr`` as ``type_``, a type it grew into: struct fields it lacks are null, longs widen."""
    if arr.type == type_:
        return arr
    if isinstance(arr, pa.ChunkedArray):
        return pa.chunked_array([to_type(c, type_) for c in arr.chunks], type=type_)
    if pa.types.is_struct(type_):
        have = {f.name: i for i, f in enumerate(arr.type)}
        children = [to_type(arr.field(have[f.name]), f.type) if f.name in have else pa.nulls(len(arr), f.type)
                    for f in type_]
        return pa.StructArray.from_arrays(children, fields=list(type_), mask=arr.is_null())
    if pa.types.is_list(type_):
        offsets = pc.subtract(arr.offsets, arr.offsets[0]) if len(arr) else arr.offsets
        return pa.ListArray.from_arrays(offsets, to_type(arr.flatten(), type_.value_type), type=type_,
                                        mask=arr.is_null())
    return arr.cast(type_)


def as_schema(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Typed columns (``ERRORS`` last) as ``schema``, a schema they grew into since they were read:
    a later part of their batch, or the table's after another file of the commit widened it."""
    cols = {name: table.column(name) for name in table.column_names}
    n = table.num_rows
    out = {f.name: to_type(cols[f.name], f.type) if f.name in cols else pa.nulls(n, f.type) for f in schema}
    out[ERRORS] = cols[ERRORS]
    return pa.table(out)

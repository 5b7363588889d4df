"""What the tables of a topic with typed columns (``topics.body_format``) share: the typed copies of
the tier's files they list in their place, and the typed columns of a table's schema.

Why copies, and not the tier's own files: a column's type may widen, and Iceberg's rules let a
file's long be read as a double only when the file is rewritten, which the tables may do to their
own files but never to the tier's (docs/architecture.md, "Typed columns").
"""

from __future__ import annotations

import io
import re

import pyarrow as pa
import pyarrow.parquet as pq

from connectors.bodies.base import ERRORS
from connectors.commitlog.arrow import MESSAGE_SCHEMA
from connectors.tier import layout

# + the name of the tier object copied (a sealed segment, a compacted snapshot), ".parquet" cut,
# + ".s<the table's schema id when it was written>.parquet"
TYPED_PREFIX = "_tables/typed/"
_SCHEMA_SUFFIX = re.compile(r"\.s\d+\.parquet$")


def copy_name(name: str, schema_id: int) -> str:
    """The name of a typed copy of the tier object ``name``, written at the table's ``schema_id``."""
    return versioned(TYPED_PREFIX + name, schema_id)


def versioned(name: str, schema_id: int) -> str:
    """A table's own file ``name`` as rewritten at ``schema_id``: where it is, its version replaced."""
    return _SCHEMA_SUFFIX.sub(".parquet", name).removesuffix(".parquet") + f".s{schema_id}.parquet"


def source_of(name: str) -> str:
    """The tier object a table's file stands for: itself, or the one a typed copy copies."""
    if not name.startswith(TYPED_PREFIX):
        return name
    return _SCHEMA_SUFFIX.sub(".parquet", name[len(TYPED_PREFIX):])


def typed_schema(table) -> pa.Schema:
    """The typed columns a message table (or its metadata) has: every column but the message's and
    ``_body_errors``, as Arrow types of the body formats' own kinds."""
    return pa.schema([pa.field(f.name, _plain(f.type)) for f in table.schema().as_arrow()
                      if f.name not in MESSAGE_SCHEMA.names and f.name != ERRORS])


def _plain(type_: pa.DataType) -> pa.DataType:
    """An Arrow type from pyiceberg as a body format makes it: small strings and lists, no field ids."""
    if pa.types.is_large_string(type_) or pa.types.is_string_view(type_):
        return pa.string()
    if pa.types.is_struct(type_):
        return pa.struct([pa.field(f.name, _plain(f.type)) for f in type_])
    if pa.types.is_list(type_) or pa.types.is_large_list(type_):
        return pa.list_(_plain(type_.value_type))
    return type_


def is_long(schema: pa.Schema, path: str) -> bool:
    """Whether a file's Arrow ``schema`` holds the field at dotted ``path`` as a long."""
    type_ = pa.struct(list(schema))
    for part in path.split("."):
        if not pa.types.is_struct(type_) or type_.get_field_index(part) < 0:
            return False
        type_ = type_.field(part).type
    return pa.types.is_int64(type_)


def find_type(schema, path: str):
    """The Iceberg type of the field at dotted ``path`` of an Iceberg ``schema``; None if it has none."""
    try:
        return schema.find_field(path).field_type
    except ValueError:
        return None


def widening(schema, widened: set[str]) -> list[str]:
    """Of the dotted paths a body format ``widened``, those an Iceberg ``schema`` holds as a long:
    the ones to widen to double (another broker may have widened the rest already)."""
    from pyiceberg.types import LongType

    return [p for p in sorted(widened) if isinstance(find_type(schema, p), LongType)]


def grow(tx, full: pa.Schema, widen: list[str]) -> None:
    """In transaction ``tx``, the one schema change of a typed table: the longs at ``widen`` become
    doubles and ``full``'s columns the schema lacks are added (by name, so a broker's concurrent
    change of the same columns is the same change)."""
    from pyiceberg.types import DoubleType

    with tx.update_schema(allow_incompatible_changes=bool(widen)) as update:
        for path in widen:
            update.update_column(tuple(path.split(".")), DoubleType())
        update.union_by_name(full)


def typed_parquet(rows: pa.Table, typed: pa.Table | None, metadata: dict[bytes, bytes] | None = None,
                  schema: pa.Schema = MESSAGE_SCHEMA) -> bytes:
    """A table's own data file: the rows (of ``schema``: a message's, or a snapshot's), and their
    typed columns when the topic has them."""
    if typed is None:
        return layout.to_parquet(rows, metadata=metadata)
    table = rows.select(schema.names).cast(schema)
    for name, column in zip(typed.column_names, typed.columns):
        table = table.append_column(name, column)
    sink = io.BytesIO()
    pq.write_table(table.replace_schema_metadata(metadata) if metadata else table, sink,
                   compression=layout.COMPRESSION, row_group_size=layout.group_rows(table), write_statistics=True,
                   use_dictionary=layout.DICTIONARY_COLUMNS)
    return sink.getvalue()

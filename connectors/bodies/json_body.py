"""JSON bodies as typed columns, the types inferred from the data and evolved by Iceberg's rules.

The types: JSON true/false -> bool; an integer -> long (beyond a long's range: double); any other
number -> double; a string -> string, or timestamp (UTC, microseconds) where every value a field
first had was an RFC 3339 date-time; an object -> struct; an array -> list of its items' type.  A
field only ever seen as null, ``{}`` or ``[]`` has no type yet and no column.

How the schema evolves, batch by batch against the ``known`` schema (the topic's table):
- a field not known adds a column (appended; inside a struct, appended to it);
- a known long field meeting a fraction widens to double (``Typed.widened`` names it);
- any other value that does not fit its field's type (a string where a long was, an RFC 3339
  field meeting other text) leaves the row's value null and names the field in ``_body_errors``;
  within a batch, a new field takes the first type its values had, widened as above, and a string
  field with some RFC 3339 values is a string;
- a body that is not a JSON object (not JSON at all, an array, a scalar) has every typed column
  null and ``_body_errors`` ``["$"]``; an empty body (a delete's) has them null and no marker.

Field names: a dot becomes ``_`` (Iceberg and SQL read dots as paths), and a top-level field named
like a message column (``topic``, ``body``, ...) gets ``json_`` before it; both are logged once.

Why two paths: pyarrow's JSON reader parses a batch in C++, several times faster than a parse per
body in Python (docs/benchmarks.md), but it fails a whole batch on one body that does not fit.
Then the batch is read again body by body (``json.loads``), the reference semantics above; the
fast path is taken only where its answer is the same.

Why a format remembers fields: a producer that sends one field as a number now and then fails
pyarrow's batch at each such body, and each failure costs a parse of what came before it again.
A field pyarrow named as not fitting is remembered with the kind of value that did not fit; from
then on (the rest of that batch, and later batches) the bodies whose text shows that field with
that kind are read exactly, apart from the rest, where that gives the in-order answer: a new
field takes its first value's type and its place among the new columns, so the odd bodies may add
no field but the one the rest add, with its type (``_agrees``); otherwise the batch is read in
order.  What is remembered changes how fast, never what is read.
"""

from __future__ import annotations

import io
import json
import logging
import re
from datetime import datetime

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

from connectors.bodies.base import ERRORS, ERRORS_TYPE, WHOLE, BodyFormat, Typed, as_schema, to_type
from connectors.commitlog.arrow import MESSAGE_SCHEMA

log = logging.getLogger(__name__)
RESERVED = frozenset(MESSAGE_SCHEMA.names) | {ERRORS}
RFC3339 = r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d{1,9})?([Zz]|[+-]\d{2}:\d{2})$"
_RFC3339 = re.compile(RFC3339)
TIMESTAMP = pa.timestamp("us", tz="UTC")
LONG_MIN, LONG_MAX = -(2 ** 63), 2 ** 63 - 1
_warned: set[str] = set()


class _Conflict(Exception):
    """A value that does not fit its field's type."""


class _Row(Exception):
    """pyarrow's reader found a value that does not fit its field at this body (an index of the batch)."""

    def __init__(self, at: int, why: str = ""):
        super().__init__(at)
        self.at = at
        self.why = why


_AT_ROW = re.compile(r" in row (\d+)")
# pyarrow's words for a value that did not fit its column: the column's path, the new value's kind
_CHANGED = re.compile(r"Column\((/[^)]*)\) changed from \w+ to (\w+)")
# how a JSON value of each kind pyarrow names starts
_STARTS = {"number": rb"[-0-9]", "string": rb'"', "boolean": rb"[tf]", "object": rb"\{", "array": rb"\["}
MAX_REMEMBERED = 32  # fields remembered as not fitting, per format: a hint, so bounded


class _Inferred(Exception):
    """pyarrow took a new field's strings for timestamps: read them as strings (``path``)."""

    def __init__(self, path: tuple[str, ...]):
        super().__init__(".".join(path))
        self.path = path


EXACT_ROWS = 16  # a failing part of a batch is halved down to this many bodies, then read body by body
APART_ROWS = 256  # the least rest of a batch read apart once a body in it named a misfit


def clean_name(name: str, top: bool) -> str:
    """The column name of a JSON field (see the module's docstring)."""
    out = name.replace(".", "_")
    if top and out in RESERVED:
        out = "json_" + out
    if out != name and name not in _warned:
        _warned.add(name)
        log.warning("JSON field %r is the column %r: %s", name, out,
                    "a dot reads as a path" if "." in name else "a message column has its name")
    return out


class JsonFormat(BodyFormat):
    """Bodies that are JSON objects."""

    name = "json"

    def __init__(self) -> None:
        self._misfits: set[bytes] = set()  # patterns of a remembered field with a kind that did not fit
        self._screen: re.Pattern | None = None

    def typed(self, bodies: pa.Array, known: pa.Schema) -> Typed:
        values = bodies.to_pylist()
        apart = self._apart(values, known)
        return apart if apart is not None else self._in_order(values, known)

    def _apart(self, values: list, known: pa.Schema) -> Typed | None:
        """``values``, the bodies that show a remembered misfit read exactly and the rest fast, each
        apart; None where there are none, or where that would not be the in-order answer (see
        ``_agrees``), to be read in order instead."""
        screen = self._screen
        suspects = [i for i, v in enumerate(values) if v and screen.search(v)] if screen is not None else []
        if not suspects:
            return None
        marked = set(suspects)
        order = [i for i in range(len(values)) if i not in marked] + suspects
        odd = [values[i] for i in suspects]
        fast = self._in_order([values[i] for i in order[:len(values) - len(suspects)]], known)
        if fast.dropped:
            return None
        parsed = _parse(odd)  # once, for both schemas below
        exact = self._exact(odd, fast.schema, parsed)
        if exact.dropped or not _same_fields(exact.schema, fast.schema):
            return None  # the odd bodies add a field the rest do not have
        if not _same_fields(fast.schema, known) and not _agrees(known, fast.schema, _evolved(parsed, known)[0]):
            return None
        whole = pa.concat_tables([as_schema(fast.columns, exact.schema), as_schema(exact.columns, exact.schema)])
        back = pa.array(sorted(range(len(order)), key=order.__getitem__), type=pa.int64())
        return Typed(whole.take(back), exact.schema, (fast.widened | exact.widened) & _paths(known),
                     fast.unreadable + exact.unreadable)

    def _remember(self, why: str) -> None:
        """Remember the field and kind pyarrow's error ``why`` names (see the module's docstring)."""
        found = _CHANGED.search(why)
        if found is None or len(self._misfits) >= MAX_REMEMBERED:
            return
        name = found.group(1).rsplit("/", 1)[-1]
        start = _STARTS.get(found.group(2))
        if start is None or name in ("", "[]"):
            return  # a list's items: their field has no name of its own to find
        # a new set, never one changed in place: the tables' threads may share this format
        misfits = self._misfits | {re.escape(json.dumps(name, ensure_ascii=False).encode()) + rb"\s*:\s*" + start}
        self._screen, self._misfits = re.compile(b"|".join(sorted(misfits))), misfits

    def _in_order(self, values: list, known: pa.Schema) -> Typed:
        read: list[tuple[Typed, list]] = []
        self._read(values, known, read, [len(values) + 1])
        schema = read[-1][0].schema if read else known
        # A part that left out a field's values for want of a type ({} or [] alone), where a later
        # part gave the field one: read again against the batch's schema, so they fit it or are marked.
        parts = [self._exact(values, schema) if part.dropped and part.schema != schema else part
                 for part, values in read]
        columns = [as_schema(p.columns, schema) for p in parts]
        whole = pa.concat_tables(columns) if columns else _with_errors(
            pa.table({f.name: pa.nulls(0, f.type) for f in schema}), [], 0)
        return Typed(whole, schema, set().union(*(p.widened for p in parts)) & _paths(known),
                     sum(p.unreadable for p in parts))

    def _read(self, values: list, known: pa.Schema, parts: list[tuple[Typed, list]], tries: list[int]) -> pa.Schema:
        """Read ``values`` into ``parts``, fast where pyarrow's answer is the exact one; the schema
        after.  A body pyarrow names as not fitting is read alone, exactly, and the rest around it
        fast again: a field one producer sends as a number now and then costs its bodies alone."""
        start, window = 0, len(values)
        while start < len(values):
            # After a body that did not fit, the next attempt takes a window twice as long as the
            # run before it: pyarrow parses all it is given before it names the body, so bodies
            # that often do not fit would otherwise cost a parse of the whole rest each.
            rest = values[start:start + window]
            if start + window < len(values):
                known = self._read(rest, known, parts, tries)
                start, window = start + len(rest), min(len(values), window * 2)
                continue
            objects = [i for i, b in enumerate(rest) if _looks_like_object(b)]
            strings: list[tuple[str, ...]] = []
            for _ in range(32):
                try:
                    parts.append((self._fast(rest, objects, known, strings), rest))
                    return parts[-1][0].schema
                except _Inferred as e:
                    strings.append(e.path)
                except _Row as e:
                    self._remember(e.why)
                    if e.at:
                        known = self._read(rest[:e.at], known, parts, tries)
                    parts.append((self._exact(rest[e.at:e.at + 1], known), rest[e.at:e.at + 1]))
                    known, start = parts[-1][0].schema, start + e.at + 1
                    # the rest of this batch apart, now that the field is remembered (the bodies
                    # that show it are outside every fast part, so this recurses only on a new
                    # one).  A try that fails costs a parse of the rest, so the next is made only
                    # on at most half as many bodies (``tries``): all of them cost at most two parses.
                    apart, left = None, len(values) - start
                    if APART_ROWS <= left < tries[0]:
                        apart = self._apart(values[start:], known)
                        tries[0] = left // 2 if apart is None else tries[0]
                    if apart is not None:
                        parts.append((apart, values[start:]))
                        return apart.schema
                    window = max(EXACT_ROWS * 4, 2 * e.at)
                    break
                except (pa.ArrowInvalid, _Conflict):
                    if len(rest) <= EXACT_ROWS:
                        parts.append((self._exact(rest, known), rest))
                        return parts[-1][0].schema
                    half = len(rest) // 2
                    return self._read(rest[half:], self._read(rest[:half], known, parts, tries), parts, tries)
            else:
                parts.append((self._exact(rest, known), rest))
                return parts[-1][0].schema
        return known

    # ------------------------------------------------------------ pyarrow's reader, a batch at once

    def _fast(self, values: list, objects: list[int], known: pa.Schema, strings: list[tuple[str, ...]]) -> Typed:
        if not objects:
            return _assemble(pa.table({f.name: pa.nulls(0, f.type) for f in known}), [], values, known, [])
        block = b"\n".join(values[i].replace(b"\n", b" ").replace(b"\r", b" ") for i in objects)
        parse = pa.schema([pa.field(f.name, _as_parsed(f.type)) for f in known])
        for path in strings:
            parse = _with_string(parse, path)
        try:
            # one block: the row an error names is the batch's
            table = pj.read_json(io.BytesIO(block), read_options=pj.ReadOptions(use_threads=False,
                                                                                block_size=len(block) + 1),
                                 parse_options=pj.ParseOptions(explicit_schema=parse, unexpected_field_behavior="infer"))
        except pa.ArrowInvalid as e:
            at = _AT_ROW.search(str(e))
            if at is not None and int(at.group(1)) < len(objects):
                raise _Row(objects[int(at.group(1))], str(e)) from e
            raise
        if table.num_rows != len(objects):
            raise _Conflict("rows")
        errors: dict[int, set[str]] = {}
        fields, columns = [], []
        named = _by_name([(n, c.combine_chunks()) for n, c in zip(table.column_names, table.columns)],
                         set(known.names), top=True)
        for name, raw, column in named:
            top = known.field(name).type if name in known.names else None
            column, type_ = _finish(column, top, name, None, errors, (raw,))
            if type_ is None:
                continue  # only nulls so far: no type, no column
            fields.append(pa.field(name, type_))
            columns.append(column)
        evolved = _grown(known, pa.schema(fields))
        read = dict(zip((f.name for f in fields), columns))
        typed = pa.table({f.name: _cast(read[f.name], f.type) if f.name in read else pa.nulls(len(objects), f.type)
                          for f in evolved})
        dropped = errors.pop(-1, None) is not None
        rows = [sorted(errors[i]) if i in errors else None for i in range(len(objects))]
        out = _assemble(typed, rows, values, evolved, objects)
        out.dropped = dropped
        return out

    # ------------------------------------------------------------ the reference: body by body

    def _exact(self, values: list, known: pa.Schema, parsed: list[dict | None] | None = None) -> Typed:
        """``values`` by the reference rules; ``parsed``: their ``_parse``, when the caller has it."""
        parsed = _parse(values) if parsed is None else parsed
        evolved, widened = _evolved(parsed, known)
        rows, errors = [], []
        for obj, body in zip(parsed, values):
            if obj is None:
                rows.append(None)
                errors.append([WHOLE] if body else None)  # an empty body (a delete's) has no fields: no marker
                continue
            errs: set[str] = set()
            rows.append({f.name: _conform(obj.get(f.name), f.type, f.name, errs) for f in evolved})
            errors.append(sorted(errs) or None)
        struct = pa.array([r if r is not None else {} for r in rows], type=pa.struct(list(evolved)))
        typed = pa.Table.from_arrays(struct.flatten(), schema=evolved) if len(evolved) else pa.table({})
        unreadable = sum(1 for obj, body in zip(parsed, values) if obj is None and body)
        dropped = any(obj is not None and _untyped(obj, pa.struct(list(evolved))) for obj in parsed)
        return Typed(_with_errors(typed, errors, len(values)), evolved, widened & _paths(known), unreadable, dropped)


# ---------------------------------------------------------------- the exact path's rules


def _parse(values: list) -> list[dict | None]:
    """Each body as the standard library parses it, its names cleaned; None where it is not an object."""
    parsed: list[dict | None] = []
    for body in values:
        try:
            value = json.loads(body) if body else None
        except (ValueError, UnicodeDecodeError):
            value = None
        parsed.append(_clean_object(value) if isinstance(value, dict) else None)
    return parsed


def _evolved(parsed: list[dict | None], known: pa.Schema) -> tuple[pa.Schema, set[str]]:
    """``known`` grown by the parsed bodies, in their order, and the paths of it that widened."""
    types = {f.name: f.type for f in known}
    widened: set[str] = set()
    for obj in parsed:
        if obj is not None:
            _unify_fields(types, obj, set(known.names), widened, "")
    return pa.schema([pa.field(name, t) for name, t in types.items() if t is not None]), widened


def _clean_object(obj: dict, top: bool = True) -> dict:
    out = {}
    for key, value in obj.items():
        out[clean_name(key, top)] = _clean_object(value, False) if isinstance(value, dict) else (
            [(_clean_object(v, False) if isinstance(v, dict) else v) for v in value] if isinstance(value, list) else value)
    return out


def _infer(value) -> pa.DataType | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return pa.bool_()
    if isinstance(value, int):
        return pa.int64() if LONG_MIN <= value <= LONG_MAX else pa.float64()
    if isinstance(value, float):
        return pa.float64()
    if isinstance(value, str):
        return TIMESTAMP if _RFC3339.match(value) else pa.string()
    if isinstance(value, dict):
        types: dict[str, pa.DataType | None] = {}
        _unify_fields(types, value, set(), set(), "")
        fields = [pa.field(k, t) for k, t in types.items() if t is not None]
        return pa.struct(fields) if fields else None
    if isinstance(value, list):
        item = None
        for v in value:
            item = _unify(item, v, new=True, widened=set(), path="")
        return pa.list_(item) if item is not None else None
    return None


def _unify_fields(types: dict, obj: dict, known: set[str], widened: set[str], prefix: str) -> None:
    for name, value in obj.items():
        path = prefix + name
        types[name] = _unify(types.get(name), value, new=name not in known, widened=widened, path=path)


def _unify(type_: pa.DataType | None, value, *, new: bool, widened: set[str], path: str) -> pa.DataType | None:
    """``type_`` grown to take ``value`` where the rules allow; else unchanged (the value conflicts)."""
    seen = _infer(value)
    if seen is None:
        return type_
    if type_ is None:
        return seen
    if type_ == seen:
        if pa.types.is_struct(type_):
            return _unify_struct(type_, value, new, widened, path)
        if pa.types.is_list(type_):
            item = type_.value_type
            for v in value:
                item = _unify(item, v, new=new, widened=widened, path=path + "[]")
            return pa.list_(item)
        return type_
    if pa.types.is_int64(type_) and pa.types.is_float64(seen):
        if not path.endswith("[]"):  # a list's items keep their type: Iceberg widens a column, not an element
            widened.add(path)
            return seen
    if new and pa.types.is_timestamp(type_) and pa.types.is_string(seen):
        return seen  # not every value was RFC 3339: a string
    if pa.types.is_struct(type_) and pa.types.is_struct(seen):
        return _unify_struct(type_, value, new, widened, path)
    if pa.types.is_list(type_) and pa.types.is_list(seen):
        item = type_.value_type
        for v in value:
            item = _unify(item, v, new=new, widened=widened, path=path + "[]")
        return pa.list_(item)
    return type_


def _unify_struct(type_: pa.StructType, value: dict, new: bool, widened: set[str], path: str) -> pa.DataType:
    types = {f.name: f.type for f in type_}
    known = set() if new else set(types)
    _unify_fields(types, value, known, widened, path + ".")
    return pa.struct([pa.field(k, t) for k, t in types.items() if t is not None])


def _conform(value, type_: pa.DataType, path: str, errs: set[str]):
    """``value`` as ``type_``, or None with ``path`` in ``errs`` when it does not fit."""
    if value is None:
        return None
    ok = None
    if pa.types.is_boolean(type_):
        ok = value if isinstance(value, bool) else None
    elif pa.types.is_int64(type_):
        ok = value if isinstance(value, int) and not isinstance(value, bool) and LONG_MIN <= value <= LONG_MAX else None
    elif pa.types.is_float64(type_):
        ok = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    elif pa.types.is_string(type_):
        ok = value if isinstance(value, str) else None
    elif pa.types.is_timestamp(type_):
        ok = _timestamp(value) if isinstance(value, str) and _RFC3339.match(value) else None
    elif pa.types.is_struct(type_):
        if isinstance(value, dict):
            return {f.name: _conform(value.get(f.name), f.type, f"{path}.{f.name}", errs) for f in type_}
    elif pa.types.is_list(type_):
        if isinstance(value, list):
            return [_conform(v, type_.value_type, path + "[]", errs) for v in value]
    if ok is None:
        errs.add(path)
    return ok


def _untyped(value, type_: pa.DataType) -> bool:
    """Whether ``value`` holds a value (an empty object or list) where ``type_`` has no field."""
    if isinstance(value, dict):
        if not pa.types.is_struct(type_):
            return False
        names = {f.name for f in type_}
        return any(v is not None and (k not in names or _untyped(v, type_.field(k).type)) for k, v in value.items())
    if isinstance(value, list) and pa.types.is_list(type_):
        return any(_untyped(v, type_.value_type) for v in value)
    return False


def _timestamp(text: str) -> datetime:
    # fromisoformat takes at most microseconds: a longer fraction is cut, as Arrow's cast cuts it
    head, dot, rest = text.partition(".")
    if dot:
        digits = re.match(r"\d+", rest).group(0)
        text = f"{head}.{digits[:6].ljust(6, '0')}{rest[len(digits):]}"
    return datetime.fromisoformat(text.replace("z", "Z").replace("t", "T", 1))


# ---------------------------------------------------------------- the fast path's finishing


def _looks_like_object(body) -> bool:
    if not body:
        return False
    stripped = body.strip()
    return stripped[:1] == b"{" and stripped[-1:] == b"}"


def _as_parsed(type_: pa.DataType) -> pa.DataType:
    """What pyarrow's reader is told a known type is: timestamps as strings, checked after."""
    if pa.types.is_timestamp(type_):
        return pa.string()
    if pa.types.is_struct(type_):
        return pa.struct([pa.field(f.name, _as_parsed(f.type)) for f in type_])
    if pa.types.is_list(type_):
        return pa.list_(_as_parsed(type_.value_type))
    return type_


def _by_name(columns: list[tuple[str, pa.Array]], known: set[str], top: bool) -> list[tuple[str, str, pa.Array]]:
    """(column name, JSON name, values) of the columns pyarrow read, one per column name: a JSON
    name whose column is a known one under another name (``topic``, ``json_topic``) takes the
    place of the known column pyarrow was told of, which then holds nothing.  Two names with values
    for one column (``a.b`` and ``a_b`` in one batch): the exact path decides."""
    out: dict[str, tuple[str, pa.Array]] = {}
    for raw, arr in columns:
        name = raw if raw in known else clean_name(raw, top)
        if name in out:
            if arr.null_count == len(arr):
                continue
            if out[name][1].null_count != len(out[name][1]):
                raise _Conflict(name)
        out[name] = (raw, arr)
    return [(name, raw, arr) for name, (raw, arr) in out.items()]


def _finish(arr: pa.Array, known: pa.DataType | None, path: str, rows: pa.Array | None,
            errors: dict[int, set[str]], raw: tuple[str, ...]) -> tuple[pa.Array, pa.DataType | None]:
    """A column pyarrow read, as its type by the rules (``known``: the table's type, else inferred
    here).  ``rows``: the batch row of each element (None: the element is the row)."""
    t = arr.type
    if pa.types.is_null(t):
        return arr, None
    dropping = arr.null_count < len(arr)  # values with no type, if none is found below
    if known is not None and (pa.types.is_struct(t) != pa.types.is_struct(known)
                              or pa.types.is_list(t) != pa.types.is_list(known)):
        raise _Conflict(path)  # a column pyarrow inferred under another name, of another kind
    if pa.types.is_struct(t):
        children, fields = [], []
        known_fields = {f.name: f.type for f in known} if known is not None else {}
        for name, raw_name, child in _by_name([(f.name, arr.field(i)) for i, f in enumerate(t)], set(known_fields),
                                              top=False):
            child, ct = _finish(child, known_fields.get(name), f"{path}.{name}", rows, errors, raw + (raw_name,))
            if ct is not None:
                children.append(child)
                fields.append(pa.field(name, ct))
        if not fields and known is not None:  # empty objects, of a known struct: its fields null
            return pa.StructArray.from_arrays([pa.nulls(len(arr), f.type) for f in known], fields=list(known),
                                              mask=arr.is_null()), known
        if not fields:
            if dropping:
                errors.setdefault(-1, set()).add(path)  # only empty objects so far
            return arr, None
        return pa.StructArray.from_arrays(children, fields=fields, mask=arr.is_null()), pa.struct(fields)
    if pa.types.is_list(t):
        parents = pc.list_parent_indices(arr)
        item_rows = parents if rows is None else rows.take(parents)
        values, vt = _finish(arr.flatten(), known.value_type if known is not None else None, path + "[]",
                             item_rows, errors, raw + ("[]",))
        if vt is None and known is not None:  # empty lists (or of nulls), of a known list type
            values, vt = pa.nulls(len(values), known.value_type), known.value_type
        if vt is None:
            if dropping:
                errors.setdefault(-1, set()).add(path)  # only empty lists so far
            return arr, None
        offsets = pc.subtract(arr.offsets, arr.offsets[0]) if len(arr) else arr.offsets
        return pa.ListArray.from_arrays(offsets, values, type=pa.list_(vt), mask=arr.is_null()), pa.list_(vt)
    if pa.types.is_timestamp(t):
        # pyarrow took a new field's strings for ISO 8601 timestamps, by its rules, not RFC 3339's,
        # and the strings are gone: read again, told the field is a string
        raise _Inferred(tuple(raw))
    if pa.types.is_string(t) and (known is None or pa.types.is_timestamp(known)):
        fits = pc.match_substring_regex(arr, RFC3339)
        if known is None:
            if arr.null_count == len(arr) or not pc.all(pc.fill_null(fits, True)).as_py():
                return arr, t
        bad = pc.and_(pc.invert(pc.fill_null(fits, True)), arr.is_valid())
        if pc.any(bad).as_py():
            for i in pc.indices_nonzero(bad).to_pylist():
                errors.setdefault(i if rows is None else rows[i].as_py(), set()).add(path)
        clean = pc.if_else(bad, pa.scalar(None, pa.string()), arr)
        return _parse_timestamps(clean), TIMESTAMP
    if known is not None and known != t:
        if pa.types.is_float64(known) and pa.types.is_int64(t):
            return arr.cast(known), known
        raise _Conflict(path)
    return arr, t


def _parse_timestamps(arr: pa.Array) -> pa.Array:
    try:
        return arr.cast(TIMESTAMP)
    except pa.ArrowInvalid:  # a form Arrow's parser does not take (a lower-case t, a space, nanoseconds)
        return pa.array([None if v is None else _timestamp(v) for v in arr.to_pylist()], type=TIMESTAMP)


def _cast(arr: pa.Array, type_: pa.DataType) -> pa.Array:
    return arr if arr.type == type_ else to_type(arr, type_)


def _with_string(schema: pa.Schema, path: tuple[str, ...]) -> pa.Schema:
    """``schema`` told that the field at ``path`` (raw JSON names; list items as ``[]``) is a string."""
    def into(type_: pa.DataType | None, rest: tuple[str, ...]) -> pa.DataType:
        if not rest:
            return pa.string()
        if rest[0] == "[]":
            return pa.list_(into(type_.value_type if type_ is not None and pa.types.is_list(type_) else None, rest[1:]))
        fields = list(type_) if type_ is not None and pa.types.is_struct(type_) else []
        names = [f.name for f in fields]
        child = fields[names.index(rest[0])].type if rest[0] in names else None
        new = pa.field(rest[0], into(child, rest[1:]))
        return pa.struct([new if f.name == rest[0] else f for f in fields] + ([] if rest[0] in names else [new]))
    return pa.schema(list(into(pa.struct(list(schema)), path)))


def _grown(known: pa.Schema, seen: pa.Schema) -> pa.Schema:
    """``known`` with the fields ``seen`` adds (at any depth), appended."""
    fields = []
    for f in known:
        if f.name in seen.names:
            fields.append(pa.field(f.name, _grown_type(f.type, seen.field(f.name).type)))
        else:
            fields.append(f)
    fields += [f for f in seen if f.name not in known.names]
    return pa.schema(fields)


def _grown_type(known: pa.DataType, seen: pa.DataType) -> pa.DataType:
    if pa.types.is_struct(known) and pa.types.is_struct(seen):
        return pa.struct(list(_grown(pa.schema(list(known)), pa.schema(list(seen)))))
    if pa.types.is_list(known) and pa.types.is_list(seen):
        return pa.list_(_grown_type(known.value_type, seen.value_type))
    return known


def _agrees(known: pa.Schema, fast: pa.Schema, odd: pa.Schema) -> bool:
    """Whether the schema of bodies read apart is the in-order one: ``fast`` (the rest's) and ``odd``
    (the odd bodies' alone) each keep ``known``'s fields (a widening aside) and add top-level fields
    only, and the odd bodies add none, or the one field the rest add, of the same type (the order
    and type of new fields are their first values')."""
    def base(schema: pa.Schema) -> pa.Schema:
        return pa.schema([schema.field(name) for name in known.names])
    if not (_same_fields(base(fast), known) and _same_fields(base(odd), known)):
        return False
    added = [f for f in fast if f.name not in known.names]
    odd_added = [f for f in odd if f.name not in known.names]
    return not odd_added or (len(added) == 1 and odd_added == added)


def _same_fields(a: pa.Schema, b: pa.Schema) -> bool:
    """Whether two schemas have the same fields at every depth, a long in one a double in the other
    aside (a widening)."""
    def same(x: pa.DataType, y: pa.DataType) -> bool:
        if pa.types.is_struct(x) and pa.types.is_struct(y):
            return [f.name for f in x] == [f.name for f in y] and all(same(f.type, g.type) for f, g in zip(x, y))
        if pa.types.is_list(x) and pa.types.is_list(y):
            return same(x.value_type, y.value_type)
        return x == y or {x, y} == {pa.int64(), pa.float64()}
    return same(pa.struct(list(a)), pa.struct(list(b)))


def _paths(schema: pa.Schema) -> set[str]:
    out = set()

    def walk(prefix: str, type_: pa.DataType) -> None:
        out.add(prefix)
        if pa.types.is_struct(type_):
            for f in type_:
                walk(f"{prefix}.{f.name}", f.type)

    for f in schema:
        walk(f.name, f.type)
    return out


def _with_errors(typed: pa.Table, errors: list, n: int) -> pa.Table:
    col = pa.array(errors, type=ERRORS_TYPE)
    if typed.num_columns == 0:
        return pa.table({ERRORS: col})
    return typed.append_column(ERRORS, col)


def _assemble(typed: pa.Table, errors: list, values: list, schema: pa.Schema, objects: list[int]) -> Typed:
    """The batch's columns, the rows that were not objects null with ``["$"]`` (an empty body with
    no marker: a delete's body is empty, and has no fields)."""
    n = len(values)
    widened: set[str] = set()
    unreadable = sum(1 for i, v in enumerate(values) if v) - len(objects)
    if len(objects) == n:
        return Typed(_with_errors(typed, errors, n), schema, widened, unreadable)
    at = {row: i for i, row in enumerate(objects)}
    take = pa.array([at.get(i) for i in range(n)], type=pa.int64())
    whole = typed.take(take) if typed.num_columns else typed
    errs = [errors[at[i]] if i in at else ([WHOLE] if values[i] else None) for i in range(n)]
    if not typed.num_columns:
        return Typed(pa.table({ERRORS: pa.array(errs, type=ERRORS_TYPE)}), schema, widened, unreadable)
    return Typed(_with_errors(whole, errs, n), schema, widened, unreadable)

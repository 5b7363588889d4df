"""JSON bodies as typed columns (connectors.bodies.json_body), against an oracle of its own: the
standard library's parse of each body, conformed to the schema the format reports by rules written
out again here."""

from __future__ import annotations

import json
import os
import random
import re
from datetime import datetime, timezone

import pyarrow as pa
import pytest

from connectors.bodies.formats import BodyFormats
from connectors.bodies.json_body import JsonFormat
from connectors.errors import ConfigError

RFC = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")
RESERVED = {"topic", "queue_id", "queue_offset", "phy_offset", "msg_id", "key", "tags", "body", "properties",
            "born_ts", "store_ts", "born_host", "store_host", "sysflag", "flag", "reconsume_times", "op",
            "prepared_tx_offset", "size", "broker", "_body_errors"}


def name(key: str, top: bool) -> str:
    key = key.replace(".", "_")
    return "json_" + key if top and key in RESERVED else key


def expect(value, type_, path, errs):
    """The oracle's typed value of ``value`` as ``type_``."""
    if value is None:
        return None
    if pa.types.is_struct(type_):
        if isinstance(value, dict):
            got = {name(k, False): v for k, v in value.items()}
            return {f.name: expect(got.get(f.name), f.type, f"{path}.{f.name}", errs) for f in type_}
    elif pa.types.is_list(type_) or pa.types.is_large_list(type_):
        if isinstance(value, list):
            return [expect(v, type_.value_type, path + "[]", errs) for v in value]
    elif pa.types.is_boolean(type_) and type(value) is bool:
        return value
    elif pa.types.is_int64(type_) and type(value) is int and -2 ** 63 <= value < 2 ** 63:
        return value
    elif pa.types.is_float64(type_) and type(value) in (int, float):
        return float(value)
    elif (pa.types.is_string(type_) or pa.types.is_large_string(type_)) and isinstance(value, str):
        return value
    elif pa.types.is_timestamp(type_) and isinstance(value, str) and RFC.match(value):
        return datetime.fromisoformat(value.upper().replace("Z", "+00:00")).astimezone(timezone.utc)
    errs.add(path)
    return None


def oracle(bodies: list[bytes], schema: pa.Schema) -> list[dict]:
    rows = []
    for body in bodies:
        try:
            value = json.loads(body)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            rows.append({**{f.name: None for f in schema}, "_body_errors": ["$"] if body else None})
            continue
        got = {name(k, True): v for k, v in value.items()}
        errs: set[str] = set()
        row = {f.name: expect(got.get(f.name), f.type, f.name, errs) for f in schema}
        rows.append({**row, "_body_errors": sorted(errs) or None})
    return rows


def check(bodies: list[bytes], known: pa.Schema = pa.schema([]), fmt: JsonFormat | None = None):
    """The format's answer for ``bodies`` is the oracle's.  ``fmt``: a format that has read batches
    before (as a topic's does), whose answer must also be that of a format that reads every batch
    in order (the oracle conforms to the schema reported: the reference decides the schema)."""
    typed = (fmt or JsonFormat()).typed(pa.array(bodies, pa.binary()), known)
    if fmt is not None:
        in_order = JsonFormat()
        in_order._apart = lambda *a: None  # never apart
        fresh = in_order.typed(pa.array(bodies, pa.binary()), known)
        assert (typed.columns, typed.schema, typed.widened, typed.unreadable) == \
            (fresh.columns, fresh.schema, fresh.widened, fresh.unreadable)
    assert typed.columns.num_rows == len(bodies)
    assert typed.columns.column_names == typed.schema.names + ["_body_errors"]
    assert typed.columns.to_pylist() == oracle(bodies, typed.schema)
    for f in known:  # the schema only grows
        assert f.name in typed.schema.names
    return typed


def enc(*objs) -> list[bytes]:
    return [o if isinstance(o, bytes) else json.dumps(o).encode() for o in objs]


def test_types_inferred_from_the_data():
    typed = check(enc({"n": 1, "x": 2.5, "b": True, "s": "a", "t": "2026-12-07T10:00:00.123+01:00",
                       "o": {"p": 1, "q": [1, 2]}, "z": None, "e": {}, "l": []}))
    assert typed.schema == pa.schema([("n", pa.int64()), ("x", pa.float64()), ("b", pa.bool_()), ("s", pa.string()),
                                      ("t", pa.timestamp("us", tz="UTC")),
                                      ("o", pa.struct([("p", pa.int64()), ("q", pa.list_(pa.int64()))]))])


def test_a_field_added_halfway_adds_a_column_and_earlier_known_ones_stay():
    first = check(enc({"a": 1}, {"a": 2}))
    second = check(enc({"a": 3}, {"a": 4, "new": "x"}), first.schema)
    assert second.schema.names == ["a", "new"]
    assert second.columns.column("new").to_pylist() == [None, "x"]


def test_a_long_widens_to_double_and_says_so():
    first = check(enc({"amount": 1}, {"amount": 2}))
    second = check(enc({"amount": 3}, {"amount": 4.5}), first.schema)
    assert second.schema.field("amount").type == pa.float64()
    assert second.widened == {"amount"}
    assert second.columns.column("amount").to_pylist() == [3.0, 4.5]


def test_a_conflicting_type_is_null_with_a_marker_and_the_column_keeps_its_type():
    first = check(enc({"customer": 42}))
    second = check(enc({"customer": "c-42"}, {"customer": 43}), first.schema)
    assert second.schema.field("customer").type == pa.int64()
    assert second.columns.to_pylist() == [{"customer": None, "_body_errors": ["customer"]},
                                          {"customer": 43, "_body_errors": None}]


def test_bodies_that_are_not_json_objects_are_kept_with_every_column_null_and_counted():
    first = check(enc({"a": 1}))
    bodies = [b"not json", b"[1,2]", b"7", b"null", b'{"a": 2', b"\xff\xfe", b"", b'{"a": 3}']
    typed = check(bodies, first.schema)
    assert typed.unreadable == 6  # an empty body (a delete's) has no fields, and is not counted
    assert typed.columns.column("_body_errors").to_pylist() == [["$"]] * 6 + [None, None]


def test_deep_nesting_names_that_need_escaping_and_unicode():
    deep = {"l1": {"l2": {"l3": {"l4": {"l5": [{"v": 1}, {"v": 2, "w": "ü"}]}}}}}
    typed = check(enc(deep, {"order total": 5, "select": True, "a.b": 1, "body": "x", "naïve €": "日本"}))
    assert {"order total", "select", "a_b", "json_body", "naïve €"} <= set(typed.schema.names)
    assert typed.columns.column("naïve €").to_pylist() == [None, "日本"]


def test_timestamps_only_where_every_first_value_is_rfc_3339():
    mixed = check(enc({"t": "2026-12-07T10:00:00Z"}, {"t": "yesterday"}))
    assert mixed.schema.field("t").type == pa.string()
    ts = check(enc({"t": "2026-12-07T10:00:00Z"}, {"t": "2026-12-07 10:00:00.5-02:00"}))
    assert ts.schema.field("t").type == pa.timestamp("us", tz="UTC")
    later = check(enc({"t": "soon"}, {"t": "2026-12-07t10:00:00z"}), ts.schema)
    assert later.columns.column("_body_errors").to_pylist() == [["t"], None]


def test_pretty_printed_bodies_and_whitespace_read_as_compact_ones():
    check([b'{\n  "a": 1,\r\n  "b": {"c": "x\\ny"}\n}\n', b'  {"a": 2}  '])


@pytest.mark.parametrize("seed", range(int(os.environ.get("JSON_SEEDS", "12"))))
def test_random_batches_in_sequence_agree_with_the_oracle(seed):
    # Batches of bodies from a small vocabulary of fields and values, conflicts and junk included,
    # each batch read against the schema the last one left: both of the format's paths are taken.
    rnd = random.Random(seed)
    values = [1, -7, 2 ** 40, 2.5, True, "s", "2026-01-02T03:04:05Z", None, {"k": 1}, {"k": "v", "m": [1]},
              [1, 2], ["a"], [{"x": 1}], {}, [], 2 ** 70]
    fields = ["a", "b", "c.d", "topic", "é"]
    known = pa.schema([])
    fmt = JsonFormat()  # one for the sequence: what it remembers of one batch it uses in the next
    for _ in range(8):
        bodies = []
        for _ in range(rnd.choice([1, 5, 40, 300])):
            r = rnd.random()
            if r < 0.05:
                bodies.append(rnd.choice([b"", b"junk", b"[1]", b"{"]))
            else:
                obj = {f: rnd.choice(values[:8] if r < 0.7 else values) for f in rnd.sample(fields, rnd.randint(0, 5))}
                bodies.append(json.dumps(obj, indent=rnd.choice([None, 2])).encode())
        typed = check(bodies, known, fmt)
        known = typed.schema
    assert known.names  # something was typed


def test_a_field_that_did_not_fit_is_read_apart_from_then_on_with_the_in_order_answer(monkeypatch):
    # The workload's orders send the customer as a number in one body of 31: once pyarrow names it,
    # the rest of that batch and later batches read those bodies exactly, apart, and the rest in one
    # fast parse (check: the answer is a new format's, and the oracle's), a field the rest add (the
    # coupon, a third of the way in) included; where the odd bodies would change what the in-order
    # read makes of a new field, the batch is read in order.
    import connectors.bodies.json_body as jb
    from connectors.commitlog.workload import json_body

    fast = []
    real = jb.JsonFormat._fast
    fmt = JsonFormat()
    monkeypatch.setattr(jb.JsonFormat, "_fast", lambda self, values, *a: (self is fmt and fast.append(len(values)))
                        or real(self, values, *a))
    orders = [json_body(i, 4000, f"key-{i:04d}", 300, steady=False) for i in range(2600)]
    known = check(orders[:400], pa.schema([]), fmt).schema
    # the batch up to the first odd body (the sixth), which fails the first parse; then the rest apart
    assert len(fast) == 3, fast
    apart = 0
    for start in range(400, 2600, 200):
        fast.clear()
        grown = check(orders[start:start + 200], known, fmt).schema
        if all(grown.field(n).type == known.field(n).type for n in known.names):  # none widened (the amount is, halfway)
            assert len(fast) == 1, (start, fast)  # apart: one fast parse of the rest
            apart += 1
        known = grown
    assert apart >= 9 and "coupon" in known.names
    odd_with_new = [json.dumps({"customer": 7, "new": "x"}).encode()] + orders[2400:2500]
    check(odd_with_new, known, fmt)
    # a field new to the batch whose first value, in an odd body, is of another type than the rest's
    first_odd = [json.dumps({"customer": 7, "f": "s"}).encode()] + [
        json.dumps({"customer": f"c-{i}", "f": i}).encode() for i in range(300)]
    assert check(first_odd, known, fmt).schema.field("f").type == pa.string()
    # two fields new to the batch, the odd bodies with one of them: its place among the new columns
    two_new = [json.dumps({"customer": f"c-{i}", "g": i, "h": i}).encode() for i in range(300)]
    two_new[150:150] = [json.dumps({"customer": 7, "h": 1}).encode()]
    check(two_new, known, fmt)
    # odd bodies that each add a field the rest lack: read in order, each try apart after the first
    # made on at most half as many bodies as the one before (a try that fails costs a parse of the rest)
    tries = []
    real_apart = jb.JsonFormat._apart
    monkeypatch.setattr(jb.JsonFormat, "_apart", lambda self, *a: (self is fmt and tries.append(1))
                        or real_apart(self, *a))
    lone = [json.dumps({"customer": 7, f"only{i}": i} if i % 31 == 5 else {"customer": f"c-{i}"}).encode()
            for i in range(2000)]
    check(lone, known, fmt)
    assert 2 <= len(tries) <= 5, len(tries)  # 2,000 bodies, then at most 1,000, 500, 250 (APART_ROWS: 256)
    # a field named outside ASCII, as producers write it: found in the body's own bytes
    named = JsonFormat()
    bodies = [json.dumps({"é": "s", "n": i}, ensure_ascii=False).encode() for i in range(300)]
    bodies[7] = json.dumps({"é": 5, "n": 7}, ensure_ascii=False).encode()
    known_named = check(bodies, pa.schema([]), named).schema
    assert [i for i, b in enumerate(bodies) if named._screen.search(b)] == [7]
    check(bodies, known_named, named)
    # a topic whose first customer was a number: every later string one is odd, and read apart
    fmt = JsonFormat()
    known = check(orders[5:400], pa.schema([]), fmt).schema
    assert known.field("customer").type == pa.int64()
    fast.clear()
    check(orders[400:600], known, fmt)
    assert len(fast) == 1, fast


def test_the_topic_to_format_setting():
    formats = BodyFormats("orders=json, events-*=json")
    assert formats.of("orders").name == "json" and formats.of("events-1").name == "json"
    assert formats.of("other").name == "bytes" and not formats.typed("other") and formats
    assert not BodyFormats("")
    for bad in ("orders", "orders=xml", "=json"):
        with pytest.raises(ConfigError, match="topics.body_format"):
            BodyFormats(bad)


def test_renamed_fields_stay_on_the_batch_reader_once_known(monkeypatch):
    # A field named like a message column, or with a dot, is known under its column name after the
    # first batch; later batches must not fall to the body-by-body path for it.
    import connectors.bodies.json_body as jb

    exact = []
    real = jb.JsonFormat._exact
    monkeypatch.setattr(jb.JsonFormat, "_exact", lambda self, values, known: exact.append(len(values)) or
                        real(self, values, known))
    bodies = enc(*({"topic": f"t{i}", "o": {"a.b": i, "c": "x"}, "n": i} for i in range(200)))
    first = check(bodies)
    exact.clear()
    second = check(bodies, first.schema)
    assert second.schema == first.schema and exact == []


def test_the_cli_prints_a_json_topics_body_parsed_beside_the_raw_one():
    from streaming.cli.output import parsed_body

    assert parsed_body(b'{"a": [1, {"b": "\xc3\xa9"}]}', typed=True) == {"value": {"a": [1, {"b": "é"}]}}
    assert parsed_body(b"not json", typed=True) == {"value": None, "value_error": "the body is not a JSON object"}
    assert parsed_body(b"[1]", typed=True)["value"] is None
    assert parsed_body(b'{"a": 1}', typed=False) == {} and parsed_body(None, typed=True) == {}

"""The record format against docs/commitlog-format.md, byte for byte."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from connectors.commitlog import format as fmt

GOLDEN_HEX = """
00000084 daa320a7 69c865ed 00000003 00000000
0000000000000007 0000000000001000 00000000
0000018bcfe56800 7f000001 00003039
0000018bcfe5687b 7f000001 00002a9f
00000000 0000000000000000
0000000e 48656c6c6f20526f636b65744d51
09 546f70696354657374
0012 54414753 01 54616741 02 4b455953 01 6b31 02
"""
GOLDEN = bytes.fromhex("".join(GOLDEN_HEX.split()))


def golden_message() -> fmt.Message:
    return fmt.Message(
        topic="TopicTest",
        queue_id=3,
        queue_offset=7,
        phy_offset=4096,
        body=b"Hello RocketMQ",
        properties={"TAGS": "TagA", "KEYS": "k1"},
        born_ts=1700000000000,
        born_host="127.0.0.1:12345",
        store_ts=1700000000123,
        store_host="127.0.0.1:10911",
    )


def test_golden_vector_encodes_to_the_documented_bytes():
    assert len(GOLDEN) == 132
    assert fmt.encode(golden_message()) == GOLDEN


def test_golden_vector_decodes_back():
    m = fmt.decode(GOLDEN, check_crc=True, expect_phy=4096)
    expected = golden_message()
    assert (m.topic, m.queue_id, m.queue_offset, m.phy_offset, m.body) == (
        expected.topic, 3, 7, 4096, b"Hello RocketMQ",
    )
    assert m.properties == {"TAGS": "TagA", "KEYS": "k1"}
    assert (m.born_host, m.store_host, m.born_ts, m.store_ts) == (
        "127.0.0.1:12345", "127.0.0.1:10911", 1700000000000, 1700000000123,
    )
    assert m.body_crc == 0x69C865ED and m.size == 132 and m.v2 is False
    assert m.key() == "k1" and m.tags == "TagA" and m.op == "put"


def test_magic_constants_match_the_java_expressions():
    # §2: 0xAABBCCDD ^ 1880681586 + 8 parses as XOR with 1880681594.
    assert fmt.MAGIC_V1 == (0xAABBCCDD ^ (1880681586 + 8))
    assert fmt.BLANK_MAGIC == (0xBBCCDDEE ^ (1880681586 + 8))
    assert fmt.MAGIC_V2 == fmt.MAGIC_V1 + 4


def test_v2_is_chosen_for_long_topics_and_ipv6_sets_the_flags():
    m = fmt.Message(topic="t" * 200, body=b"x", born_host="[2001:db8::1]:9876", store_host="[::1]:10911")
    raw = fmt.encode(m)
    assert int.from_bytes(raw[4:8], "big") == fmt.MAGIC_V2
    back = fmt.decode(raw)
    assert back.sysflag & (fmt.BORNHOST_V6_FLAG | fmt.STOREHOST_V6_FLAG) == 0x30
    assert back.topic == "t" * 200 and back.born_host == "[2001:db8::1]:9876" and back.store_host == "[::1]:10911"
    assert len(raw) == fmt.record_size(1, 200, 0, 0x30, True) == 74 + 20 + 20 + 2 + 1 + 200


def test_ipv4_mapped_ipv6_is_stored_as_ipv4():
    raw = fmt.encode(fmt.Message(topic="t", born_host="[::ffff:10.1.2.3]:80"))
    assert fmt.decode(raw).born_host == "10.1.2.3:80"


def test_properties_parse_like_rocketmq():
    text = "A\x011\x02\x02B\x01\x02\x012\x02C\x01x\x01y\x02D\x014"  # empty, no-value, no-name, trailing
    assert fmt.string_to_properties(text) == {"A": "1", "C": "x\x01y", "D": "4"}


def test_separators_inside_property_values_are_refused():
    with pytest.raises(ValueError, match="may not contain"):
        fmt.encode(fmt.Message(topic="t", properties={"K": "a\x02b"}))


def test_oversized_properties_and_topics_are_refused():
    with pytest.raises(ValueError, match="properties are"):
        fmt.encode(fmt.Message(topic="t", properties={"K": "v" * 40000}))
    with pytest.raises(ValueError, match="too long for magic V1"):
        fmt.encode(fmt.Message(topic="t" * 200, v2=False))


@pytest.mark.parametrize(
    "offset,byte,reason",
    [(4, 0x00, "unknown magic"), (8, 0xFF, "CRC mismatch"), (87, 0x7F, "does not fit TOTALSIZE"), (102, 0x08, "does not match its fields")],
)
def test_decode_names_the_failed_check(offset, byte, reason):
    raw = bytearray(GOLDEN)
    raw[offset] = byte
    with pytest.raises(fmt.RecordError, match=reason):
        fmt.decode(bytes(raw), check_crc=True)


def test_misplaced_record_is_detected():
    with pytest.raises(fmt.RecordError, match="physical offset 4096 is not the record's position 0"):
        fmt.decode(GOLDEN, expect_phy=0)


text = st.text(alphabet=st.characters(blacklist_characters="\x01\x02", blacklist_categories=("Cs",)), min_size=1, max_size=12)


@given(
    topic=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=180),
    body=st.binary(max_size=2000),
    props=st.dictionaries(text, text, max_size=6),
    v6=st.booleans(),
    qid=st.integers(0, 2**31 - 1),
)
def test_encode_decode_round_trip(topic, body, props, v6, qid):
    if len(topic.encode()) > fmt.MAX_TOPIC_BYTES_V2:
        return
    m = fmt.Message(
        topic=topic, body=body, properties=props, queue_id=qid, born_ts=1, store_ts=2,
        born_host="[fe80::1]:1" if v6 else "10.0.0.1:2", store_host="[::2]:3" if v6 else "10.0.0.2:3",
    )
    back = fmt.decode(fmt.encode(m), check_crc=True)
    assert (back.topic, back.body, back.properties, back.queue_id) == (topic, body, props, qid)
    assert (back.born_host, back.store_host) == (m.born_host, m.store_host)
    assert back.v2 == (len(topic.encode()) > 127)

"""Control message encoding and validation: round trips, every refusal, hostile input."""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import pytest

from rayturn.kvstore import wire
from rayturn.kvstore.wire import MAX_CONTROL_BYTES, MAX_KEY_BYTES, MAX_RANGES, WireError, decode, encode

# What a grant looks like on the wire (its signature is checked by the segment's server, not here).
GRANT = [1.5e9, b"\x00" * 16, b"\x01" * 32]
WRITE = {"tenant": "t", "grant": [1.5e9, b"\x01" * 32]}


def _read_request(**overrides: Any) -> dict[str, Any]:
    message: dict[str, Any] = {
        "type": "read_request",
        "request_id": 7,
        "ranges": [[0, 4096], [8192, 16]],
        "grant": GRANT,
    }
    message.update(overrides)
    return message


def _pack(message: object) -> bytes:
    """Raw msgpack, bypassing encode()'s validation: what a careless or hostile peer could send."""
    data: bytes = msgpack.packb(message, use_bin_type=True)
    return data


# -- round trips --------------------------------------------------------------------------------


def test_read_request_round_trip_normalises_ranges_to_tuples() -> None:
    message = decode(encode(_read_request()), "read_request")
    assert message == {"type": "read_request", "request_id": 7, "ranges": [(0, 4096), (8192, 16)], "grant": GRANT}


def test_write_request_round_trip() -> None:
    message = {"type": "write_request", "request_id": 1, "ranges": [[5, 3]], "keys": [b"layer0/page3", b""], **WRITE}
    assert decode(encode(message)) == {**message, "ranges": [(5, 3)]}


def test_reply_round_trip_with_and_without_error() -> None:
    ok = {"type": "reply", "request_id": 3, "ok": True, "total_bytes": 12}
    refused = {"type": "reply", "request_id": -1, "ok": False, "total_bytes": 0, "error": "range 0 out of bounds"}
    assert decode(encode(ok)) == ok
    assert decode(encode(refused), "reply") == refused


def test_decode_accepts_memoryview_and_bytearray() -> None:
    data = encode(_read_request())
    assert decode(memoryview(data)) == decode(bytearray(data))


def test_unknown_extra_fields_are_kept_for_forward_compatibility() -> None:
    assert decode(encode(_read_request(priority=3)))["priority"] == 3


def test_large_but_legal_request_round_trips() -> None:
    ranges = [[index * 4096, 4096] for index in range(MAX_RANGES)]
    message = decode(encode(_read_request(ranges=ranges)))
    assert len(message["ranges"]) == MAX_RANGES
    assert message["ranges"][-1] == ((MAX_RANGES - 1) * 4096, 4096)


# -- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "complaint"),
    [
        ({"request_id": 1}, 'string field "type"'),
        ({"type": 5}, 'string field "type"'),
        ({"type": "delete_everything"}, "unknown control message type 'delete_everything'"),
        ({"type": "read_request", "ranges": [[0, 1]]}, "missing field 'request_id'"),
        ({"type": "read_request", "request_id": "7", "ranges": [[0, 1]]}, "'request_id' must be int, got str"),
        ({"type": "read_request", "request_id": True, "ranges": [[0, 1]]}, "'request_id' must be int, got bool"),
        ({"type": "read_request", "request_id": 1, "ranges": "0-1"}, "'ranges' must be list, got str"),
        ({"type": "reply", "request_id": 1, "ok": 1, "total_bytes": 0}, "'ok' must be bool, got int"),
        ({"type": "reply", "request_id": 1, "ok": False, "total_bytes": 0, "error": 5}, "'error' must be str"),
        ({"type": "reply", "request_id": 1, "ok": True, "total_bytes": -1}, "'total_bytes' must be >= 0"),
        ({"type": "write_request", "request_id": 1, "ranges": [[0, 1]]}, "missing field 'keys'"),
        (
            {"type": "write_request", "request_id": 1, "ranges": [[0, 1]], "keys": ["text"], **WRITE},
            "keys[0] must be bytes",
        ),
    ],
)
def test_schema_violations_are_named(message: dict[str, Any], complaint: str) -> None:
    with pytest.raises(WireError) as refused:
        decode(_pack(message))
    assert complaint in str(refused.value)
    with pytest.raises(WireError):
        encode(message)  # nothing invalid goes out either


@pytest.mark.parametrize(
    ("ranges", "complaint"),
    [
        ([], "at least one range"),
        ([[0]], "ranges[0] must be an [offset, length] pair"),
        ([[0, 1, 2]], "ranges[0] must be an [offset, length] pair"),
        ([5], "ranges[0] must be an [offset, length] pair"),
        ([[0, 1], [-1, 4]], "ranges[1] offset -1 is negative"),
        ([[0, 0]], "ranges[0] length 0 must be positive"),
        ([[0, -5]], "ranges[0] length -5 must be positive"),
        ([[0.5, 1]], "ranges[0] offset must be an int, got float"),
        ([[0, True]], "ranges[0] length must be an int, got bool"),
        ([[1 << 63, 1]], "beyond 2**63"),
        ([[0, 1]] * (MAX_RANGES + 1), f"more than the limit of {MAX_RANGES}"),
    ],
)
def test_bad_ranges_are_named(ranges: list[Any], complaint: str) -> None:
    with pytest.raises(WireError) as refused:
        wire.validate_ranges(ranges)
    assert complaint in str(refused.value)
    with pytest.raises(WireError):  # the unpacker's own array limit may speak first
        decode(_pack(_read_request(ranges=ranges)))


def test_overlong_key_is_refused() -> None:
    message = {
        "type": "write_request",
        "request_id": 1,
        "ranges": [[0, 1]],
        "keys": [b"k" * (MAX_KEY_BYTES + 1)],
        **WRITE,
    }
    with pytest.raises(WireError, match="keys\\[0\\] is 4097 bytes"):
        decode(_pack(message))


def test_expected_type_mismatch() -> None:
    with pytest.raises(WireError, match="expected a 'reply' message, got 'read_request'"):
        decode(encode(_read_request()), "reply")


def test_wire_error_is_a_value_error() -> None:
    assert issubclass(WireError, ValueError)


# -- hostile and broken bytes -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "complaint"),
    [
        (b"", "empty control message"),
        (b"\xc1", "not valid msgpack"),  # 0xc1 is never used by msgpack
        (b"\x93\x01\x02", "not valid msgpack"),  # an array announcing 3 items, holding 2
        (_pack([1, 2, 3]), "must be a msgpack map, got list"),
        (_pack("read_request"), "must be a msgpack map, got str"),
        (_pack(_read_request()) + b"\x00", "1 trailing bytes"),
        (_pack({1: "x", "type": "reply"}), "not valid msgpack"),  # strict_map_key: keys must be strings
        (b"\xd6\xff" + b"\x00" * 4, "not valid msgpack"),  # a timestamp: no extension types at all
        (b"\xc7\x01\x05x", "not valid msgpack"),  # an application extension type
        (b"\x91" * 5000 + b"\xc0", "not valid msgpack"),  # nesting deeper than the unpacker's stack
        (b"\xd9\x10abc", "not valid msgpack"),  # a str announcing 16 bytes, holding 3
        (bytes(MAX_CONTROL_BYTES + 1), f"exceeds the {MAX_CONTROL_BYTES}-byte limit"),
        (b"\x81\xa4type\xa4\xff\xfe\xfa\xfb", "not valid msgpack"),  # invalid UTF-8 in a str
    ],
)
def test_broken_or_hostile_bytes_raise_wire_error(data: bytes, complaint: str) -> None:
    with pytest.raises(WireError) as refused:
        decode(data)
    assert complaint in str(refused.value)


@pytest.mark.parametrize(
    "header",
    [
        b"\xdd" + struct.pack(">I", 0xFFFFFFFF),  # array32 announcing 4 billion items
        b"\xdf" + struct.pack(">I", 0xFFFFFFFF),  # map32 announcing 4 billion pairs
        b"\xc6" + struct.pack(">I", 0xFFFFFFFF),  # bin32 announcing 4 GiB
        b"\xdb" + struct.pack(">I", 0xFFFFFFFF),  # str32 announcing 4 GiB
    ],
)
def test_huge_announced_lengths_allocate_nothing(header: bytes) -> None:
    with pytest.raises(WireError, match="not valid msgpack"):
        decode(header + b"\x00" * 16)


def test_too_many_map_fields_is_refused() -> None:
    message = {"type": "reply", "request_id": 1, "ok": True, "total_bytes": 0}
    message.update({f"extra{index}": index for index in range(100)})
    with pytest.raises(WireError, match="not valid msgpack"):
        decode(_pack(message))


def test_array_over_the_limit_is_refused_by_the_unpacker() -> None:
    data = _pack(_read_request(ranges=[0] * (MAX_RANGES + 1)))
    with pytest.raises(WireError, match="not valid msgpack"):
        decode(data)


def test_encode_refuses_a_message_over_the_size_limit() -> None:
    keys = [b"k" * MAX_KEY_BYTES] * 300  # 1.2 MB of keys, each legal on its own
    with pytest.raises(WireError, match="over the 1048576-byte control message limit"):
        encode({"type": "write_request", "request_id": 1, "ranges": [[0, 1]], "keys": keys, **WRITE})


def test_encode_refuses_unpackable_values() -> None:
    with pytest.raises(WireError, match="cannot be packed"):
        encode(_read_request(extra=object()))


def test_many_tiny_containers_stay_bounded() -> None:
    """1 MiB of one-byte empty arrays is the worst object count a message can buy; it must just fail."""
    data = b"\xdc" + struct.pack(">H", 0xFFFF) + b"\x90" * 0xFFFF  # an array of 65535 empty arrays
    with pytest.raises(WireError, match="must be a msgpack map"):
        decode(data)


# -- registry -----------------------------------------------------------------------------------


def test_register_a_new_message_type() -> None:
    def positive_count(message: dict[str, Any]) -> None:
        if message["count"] <= 0:
            raise WireError("count must be positive")

    wire.register("test_wire_ping", {"count": int}, optional={"note": (str, bytes)}, validators=[positive_count])
    wire.register("test_wire_ping", {"count": int}, optional={"note": (str, bytes)}, validators=[positive_count])
    assert wire.SCHEMAS["test_wire_ping"] == {"count": int}
    assert decode(encode({"type": "test_wire_ping", "count": 2, "note": b"x"})) == {
        "type": "test_wire_ping",
        "count": 2,
        "note": b"x",
    }
    with pytest.raises(WireError, match="'note' must be str or bytes, got int"):
        decode(_pack({"type": "test_wire_ping", "count": 2, "note": 5}))
    with pytest.raises(WireError, match="count must be positive"):
        decode(_pack({"type": "test_wire_ping", "count": 0}))


def test_register_refuses_conflicts() -> None:
    with pytest.raises(ValueError, match="already registered with a different schema"):
        wire.register("read_request", {"request_id": int})
    with pytest.raises(ValueError, match="implicit"):
        wire.register("test_wire_bad", {"type": str})
    with pytest.raises(ValueError, match="both required and optional"):
        wire.register("test_wire_bad", {"a": int}, optional={"a": int})
    with pytest.raises(ValueError, match="non-empty string"):
        wire.register("", {})


def test_truncate_error_fits_the_reply_limit() -> None:
    text = wire.truncate_error("x" * (wire.MAX_ERROR_CHARS * 2))
    assert len(text) == wire.MAX_ERROR_CHARS
    assert text.endswith("...")
    encode({"type": "reply", "request_id": 1, "ok": False, "total_bytes": 0, "error": text})

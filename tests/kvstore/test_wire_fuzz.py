"""What a rogue peer can send the store's decoders: random bytes, truncated frames, huge lengths, wrong types.

Property-based (``hypothesis``) against the real decoders: ``wire`` (every control message),
``ucx_framing.Channel`` (UCX control frames, over a scripted endpoint standing in for ucxx),
``access`` (grants on the wire), ``ucx_server`` (a request's ranges and grant) and
``master_lookup`` (the lookup socket's frames). Each refuses with its own error type and never
lets anything else escape. ``test_store_faults.py`` sends such bytes to a real running owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rayturn.kvstore import wire
from rayturn.kvstore.access import AccessDenied, ReadGrant, SegmentGate, StoreAuth, WriteGrant, new_secret
from rayturn.kvstore.master_lookup import LookupServer
from rayturn.kvstore.ucx_framing import (
    CONTROL_HEADER,
    CONTROL_MAGIC,
    CONTROL_SLOT_BYTES,
    CONTROL_VERSION,
    FLAG_BODY_FOLLOWS,
    Channel,
    FramingError,
)
from rayturn.kvstore.ucx_server import UcxServer, _RequestRefused

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SEGMENT_BYTES = 1 << 16

# msgpack-able values of every wire type, nested: what a peer can put in a message's fields.
plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=20,
)
message_types = st.sampled_from(sorted(wire.SCHEMAS)) | st.text(max_size=12)
field_names = st.sampled_from(
    ["request_id", "ranges", "keys", "tenant", "grant", "ok", "total_bytes", "error", "proof", "nonce", "method"]
)
messages = st.builds(
    lambda type_name, fields: {"type": type_name, **fields},
    message_types,
    st.dictionaries(field_names, plain, max_size=8),
)


def valid_read_request() -> bytes:
    grant = StoreAuth(new_secret()).read_grant("seg", "epoch", np.array([[0, 64]]), 5.0)
    return wire.encode({"type": "read_request", "request_id": 7, "ranges": [[0, 64]], "grant": grant.to_wire()})


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes_are_refused_or_decoded_never_anything_else(data: bytes) -> None:
    try:
        message = wire.decode(data)
    except wire.WireError:
        return
    assert message["type"] in wire.SCHEMAS


@FUZZ
@given(messages)
def test_messages_with_wrong_field_types_are_refused_with_a_wire_error(message: dict[str, Any]) -> None:
    data = msgpack.packb(message, use_bin_type=True)
    try:
        checked = wire.decode(data)
    except wire.WireError:
        return
    # Accepted only if every required field is there with its type.
    for name, expected in wire.SCHEMAS[checked["type"]].items():
        assert isinstance(checked[name], expected)


@FUZZ
@given(st.data())
def test_a_truncated_message_is_refused(data: st.DataObject) -> None:
    whole = valid_read_request()
    cut = data.draw(st.integers(min_value=0, max_value=len(whole) - 1))
    with pytest.raises(wire.WireError):
        wire.decode(whole[:cut])


@FUZZ
@given(st.integers(min_value=wire.MAX_CONTROL_BYTES + 1, max_value=wire.MAX_CONTROL_BYTES + 4096))
def test_an_oversized_message_is_refused_before_it_is_unpacked(num_bytes: int) -> None:
    with pytest.raises(wire.WireError, match="exceeds"):
        wire.decode(b"\x80" * num_bytes)


@FUZZ
@given(st.integers(min_value=1 << 20, max_value=(1 << 32) - 1))
def test_containers_that_announce_huge_lengths_are_refused(length: int) -> None:
    for marker in (b"\xdd", b"\xdf", b"\xc6", b"\xdb"):  # array32, map32, bin32, str32
        with pytest.raises(wire.WireError):
            wire.decode(marker + struct.pack(">I", length) + b"\x00" * 16)


@FUZZ
@given(plain)
def test_grants_on_the_wire_are_parsed_or_refused_as_access_denied(value: Any) -> None:
    for parse in (ReadGrant.from_wire, WriteGrant.from_wire):
        with contextlib.suppress(AccessDenied):
            parse(value)


class ScriptedEndpoint:
    """A ucxx endpoint that delivers the given messages, in order (unit-test double for the frame parser)."""

    def __init__(self, messages: list[bytes]) -> None:
        self._messages = list(messages)

    async def recv(self, into: bytearray | memoryview) -> None:
        message = self._messages.pop(0)
        size = min(len(message), len(into))
        memoryview(into)[:size] = message[:size]


def recv_control(*messages: bytes) -> dict[str, Any]:
    return asyncio.run(Channel(ScriptedEndpoint(list(messages))).recv_control(body_timeout_s=1.0))


@FUZZ
@given(st.binary(max_size=CONTROL_SLOT_BYTES))
def test_a_random_ucx_frame_is_refused_as_a_framing_or_wire_error(frame: bytes) -> None:
    with contextlib.suppress(FramingError, wire.WireError):
        recv_control(frame, b"")


@FUZZ
@given(
    st.binary(min_size=4, max_size=4),
    st.integers(min_value=0, max_value=0xFFFF),
    st.integers(min_value=0, max_value=0xFFFF),
    st.integers(min_value=0, max_value=(1 << 64) - 1),
    st.binary(max_size=64),
)
def test_frame_headers_with_any_magic_version_flags_or_length_are_checked(
    magic: bytes, version: int, flags: int, body_bytes: int, body: bytes
) -> None:
    header = CONTROL_HEADER.pack(magic, version, flags, body_bytes)
    well_formed = magic == CONTROL_MAGIC and version == CONTROL_VERSION and flags in (0, FLAG_BODY_FOLLOWS)
    try:
        recv_control(header + body, body)
    except FramingError:
        return
    except wire.WireError:
        assert well_formed
        return
    assert well_formed


def test_a_follow_up_body_longer_than_announced_never_passes_for_a_message() -> None:
    body = valid_read_request()
    header = CONTROL_HEADER.pack(CONTROL_MAGIC, CONTROL_VERSION, FLAG_BODY_FOLLOWS, len(body) - 5)
    with pytest.raises(wire.WireError):
        recv_control(header, body)


class StalledBodyEndpoint(ScriptedEndpoint):
    """Delivers its messages, then a receive that never completes (a body whose sender stalled)."""

    posted: bytearray | memoryview | None = None

    async def recv(self, into: bytearray | memoryview) -> None:
        if self._messages:
            await super().recv(into)
            return
        self.posted = into
        await asyncio.Event().wait()


def test_a_body_whose_receive_timed_out_stays_held_by_the_channel() -> None:
    """Its receive is still posted until the connection's owner aborts the endpoint: the buffer must outlive the
    coroutine that made it, so the channel (held until then) keeps it."""
    header = CONTROL_HEADER.pack(CONTROL_MAGIC, CONTROL_VERSION, FLAG_BODY_FOLLOWS, CONTROL_SLOT_BYTES + 1)
    endpoint = StalledBodyEndpoint([header])
    channel = Channel(endpoint)
    with pytest.raises(TimeoutError):
        asyncio.run(channel.recv_control(body_timeout_s=0.05))
    assert endpoint.posted is not None and len(endpoint.posted) == CONTROL_SLOT_BYTES + 1
    assert channel._body_receiving is endpoint.posted


@pytest.fixture(scope="module")
def server() -> UcxServer:
    """A UcxServer that is never started: only its request checks run (no UCX)."""
    auth = StoreAuth(new_secret())
    return UcxServer(bytearray(SEGMENT_BYTES), gate=SegmentGate(auth, "seg", "epoch"), max_staging_bytes=4096)


ranges = st.lists(
    st.tuples(st.integers(min_value=0, max_value=(1 << 63) - 1), st.integers(min_value=1, max_value=(1 << 63) - 1)),
    min_size=1,
    max_size=8,
)


@FUZZ
@given(ranges)
def test_the_server_refuses_ranges_beyond_its_segment_or_staging(server: UcxServer, asked: list[Any]) -> None:
    try:
        total_bytes = server._check_request(asked)
    except _RequestRefused:
        return
    assert all(offset + length <= SEGMENT_BYTES for offset, length in asked)
    assert total_bytes == sum(length for _, length in asked)


@FUZZ
@given(st.sampled_from(["read_request", "write_request"]), plain, ranges, st.lists(st.binary(max_size=8), max_size=8))
def test_the_server_refuses_forged_or_malformed_grants(
    server: UcxServer, type_name: str, grant: Any, request_ranges: list[Any], keys: list[bytes]
) -> None:
    request = {"type": type_name, "grant": grant, "ranges": request_ranges, "keys": keys, "tenant": "t"}
    with pytest.raises(_RequestRefused):
        server._check_grant(request)


@FUZZ
@given(st.binary(max_size=256) | messages.map(lambda m: msgpack.packb(m, use_bin_type=True)))
def test_the_lookup_socket_answers_garbage_with_a_refusal(body: bytes) -> None:
    asked: list[str] = []
    server = LookupServer(lambda method, keys, node_id, tenant: asked.append(method) or 0, StoreAuth(new_secret()))
    reply = wire.decode(server._reply(body), "master_lookup_reply")  # an encoded frame body the client accepts
    assert reply["ok"] == bool(asked)

"""UcxServer / UcxClient over real UCX on loopback, with the server in a separate (spawned) process.

The server process is this very file, run with ``runpy.run_path`` under a private ``__name__``: a
spawn child cannot import test modules by name (pytest's importlib mode), but it can run a file.
It owns a numpy segment filled with a seeded random pattern, serves it, and answers commands on a
pipe: the bytes at a range, the on_write calls so far, stop. Both sides hold the same test store
secret: the client proves it on connect, and signs the grants its requests carry (as the master
would), through the ``read`` / ``write`` helpers below.

Every blocking call has a timeout (client calls, pipe polls, joins), so a hang fails a test.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing as mp
import runpy
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from proc_threads import thread_files

from rayturn.kvstore import ucx_features, ucx_handshake, ucx_native, wire
from rayturn.kvstore.access import HANDSHAKE_TIMEOUT_S, ReadGrant, SegmentGate, StoreAuth, WriteGrant
from rayturn.kvstore.ucx_runtime import load_ucxx
from rayturn.kvstore.ucx_transport import (
    CONTROL_HEADER,
    CONTROL_MAGIC,
    CONTROL_SLOT_BYTES,
    CONTROL_VERSION,
    FLAG_BODY_FOLLOWS,
    Address,
    TransportError,
    UcxClient,
    UcxServer,
    describe_transports,
    init_ucx,
    run_in_ucx_loop,
)

CHILD_RUN_NAME = "__rayturn_ucx_transport_test_server__"
SEGMENT_BYTES = 24 << 20
WRITE_AREA = 20 << 20  # tests write at and above this offset; reads stay below it
PATTERN_SEED = 1234
CALL_TIMEOUT_S = 20.0
STARTUP_TIMEOUT_S = 60.0
FAILING_KEY = b"make-on_write-fail"
SECRET = b"test-store-secret-of-32-bytes..."
SEGMENT_ID = "segment-under-test"
EPOCH = "epoch-of-the-test"  # the master's run the segment registered with
TENANT = "t"
AUTH = StoreAuth(SECRET)
GRANT_TTL_S = 60.0


def pattern() -> np.ndarray:
    return np.random.default_rng(PATTERN_SEED).integers(0, 256, SEGMENT_BYTES, dtype=np.uint8)


# -- the server process -------------------------------------------------------------------------


def _serve(conn: Connection) -> None:
    """Body of the server process: serve a patterned segment until told to stop."""
    segment = np.zeros(SEGMENT_BYTES, dtype=np.uint8)
    segment[:] = pattern()
    writes: list[tuple[list[bytes], list[tuple[int, int]], str]] = []

    def on_write(keys: list[bytes], ranges: list[tuple[int, int]], tenant: str) -> None:
        if FAILING_KEY in keys:
            raise RuntimeError("refusing this key on purpose")
        writes.append((keys, ranges, tenant))

    server = UcxServer(
        segment.data, gate=SegmentGate(StoreAuth(SECRET), SEGMENT_ID, EPOCH), on_write=on_write, io_timeout_s=5.0
    )
    conn.send(server.start())
    while True:
        command, *args = conn.recv()
        if command == "bytes":
            offset, num_bytes = args
            conn.send(segment[offset : offset + num_bytes].tobytes())
        elif command == "writes":
            conn.send(list(writes))
        elif command == "stop":
            break
    server.stop()
    server.stop()  # idempotent
    conn.send("stopped")


if __name__ == CHILD_RUN_NAME:
    _serve(globals()["CHILD_CONN"])  # handed over through runpy's init_globals


# -- fixtures -----------------------------------------------------------------------------------


@dataclass
class RemoteServer:
    process: Any
    conn: Connection
    address: Address

    def ask(self, *command: Any) -> Any:
        self.conn.send(command)
        assert self.conn.poll(CALL_TIMEOUT_S), f"server process did not answer {command[0]!r}"
        return self.conn.recv()

    def segment_bytes(self, offset: int, num_bytes: int) -> bytes:
        answer: bytes = self.ask("bytes", offset, num_bytes)
        return answer


@pytest.fixture(scope="module")
def remote() -> Iterator[RemoteServer]:
    context = mp.get_context("spawn")
    conn, child_conn = context.Pipe()
    process = context.Process(
        target=runpy.run_path,
        args=(__file__,),
        kwargs={"run_name": CHILD_RUN_NAME, "init_globals": {"CHILD_CONN": child_conn}},
        daemon=True,
    )
    process.start()
    try:
        if not conn.poll(STARTUP_TIMEOUT_S):
            pytest.fail("UCX server process did not start")
        yield RemoteServer(process, conn, conn.recv())
        conn.send(("stop",))
        assert conn.poll(CALL_TIMEOUT_S) and conn.recv() == "stopped"
        process.join(CALL_TIMEOUT_S)
        assert process.exitcode == 0
    finally:
        if process.is_alive():
            process.kill()
            process.join(5)


@pytest.fixture(scope="module")
def client() -> Iterator[UcxClient]:
    with UcxClient(auth=AUTH, timeout_s=CALL_TIMEOUT_S) as ucx_client:
        yield ucx_client


def read_grant(
    ranges: list[tuple[int, int]], segment_id: str = SEGMENT_ID, ttl_s: float = GRANT_TTL_S, epoch: str = EPOCH
) -> ReadGrant:
    """What the master hands a reader for these ranges."""
    return AUTH.read_grant(segment_id, epoch, np.array(ranges, dtype=np.int64), ttl_s)


def write_grant(keys: list[bytes], ranges: list[tuple[int, int]], tenant: str = TENANT) -> WriteGrant:
    """What the master hands a writer it placed these keys for (one range per key)."""
    entries = [(key, offset, length) for key, (offset, length) in zip(keys, ranges)]
    return AUTH.write_grant(SEGMENT_ID, EPOCH, tenant, entries, GRANT_TTL_S)


def read(client: UcxClient, address: Address, ranges: list[tuple[int, int]], dests: list[Any], **kwargs: Any) -> None:
    client.read(address, ranges, dests, read_grant(ranges), **kwargs)


def write(
    client: UcxClient, address: Address, keys: list[bytes], ranges: list[tuple[int, int]], sources: list[Any]
) -> None:
    signed = [key if isinstance(key, bytes) else b"" for key in keys]  # a bad key must fail in the client, not here
    client.write(address, keys, ranges, sources, TENANT, write_grant(signed, ranges))


@pytest.fixture(scope="module")
def expected() -> np.ndarray:
    return pattern()


# -- reads --------------------------------------------------------------------------------------


def test_read_single_range_into_bytearray(remote: RemoteServer, client: UcxClient, expected: np.ndarray) -> None:
    dest = bytearray(4096)
    read(client, remote.address, [(12345, 4096)], [dest])
    assert dest == expected[12345 : 12345 + 4096].tobytes()


def test_read_many_non_contiguous_ranges_into_mixed_destinations(
    remote: RemoteServer, client: UcxClient, expected: np.ndarray
) -> None:
    rng = np.random.default_rng(7)
    offsets = rng.choice(WRITE_AREA // 8192, size=300, replace=False) * 8192 + rng.integers(0, 100, 300)
    lengths = rng.integers(1, 5000, 300)
    ranges = [(int(offset), int(length)) for offset, length in zip(offsets, lengths)]
    dests: list[Any] = []
    for index, (_, length) in enumerate(ranges):
        kind = index % 3
        if kind == 0:
            dests.append(np.empty(length, dtype=np.uint8))
        elif kind == 1:
            dests.append(bytearray(length))
        else:
            dests.append(memoryview(bytearray(length)))
    read(client, remote.address, ranges, dests)
    for dest, (offset, length) in zip(dests, ranges):
        assert bytes(dest) == expected[offset : offset + length].tobytes()


def test_read_adjacent_ranges_into_typed_arrays(remote: RemoteServer, client: UcxClient, expected: np.ndarray) -> None:
    """Adjacent ranges (the server's zero-copy path) into multi-dimensional, non-byte arrays."""
    dests: list[np.ndarray] = [
        np.empty((4, 16), dtype=np.float32),
        np.empty(100, dtype=np.int16),
        np.empty((3, 3, 3), dtype=np.uint8),
    ]
    ranges = [(1000, 256), (1256, 200), (1456, 27)]
    read(client, remote.address, ranges, dests)
    assert b"".join(dest.tobytes() for dest in dests) == expected[1000:1483].tobytes()


def test_read_large_range(remote: RemoteServer, client: UcxClient, expected: np.ndarray) -> None:
    """16 MiB in one message: UCX's rendezvous path, straight into the destination."""
    dest = np.zeros(16 << 20, dtype=np.uint8)
    read(client, remote.address, [(1 << 20, 16 << 20)], [dest])
    assert np.array_equal(dest, expected[1 << 20 : 17 << 20])


def test_read_many_ranges_with_a_spilled_control_message(
    remote: RemoteServer, client: UcxClient, expected: np.ndarray
) -> None:
    """Enough ranges that the request outgrows the inline control slot and travels as a second message."""
    ranges = [(index * 97, 13) for index in range(0, 20000, 2)]
    dest = np.empty((len(ranges), 13), dtype=np.uint8)
    read(client, remote.address, ranges, list(dest))
    assert len(_read_request(1, ranges)) > CONTROL_SLOT_BYTES
    for row, (offset, length) in zip(dest, ranges):
        assert row.tobytes() == expected[offset : offset + length].tobytes()


def test_concurrent_reads_from_threads(remote: RemoteServer, client: UcxClient, expected: np.ndarray) -> None:
    failures: list[BaseException] = []

    def reader(seed: int) -> None:
        try:
            for step in range(8):
                offset = seed * 100_000 + step * 1000
                dests: list[Any] = [bytearray(100), np.empty(300, dtype=np.uint8)]
                read(client, remote.address, [(offset, 100), (offset + 500, 300)], dests)
                assert bytes(dests[0]) == expected[offset : offset + 100].tobytes()
                assert bytes(dests[1]) == expected[offset + 500 : offset + 800].tobytes()
        except BaseException as error:
            failures.append(error)

    threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(CALL_TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads)
    assert not failures, failures


# -- writes -------------------------------------------------------------------------------------


def _writes_since(remote: RemoteServer, count_before: int) -> list[Any]:
    writes: list[Any] = remote.ask("writes")
    return writes[count_before:]


def test_write_scattered_ranges_lands_and_calls_on_write(remote: RemoteServer, client: UcxClient) -> None:
    before = len(remote.ask("writes"))
    ranges = [(WRITE_AREA + 5000, 3), (WRITE_AREA, 4), (WRITE_AREA + 70_000, 100_000)]
    sources: list[Any] = [b"xyz", bytearray(b"abcd"), np.arange(100_000, dtype=np.uint32).astype(np.uint8)]
    keys = [b"object-1", b"object-2", b"object-3"]
    write(client, remote.address, keys, ranges, sources)
    assert remote.segment_bytes(WRITE_AREA + 5000, 3) == b"xyz"
    assert remote.segment_bytes(WRITE_AREA, 4) == b"abcd"
    assert remote.segment_bytes(WRITE_AREA + 70_000, 100_000) == sources[2].tobytes()
    assert _writes_since(remote, before) == [(keys, ranges, TENANT)]


def test_write_contiguous_ranges_then_read_back(remote: RemoteServer, client: UcxClient) -> None:
    """Adjacent ranges go straight into the segment (no staging) and read back identically."""
    before = len(remote.ask("writes"))
    payload = np.random.default_rng(3).integers(0, 256, 3 << 20, dtype=np.uint8)
    ranges = [(WRITE_AREA + (1 << 20), 1 << 20), (WRITE_AREA + (2 << 20), 2 << 20)]
    write(client, remote.address, [b"big-0", b"big-1"], ranges, [payload[: 1 << 20], payload[1 << 20 :]])
    back = np.empty(3 << 20, dtype=np.uint8)
    read(client, remote.address, [(WRITE_AREA + (1 << 20), 3 << 20)], [back])
    assert np.array_equal(back, payload)
    assert _writes_since(remote, before) == [([b"big-0", b"big-1"], ranges, TENANT)]


def test_failing_on_write_is_reported_and_the_connection_survives(remote: RemoteServer, client: UcxClient) -> None:
    with pytest.raises(TransportError, match="on_write failed: RuntimeError: refusing this key on purpose"):
        write(client, remote.address, [FAILING_KEY], [(WRITE_AREA + 9000, 2)], [b"hi"])
    assert remote.segment_bytes(WRITE_AREA + 9000, 2) == b"hi"  # the bytes had landed
    write(client, remote.address, [b"fine"], [(WRITE_AREA + 9000, 2)], [b"ok"])


# -- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize("ranges", [[(SEGMENT_BYTES, 1)], [(0, 10), (SEGMENT_BYTES - 5, 6)]])
def test_out_of_bounds_read_is_refused_and_the_server_keeps_serving(
    remote: RemoteServer, client: UcxClient, expected: np.ndarray, ranges: list[tuple[int, int]]
) -> None:
    dests = [bytearray(length) for _, length in ranges]
    with pytest.raises(TransportError, match=f"beyond the {SEGMENT_BYTES}-byte segment"):
        read(client, remote.address, ranges, dests)
    dest = bytearray(8)
    read(client, remote.address, [(64, 8)], [dest])
    assert dest == expected[64:72].tobytes()
    # The refused read's data receive was posted with its reply's: nothing, not even the next read's bytes,
    # may land in its destinations.
    assert all(refused == bytearray(len(refused)) for refused in dests)


def test_out_of_bounds_write_is_refused_and_lands_nothing(remote: RemoteServer, client: UcxClient) -> None:
    before = len(remote.ask("writes"))
    with pytest.raises(TransportError, match=r"range 1 .* beyond"):
        write(client, remote.address, [b"k0", b"k1"], [(WRITE_AREA + 100, 2), (SEGMENT_BYTES - 1, 2)], [b"no", b"pe"])
    assert remote.segment_bytes(WRITE_AREA + 100, 2) != b"no"
    assert _writes_since(remote, before) == []


def test_bad_arguments_raise_before_any_traffic() -> None:
    """Nothing listens on port 1: reaching the network would raise TransportError, not ValueError."""
    nowhere = ("127.0.0.1", 1)
    with UcxClient(auth=AUTH, timeout_s=CALL_TIMEOUT_S) as ucx_client:
        with pytest.raises(ValueError, match=r"dests\[1\] holds 5 bytes but range 1 has length 4"):
            read(ucx_client, nowhere, [(0, 4), (10, 4)], [bytearray(4), bytearray(5)])
        with pytest.raises(ValueError, match=r"dests\[0\]: .*read-only"):
            read(ucx_client, nowhere, [(0, 4)], [b"abcd"])
        with pytest.raises(ValueError, match="2 ranges but 1 dests"):
            read(ucx_client, nowhere, [(0, 4), (10, 4)], [bytearray(4)])
        with pytest.raises(ValueError, match=r"ranges\[0\] length 0 must be positive"):
            read(ucx_client, nowhere, [(0, 0)], [bytearray(0)])
        with pytest.raises(ValueError, match=r"sources\[0\] holds 3 bytes but range 0 has length 2"):
            write(ucx_client, nowhere, [b"k"], [(0, 2)], [b"abc"])
        with pytest.raises(ValueError, match=r"keys\[0\] must be bytes"):
            write(ucx_client, nowhere, ["k"], [(0, 2)], [b"ab"])  # type: ignore[list-item]
        with pytest.raises(ValueError, match=r"dests\[0\]: .*not C-contiguous"):
            read(ucx_client, nowhere, [(0, 4)], [np.zeros((4, 2), dtype=np.uint8)[:, 0]])
        with pytest.raises(ValueError, match="more than the limit of 65536"):
            read(ucx_client, nowhere, [(0, 1)] * 65537, [bytearray(1)] * 65537)


# -- misbehaving peers, spoken to through a raw ucxx endpoint -----------------------------------


def _frame(body: bytes, *, magic: bytes = CONTROL_MAGIC, flags: int = 0, announced_bytes: int | None = None) -> bytes:
    size = len(body) if announced_bytes is None else announced_bytes
    return CONTROL_HEADER.pack(magic, CONTROL_VERSION, flags, size) + body


async def _recv_frame(endpoint: Any, expected_type: str) -> dict[str, Any]:
    slot = bytearray(CONTROL_SLOT_BYTES)
    await endpoint.recv(slot)
    magic, _, _, body_bytes = CONTROL_HEADER.unpack_from(slot)
    assert magic == CONTROL_MAGIC
    return wire.decode(slot[CONTROL_HEADER.size : CONTROL_HEADER.size + body_bytes], expected_type)


async def _prove_the_secret(endpoint: Any) -> None:
    """Answer the server's challenge on a raw endpoint, and check it accepted."""
    challenge = await _recv_frame(endpoint, "challenge")
    client_nonce, proof = AUTH.answer(challenge["nonce"])
    await endpoint.send(_frame(wire.encode({"type": "auth", "nonce": client_nonce, "proof": proof})))
    assert (await _recv_frame(endpoint, "reply"))["ok"]


async def _raw_session(address: Address, messages: list[bytes], replies: int) -> list[dict[str, Any]]:
    """Prove the secret on a fresh endpoint, send ``messages`` as they are, then decode ``replies`` reply frames."""
    import ucxx

    endpoint = await ucxx.create_endpoint(*address)
    try:
        await _prove_the_secret(endpoint)
        for message in messages:
            await endpoint.send(message)
        return [await _recv_frame(endpoint, "reply") for _ in range(replies)]
    finally:
        endpoint.abort()


def _raw(address: Address, messages: list[bytes], replies: int) -> list[dict[str, Any]]:
    return run_in_ucx_loop(asyncio.wait_for(_raw_session(address, messages, replies), 10.0), timeout_s=CALL_TIMEOUT_S)


def _read_request(request_id: int, ranges: list[tuple[int, int]]) -> bytes:
    message = {"type": "read_request", "request_id": request_id, "ranges": [list(r) for r in ranges]}
    return wire.encode({**message, "grant": read_grant(ranges).to_wire()})


def _still_serves(remote: RemoteServer, client: UcxClient, expected: np.ndarray) -> None:
    dest = bytearray(16)
    read(client, remote.address, [(4096, 16)], [dest])
    assert dest == expected[4096:4112].tobytes()


@pytest.mark.parametrize(
    ("body", "complaint"),
    [
        (b"\xc1", "not valid msgpack"),
        (b"\x93\x01", "not valid msgpack"),
        (wire.encode({"type": "reply", "request_id": 9, "ok": True, "total_bytes": 0}), "does not handle 'reply'"),
        (b"\x81\xa4type\xa7unknown", "unknown control message type 'unknown'"),
        (b"", "empty control message"),
    ],
)
def test_malformed_control_message_gets_an_error_and_the_connection_keeps_serving(
    remote: RemoteServer, client: UcxClient, expected: np.ndarray, body: bytes, complaint: str
) -> None:
    good = _read_request(5, [(0, 8)])
    refusal, answer = _raw(remote.address, [_frame(body), _frame(good)], replies=2)
    assert refusal["ok"] is False
    assert complaint in refusal["error"]
    assert answer == {"type": "reply", "request_id": 5, "ok": True, "total_bytes": 8}  # same connection still in step
    _still_serves(remote, client, expected)


def test_frame_shorter_than_announced_is_refused(remote: RemoteServer, client: UcxClient, expected: np.ndarray) -> None:
    """A body cut short leaves zeros behind it, which the decoder reports as trailing bytes."""
    good = _read_request(5, [(0, 8)])
    (refusal,) = _raw(remote.address, [_frame(good[:-3], announced_bytes=len(good) + 10)], replies=1)
    assert refusal["ok"] is False
    assert "malformed request" in refusal["error"]
    _still_serves(remote, client, expected)


@pytest.mark.parametrize(
    ("message", "complaint"),
    [
        (_frame(b"\x80", magic=b"HTTP"), "not a control frame"),
        (b"GET / HTTP/1.1\r\n", "not a control frame"),
        (_frame(b"", flags=FLAG_BODY_FOLLOWS, announced_bytes=wire.MAX_CONTROL_BYTES + 1), "exceeds"),
        (_frame(b"", flags=0x80), "unknown control frame flags"),
        (_frame(b"", announced_bytes=CONTROL_SLOT_BYTES), "cannot fit"),
        (bytes(CONTROL_SLOT_BYTES + 1), "larger than the"),
    ],
)
def test_unusable_frame_closes_only_that_connection(
    remote: RemoteServer, client: UcxClient, expected: np.ndarray, message: bytes, complaint: str
) -> None:
    (refusal,) = _raw(remote.address, [message], replies=1)
    assert refusal["ok"] is False
    assert refusal["error"].startswith("closing connection")
    assert complaint in refusal["error"]
    _still_serves(remote, client, expected)


async def _stalled_read(remote: RemoteServer, client: UcxClient, expected: np.ndarray) -> tuple[dict[str, Any], str]:
    """Ask for 8 MiB, take the reply but not the data for longer than the server's I/O timeout (5 s), checking
    meanwhile that another connection is served; then try to take the data: what became of it."""
    import ucxx

    endpoint = await ucxx.create_endpoint(*remote.address)
    try:
        await _prove_the_secret(endpoint)
        await endpoint.send(_frame(_read_request(7, [(0, 8 << 20)])))
        reply = await _recv_frame(endpoint, "reply")
        dest = bytearray(16)
        await asyncio.to_thread(read, client, remote.address, [(4096, 16)], [dest])
        assert dest == expected[4096:4112].tobytes()  # the stalled send holds up no other connection
        await asyncio.sleep(6.5)
        data = np.zeros(8 << 20, dtype=np.uint8)
        try:
            await asyncio.wait_for(endpoint.recv(data), 3.0)
        except Exception as error:  # the server hung up: UCX says so in its own words, or nothing comes
            return reply, type(error).__name__
        return reply, "landed" if np.array_equal(data, expected[: 8 << 20]) else "garbled"
    finally:
        endpoint.abort()


def test_a_reader_that_does_not_take_its_data_is_hung_up_on_after_the_io_timeout(
    remote: RemoteServer, client: UcxClient, expected: np.ndarray
) -> None:
    stalled = asyncio.wait_for(_stalled_read(remote, client, expected), 20.0)
    reply, fate = run_in_ucx_loop(stalled, timeout_s=CALL_TIMEOUT_S)
    assert reply == {"type": "reply", "request_id": 7, "ok": True, "total_bytes": 8 << 20}
    assert fate not in ("landed", "garbled")
    _still_serves(remote, client, expected)


# -- who may connect, and which bytes a request may touch ---------------------------------------


async def _refused(address: Address, proof: bytes | None) -> tuple[dict[str, Any], bool]:
    """A connection that answers the challenge with ``proof`` (None: sends a read request instead): the server's
    reply, and whether the connection was closed after it."""
    import ucxx

    endpoint = await ucxx.create_endpoint(*address)
    try:
        await _recv_frame(endpoint, "challenge")
        if proof is None:
            first = _read_request(1, [(0, 1 << 20)])
        else:
            first = wire.encode({"type": "auth", "nonce": b"c" * 32, "proof": proof})
        await endpoint.send(_frame(first))
        refusal = await _recv_frame(endpoint, "reply")
        try:
            await endpoint.send(_frame(_read_request(2, [(0, 8)])))
            await asyncio.wait_for(_recv_frame(endpoint, "reply"), 3.0)
        except Exception:  # the endpoint is gone (UCX says so in its own words), or nothing answers
            return refusal, True
        return refusal, False
    finally:
        endpoint.abort()


@pytest.mark.parametrize(
    "proof", [None, b"\x00" * 32, StoreAuth(b"another-cluster's-secret-32bytes").answer(b"n" * 32)[1]]
)
def test_a_peer_that_cannot_prove_the_secret_is_refused_and_hung_up_on(
    remote: RemoteServer, client: UcxClient, expected: np.ndarray, proof: bytes | None
) -> None:
    """No answer to the challenge (a plain UCX client sending a request straight away), or a wrong one."""
    (refusal, closed) = run_in_ucx_loop(
        asyncio.wait_for(_refused(remote.address, proof), 10.0), timeout_s=CALL_TIMEOUT_S
    )
    assert refusal["ok"] is False and refusal["error"].startswith("authentication refused")
    assert closed  # hung up on: the request sent after the refusal got no answer on that connection
    _still_serves(remote, client, expected)


def test_a_wrong_secret_cannot_read_through_the_client_either(remote: RemoteServer) -> None:
    stranger = StoreAuth(b"another-cluster's-secret-32bytes")
    with UcxClient(auth=stranger, timeout_s=CALL_TIMEOUT_S) as outsider:
        ranges = [(0, 4096)]
        with pytest.raises(TransportError, match="authentication refused"):
            outsider.read(
                remote.address, ranges, [bytearray(4096)], stranger.read_grant(SEGMENT_ID, EPOCH, np.array(ranges), 60)
            )


@pytest.mark.parametrize(
    ("grant", "complaint"),
    [
        (lambda ranges: read_grant([(0, 4096)]), r"range 0 \(8192, 4096\) is not granted"),
        (lambda ranges: read_grant(ranges + [(0, 1)]), None),  # a grant may cover more than one request asks
        (lambda ranges: read_grant(ranges, segment_id="another-segment"), "not for this segment"),
        (lambda ranges: read_grant(ranges, ttl_s=-1.0), "grant expired"),
        (lambda ranges: read_grant(ranges, epoch="the-masters-previous-run"), "another run of the master"),
        (
            lambda ranges: ReadGrant(EPOCH, time.time() + 60, read_grant(ranges).ranges, b"\x00" * 32),
            "not the master's",
        ),
        (
            lambda ranges: ReadGrant(
                EPOCH, time.time() + 60, read_grant([(0, 1 << 20)]).ranges, read_grant(ranges).mac
            ),
            "not the master's",
        ),
    ],
    ids=["other-ranges", "wider-grant", "other-segment", "expired", "other-epoch", "forged", "swapped-ranges"],
)
def test_a_read_gets_only_the_ranges_its_grant_covers(
    remote: RemoteServer, client: UcxClient, expected: np.ndarray, grant: Any, complaint: str | None
) -> None:
    ranges = [(8192, 4096)]
    dest = bytearray(4096)
    if complaint is None:
        client.read(remote.address, ranges, [dest], grant(ranges))
        assert dest == expected[8192 : 8192 + 4096].tobytes()
        return
    with pytest.raises(TransportError, match=complaint):
        client.read(remote.address, ranges, [dest], grant(ranges))
    assert dest == bytearray(4096)  # nothing arrived
    _still_serves(remote, client, expected)


@pytest.mark.parametrize(
    ("keys", "tenant", "grant_keys", "grant_ranges", "grant_tenant"),
    [
        ([b"mine"], TENANT, [b"mine"], [(WRITE_AREA + 4096, 4)], TENANT),  # granted elsewhere
        ([b"mine"], TENANT, [b"theirs"], [(WRITE_AREA + 300, 4)], TENANT),  # granted for another key
        ([b"mine"], "intruder", [b"mine"], [(WRITE_AREA + 300, 4)], TENANT),  # granted to another tenant
    ],
    ids=["other-range", "other-key", "other-tenant"],
)
def test_a_write_lands_only_where_the_master_placed_its_keys(
    remote: RemoteServer,
    client: UcxClient,
    keys: list[bytes],
    tenant: str,
    grant_keys: list[bytes],
    grant_ranges: list[tuple[int, int]],
    grant_tenant: str,
) -> None:
    before = len(remote.ask("writes"))
    original = remote.segment_bytes(WRITE_AREA + 300, 4)
    with pytest.raises(TransportError, match="write refused"):
        client.write(
            remote.address,
            keys,
            [(WRITE_AREA + 300, 4)],
            [b"evil"],
            tenant,
            write_grant(grant_keys, grant_ranges, grant_tenant),
        )
    assert remote.segment_bytes(WRITE_AREA + 300, 4) == original != b"evil"
    assert _writes_since(remote, before) == []


# -- connections, timeouts, lifecycle -----------------------------------------------------------


def test_timeout_drops_the_endpoint_and_the_next_call_reconnects(
    remote: RemoteServer, client: UcxClient, expected: np.ndarray
) -> None:
    _still_serves(remote, client, expected)
    with pytest.raises(TransportError, match="timed out"):
        read(client, remote.address, [(0, 8 << 20)], [np.empty(8 << 20, dtype=np.uint8)], timeout_s=1e-4)
    _still_serves(remote, client, expected)


# Reads past their deadline that must time out in a row of tries; a read that lands in time tightens the deadline.
DEADLINE_TIMEOUTS, MAX_DEADLINE_TRIES = 20, 40


def _fastest_read_s(client: UcxClient, address: Address, dest: np.ndarray) -> float:
    times = []
    for _ in range(5):
        start = time.perf_counter()
        read(client, address, [(0, dest.nbytes)], [dest])
        times.append(time.perf_counter() - start)
    return min(times)


@pytest.mark.parametrize("path", ["native", "ucxx"])
def test_reads_past_their_deadline_time_out_and_the_process_stays_whole(
    remote: RemoteServer, client: UcxClient, expected: np.ndarray, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that cannot land by its deadline raises, however steadily its transfer progresses (the native
    reader once looked at its deadline only after a round that made no progress, and such reads landed late and
    succeeded). And a run of timeouts, with reconnections cut short among them, corrupts nothing: ucxx's
    handshake, cancelled by a request's timeout, once left its receive posted into a buffer it then freed."""
    if path == "native" and ucx_native.library() is None:
        pytest.skip("no native library (no C compiler?)")
    if path == "ucxx":
        monkeypatch.setattr(ucx_native.NativeReads, "read", lambda *args, **kwargs: False)
    dest = np.empty(16 << 20, dtype=np.uint8)
    deadline_s = _fastest_read_s(client, remote.address, dest) / 4
    timeouts = 0
    for _ in range(MAX_DEADLINE_TRIES):
        start = time.perf_counter()
        try:
            read(client, remote.address, [(0, dest.nbytes)], [dest], timeout_s=deadline_s)
        except TransportError as err:
            assert "timed out" in str(err)
            timeouts += 1
            if timeouts == DEADLINE_TIMEOUTS:
                break
            continue
        # It landed. In time is right: the host reads faster now than while calibrating (a quieter moment), so
        # the deadline tightens. Late is the bug: a read that kept progressing past its deadline and succeeded.
        elapsed_s = time.perf_counter() - start
        assert elapsed_s < 3 * deadline_s, f"a read landed after {elapsed_s:.4f} s, its deadline {deadline_s:.4f} s"
        deadline_s /= 2
    assert timeouts == DEADLINE_TIMEOUTS
    gc.collect()
    churn = [bytearray(16) for _ in range(100_000)]  # the small blocks a late handshake reply would have hit
    del churn
    read(client, remote.address, [(0, dest.nbytes)], [dest])
    assert np.array_equal(dest, expected[: dest.nbytes])
    _still_serves(remote, client, expected)


def test_a_peer_stalling_the_ucx_handshake_past_its_timeout_corrupts_nothing(
    remote: RemoteServer, client: UcxClient, expected: np.ndarray
) -> None:
    """Peers that take the listener's half of ucxx's tag exchange, wait out the listener's timeout, then send
    theirs: the server once freed the buffer its receive was still posted into, and died of the late bytes."""
    ucxx = load_ucxx()
    host, port = remote.address
    _still_serves(remote, client, expected)  # this process's UCX context is made on its first call
    context = ucx_features.application_context()
    assert context is not None

    async def stall(tag: int) -> Any:
        endpoint = ucxx._lib.libucxx.UCXEndpoint.create(context.worker, host, port, True)
        theirs = bytearray(16)
        await endpoint.stream_recv(ucxx._lib.arr.Array(theirs)).wait()
        await asyncio.sleep(HANDSHAKE_TIMEOUT_S + 1.0)
        with contextlib.suppress(Exception):  # the server has closed its end by now: the send may fail
            await endpoint.stream_send(ucxx._lib.arr.Array(struct.pack("QQ", tag, tag))).wait()
        await asyncio.sleep(0.5)
        return endpoint

    async def stall_all() -> list[Any]:
        return await asyncio.gather(*(stall(tag) for tag in range(30)), return_exceptions=True)

    endpoints = run_in_ucx_loop(stall_all(), timeout_s=HANDSHAKE_TIMEOUT_S + 30.0)
    assert len(endpoints) == 30
    dest = np.empty(1 << 20, dtype=np.uint8)
    for _ in range(50):  # the server allocates as it serves and answers: a corrupted heap shows here
        _still_serves(remote, client, expected)
        read(client, remote.address, [(0, dest.nbytes)], [dest])
        assert np.array_equal(dest, expected[: dest.nbytes])
        assert remote.ask("bytes", 4096, 16) == expected[4096:4112].tobytes()
    assert remote.process.is_alive()


def test_unreachable_server_raises_transport_error() -> None:
    """Refused outright, or no handshake within connect_timeout_s: UCX does either, by timing. Either way the
    handshake ends (one on an endpoint that failed is never completed by UCX: it is cancelled once closed)."""
    before = ucx_handshake.pending_exchanges()
    with (
        UcxClient(auth=AUTH, timeout_s=CALL_TIMEOUT_S, connect_timeout_s=2.0) as ucx_client,
        pytest.raises(TransportError, match=r"read \('127\.0\.0\.1', 1\) failed: (cannot connect|no UCX handshake)"),
    ):
        read(ucx_client, ("127.0.0.1", 1), [(0, 4)], [bytearray(4)])
    deadline = time.monotonic() + ucx_handshake.CLOSED_GRACE_S + 5.0
    while ucx_handshake.pending_exchanges() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ucx_handshake.pending_exchanges() == before


def test_server_in_this_process_and_clean_stop() -> None:
    """A process can serve and read at once (one UCX loop); a stopped server breaks its clients' calls."""
    segment = bytearray(range(256)) * 16
    with (
        UcxServer(segment, gate=SegmentGate(AUTH, SEGMENT_ID, EPOCH)) as server,
        UcxClient(auth=AUTH, timeout_s=CALL_TIMEOUT_S, connect_timeout_s=2.0) as ucx_client,
    ):
        address = server.start()  # idempotent while running
        assert server.address == address
        dest = bytearray(6)
        read(ucx_client, address, [(250, 6)], [dest])
        assert dest == bytes([250, 251, 252, 253, 254, 255])
        write(ucx_client, address, [b"k"], [(0, 2)], [b"\xff\xee"])
        assert segment[:2] == b"\xff\xee"
        server.stop()
        server.stop()
        assert server.address is None
        with pytest.raises(TransportError):
            read(ucx_client, address, [(0, 1)], [bytearray(1)])
    with pytest.raises(RuntimeError, match="cannot be restarted"):
        server.start()
    with pytest.raises(TransportError, match="closed"):
        read(ucx_client, address, [(0, 1)], [bytearray(1)])


def test_server_refuses_read_only_segments_and_bad_ports() -> None:
    with pytest.raises(ValueError, match="read-only"):
        UcxServer(memoryview(b"abc"), gate=SegmentGate(AUTH, SEGMENT_ID, EPOCH))
    with pytest.raises(ValueError, match="port"):
        UcxServer(bytearray(8), gate=SegmentGate(AUTH, SEGMENT_ID, EPOCH), port=70000)


def test_init_ucx_checks_names_and_refuses_after_start(
    remote: RemoteServer, client: UcxClient, expected: np.ndarray
) -> None:
    with pytest.raises(ValueError, match="not a UCX option name"):
        init_ucx({"tls": "tcp"})
    _still_serves(remote, client, expected)  # now this process's UCX is surely running
    with pytest.raises(RuntimeError, match="before the first"):
        init_ucx({"TLS": "tcp,self"})


def test_describe_transports_names_ucx_and_its_transports(remote: RemoteServer) -> None:
    text = describe_transports()
    assert text.startswith("UCX 1.")
    assert "tcp" in text


def test_calling_the_client_from_the_ucx_loop_is_refused(remote: RemoteServer, client: UcxClient) -> None:
    async def nested() -> None:
        read(client, remote.address, [(0, 1)], [bytearray(1)])

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="from the UCX loop thread"):
        run_in_ucx_loop(nested(), timeout_s=CALL_TIMEOUT_S)
    assert time.monotonic() - started < CALL_TIMEOUT_S / 2


def test_the_client_refuses_a_server_that_cannot_prove_the_secret() -> None:
    """A stranger on a member's port (a squatter after the member died) accepts anyone; the client finds out."""
    from rayturn.kvstore.ucx_framing import Channel
    from rayturn.kvstore.ucx_runtime import load_ucxx

    async def impostor(endpoint: Any) -> None:
        channel = Channel(endpoint)
        await channel.send_control(wire.encode({"type": "challenge", "nonce": b"s" * 32}))
        await channel.recv_control(expected_type="auth")
        await channel.send_reply(0, ok=True, proof=b"\x00" * 32)  # accepts, but cannot sign for the secret
        await asyncio.sleep(5.0)  # would serve whatever is asked next

    async def listen() -> Any:
        return load_ucxx().create_listener(impostor, port=0)

    async def close(listener: Any) -> None:
        listener.close()

    listener = run_in_ucx_loop(listen(), timeout_s=CALL_TIMEOUT_S)
    try:
        with UcxClient(auth=AUTH, timeout_s=CALL_TIMEOUT_S, connect_timeout_s=5.0) as ucx_client:
            dest = bytearray(8)
            with pytest.raises(TransportError, match="the server does not hold the store secret"):
                read(ucx_client, ("127.0.0.1", listener.port), [(0, 8)], [dest])
            assert dest == bytearray(8)
    finally:
        run_in_ucx_loop(close(listener), timeout_s=CALL_TIMEOUT_S)


def _context_switches(pid: int) -> int:
    """Every context switch of every thread of ``pid`` so far (Linux's per-thread counters)."""
    return sum(
        int(line.split()[1])
        for status in thread_files(pid, "status")
        for line in status.splitlines()
        if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"))
    )


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts context switches in /proc")
def test_an_idle_server_process_stays_asleep(remote: RemoteServer, client: UcxClient, expected: np.ndarray) -> None:
    """After serving, a process of the store wakes up a few times a second, not ~900 (ucxx's progress thread
    with its own 1 ms wait did): every wake-up takes a core from whatever else runs on the host."""
    _still_serves(remote, client, expected)
    started, before = time.monotonic(), _context_switches(remote.process.pid)
    time.sleep(2.0)
    rate = (_context_switches(remote.process.pid) - before) / (time.monotonic() - started)
    assert rate < 100, f"an idle UCX server process switched context {rate:.0f} times a second"

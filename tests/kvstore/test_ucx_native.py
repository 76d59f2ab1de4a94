"""The native reader (``kvstore/ucx_native.c``): real UCX, the server's thread and the client's worker in this process.

What it must keep of the ucxx server's doors: only members who prove the store secret are served, every
read needs the master's grant for exactly its ranges of this segment in this epoch, unexpired, and
nothing outside the segment is ever sent. And what it is for: UcxClient sends small reads there once
the ucxx handshake told it the port, and falls back to ucxx when it is gone.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from proc_threads import stop_process

from rayturn import native_build
from rayturn.kvstore import ucx_native
from rayturn.kvstore.access import ReadGrant, SegmentGate, StoreAuth
from rayturn.kvstore.ucx_native import (
    STAT_ACCEPTED,
    STAT_REFUSED,
    STAT_SERVED,
    NativeClient,
    NativeReadFailed,
    NativeServer,
)
from rayturn.kvstore.ucx_transport import PeerTimedOut, TransportError, UcxClient, UcxServer

SECRET = b"test-store-secret-of-32-bytes..."
SEGMENT_ID = "native-segment"
EPOCH = "epoch-1"
SEGMENT_BYTES = 2 << 20
TIMEOUT_S = 10.0
SPOILER_SOURCE = Path(__file__).with_name("ucx_session_spoiler.c")

pytestmark = pytest.mark.skipif(ucx_native.library() is None, reason="no native library (no C compiler?)")


@pytest.fixture
def auth() -> StoreAuth:
    return StoreAuth(SECRET)


@pytest.fixture
def segment() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, SEGMENT_BYTES, dtype=np.uint8)


@pytest.fixture
def server(auth: StoreAuth, segment: np.ndarray) -> Iterator[NativeServer]:
    served = NativeServer(memoryview(segment), SegmentGate(auth, SEGMENT_ID, EPOCH), "127.0.0.1")
    try:
        yield served
    finally:
        served.stop()


@pytest.fixture
def client(auth: StoreAuth) -> Iterator[NativeClient]:
    made = NativeClient(auth)
    try:
        yield made
    finally:
        made.close()


def grant_for(auth: StoreAuth, ranges: list[tuple[int, int]], **changes: Any) -> ReadGrant:
    kwargs = {"segment_id": SEGMENT_ID, "epoch": EPOCH, "ttl_s": 60.0, **changes}
    return auth.read_grant(kwargs["segment_id"], kwargs["epoch"], np.array(ranges, dtype=np.int64), kwargs["ttl_s"])


def read(client: NativeClient, server: NativeServer, ranges: list[tuple[int, int]], grant: ReadGrant) -> list[bytes]:
    dests = [bytearray(length) for _, length in ranges]
    client.read("127.0.0.1", server.port, ranges, grant, [memoryview(d) for d in dests], TIMEOUT_S)
    return [bytes(d) for d in dests]


@pytest.mark.parametrize("length", [0, 1, 55, 56, 63, 64, 65, 1000, 40_000])
def test_the_c_hmac_is_hmac_sha256(length: int) -> None:
    lib = ucx_native.library()
    assert lib is not None
    key, data = os.urandom(32), os.urandom(length)
    out = bytes(32)
    lib.rt_hmac_sha256(key, data, length, out)
    assert out == hmac.new(key, data, hashlib.sha256).digest()


def test_reads_land_exactly_the_granted_ranges(
    auth: StoreAuth, server: NativeServer, client: NativeClient, segment: np.ndarray
) -> None:
    one = [(32768, 32768)]
    assert read(client, server, one, grant_for(auth, one)) == [segment[32768:65536].tobytes()]
    # Several ranges, out of order, into separate buffers; one grant (sorted by the master) covers them.
    many = [(4096, 4096), (0, 100), (500_000, 7), (SEGMENT_BYTES - 10, 10)]
    landed = read(client, server, many, grant_for(auth, many))
    assert landed == [segment[offset : offset + length].tobytes() for offset, length in many]
    # A subset of a grant's ranges is a read it covers.
    assert read(client, server, many[1:2], grant_for(auth, many)) == [segment[0:100].tobytes()]
    # A whole segment: past the eager size, so UCX moves it by rendezvous into the caller's buffer.
    whole = [(0, SEGMENT_BYTES)]
    assert read(client, server, whole, grant_for(auth, whole)) == [segment.tobytes()]
    assert server.stat(STAT_SERVED) == 4 and server.stat(STAT_ACCEPTED) == 1  # one connection, kept


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("other segment", "the grant is not the master's, or not for this segment"),
        ("other epoch", "another run of the master"),
        ("expired", "the grant expired"),
        ("not granted", "range 0 (0, 32768) is not granted"),
        ("beyond the segment", "beyond the 2097152-byte segment"),
        ("forged", "the grant is not the master's"),
        ("other secret", "the grant is not the master's"),
    ],
)
def test_every_wrong_grant_is_refused_and_the_connection_keeps_serving(
    auth: StoreAuth, server: NativeServer, client: NativeClient, segment: np.ndarray, case: str, message: str
) -> None:
    ranges = [(32768, 32768)]
    grant = grant_for(auth, ranges)
    if case == "other segment":
        grant = grant_for(auth, ranges, segment_id="another-segment")
    elif case == "other epoch":
        grant = grant_for(auth, ranges, epoch="epoch-0")
    elif case == "expired":
        grant = grant_for(auth, ranges, ttl_s=-1.0)
    elif case == "not granted":
        ranges = [(0, 32768)]
    elif case == "beyond the segment":
        ranges = [(SEGMENT_BYTES - 100, 200)]
        grant = grant_for(auth, ranges)
    elif case == "forged":
        grant = ReadGrant(grant.epoch, grant.expires_at + 3600, grant.ranges, grant.mac)
    elif case == "other secret":
        grant = grant_for(StoreAuth(b"another cluster's store secret!!"), ranges)
    dests = [memoryview(bytearray(length)) for _, length in ranges]
    with pytest.raises(NativeReadFailed, match=re.escape(message)) as refused:
        client.read("127.0.0.1", server.port, ranges, grant, dests, TIMEOUT_S)
    assert refused.value.kind == "refused"
    assert all(not any(dest) for dest in dests)  # nothing landed
    good = [(32768, 32768)]
    assert read(client, server, good, grant_for(auth, good)) == [segment[32768:65536].tobytes()]
    assert server.stat(STAT_ACCEPTED) == 1  # the same connection served the read after the refusal


def test_a_peer_without_the_secret_gets_no_answer(auth: StoreAuth, server: NativeServer, segment: np.ndarray) -> None:
    """A wrong proof is dropped unanswered (a message may name another connection's endpoint, so none is answered
    or hung up on for it); the peer's handshake runs out, and the server hangs up at its own deadline."""
    stranger = NativeClient(StoreAuth(b"another cluster's store secret!!"))
    try:
        ranges, into = [(0, 64)], bytearray(64)
        with pytest.raises(NativeReadFailed, match="no handshake's answer from the server in time") as refused:
            stranger.read("127.0.0.1", server.port, ranges, grant_for(auth, ranges), [memoryview(into)], 1.0)
        assert refused.value.kind == "failed" and not any(into)
    finally:
        stranger.close()
    assert server.stat(STAT_SERVED) == 0 and server.stat(STAT_REFUSED) >= 1


@pytest.fixture(scope="module")
def spoiler_library(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The native reader's own source with ``rt_test_spoil_session`` added (``ucx_session_spoiler.c``), built with
    the product library's flags (``ucx_native.build_flags``)."""
    compiler = native_build.compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    target = tmp_path_factory.mktemp("spoiler") / "ucx_session_spoiler.so"
    native_build.build(compiler, *ucx_native.build_flags(SPOILER_SOURCE), target)
    built = ucx_native._declare(native_build.load(target))
    built.rt_test_spoil_session.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    built.rt_test_spoil_session.restype = ctypes.c_int
    return built


def test_a_read_not_signed_with_its_connections_session_key_gets_no_answer(
    auth: StoreAuth, segment: np.ndarray, spoiler_library: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch
) -> None:
    """UCX tells the server which endpoint a message comes from by an id the sender writes, so a peer could name
    a proven connection's endpoint: every READ must be signed with that connection's session key, and one that
    is not is dropped unanswered (counted as refused), while the connection's own reads and other peers' go on."""
    monkeypatch.setattr(ucx_native, "library", lambda: spoiler_library)
    server = NativeServer(memoryview(segment), SegmentGate(auth, SEGMENT_ID, EPOCH), "127.0.0.1")
    spoiled, other = NativeClient(auth), NativeClient(auth)
    try:
        ranges = [(8192, 4096)]
        expected = [segment[8192:12288].tobytes()]
        assert read(spoiled, server, ranges, grant_for(auth, ranges)) == expected  # proven, and served
        assert spoiler_library.rt_test_spoil_session(spoiled._handle, b"127.0.0.1", server.port) == 0
        into = bytearray(4096)
        with pytest.raises(NativeReadFailed) as dropped:
            spoiled.read("127.0.0.1", server.port, ranges, grant_for(auth, ranges), [memoryview(into)], 1.0)
        assert dropped.value.kind == "timeout" and not any(into)  # no answer at all, not a refusal with a reason
        assert server.stat(STAT_SERVED) == 1 and server.stat(STAT_REFUSED) == 1
        assert read(other, server, ranges, grant_for(auth, ranges)) == expected  # the server serves on
        assert server.stat(STAT_SERVED) == 2 and server.stat(STAT_ACCEPTED) == 2
    finally:
        spoiled.close()
        other.close()
        server.stop()


def test_the_epoch_and_the_secret_follow_the_gate(
    auth: StoreAuth, server: NativeServer, client: NativeClient, segment: np.ndarray
) -> None:
    ranges = [(0, 4096)]
    read(client, server, ranges, grant_for(auth, ranges))
    server._gate.epoch = "epoch-2"  # the segment registered with a restarted master
    with pytest.raises(NativeReadFailed, match="another run of the master"):
        read(client, server, ranges, grant_for(auth, ranges))
    assert read(client, server, ranges, grant_for(auth, ranges, epoch="epoch-2")) == [segment[:4096].tobytes()]
    # The master was re-created with a new secret: both ends take the new keys; old grants no longer pass.
    old_grant = grant_for(auth, ranges, epoch="epoch-2")
    auth.update(b"the re-created master's secret!!")
    with pytest.raises(NativeReadFailed, match="not the master's"):
        read(client, server, ranges, old_grant)
    assert read(client, server, ranges, grant_for(auth, ranges, epoch="epoch-2")) == [segment[:4096].tobytes()]
    fresh = NativeClient(auth)  # a new connection proves the new secret
    try:
        assert read(fresh, server, ranges, grant_for(auth, ranges, epoch="epoch-2")) == [segment[:4096].tobytes()]
    finally:
        fresh.close()


def test_a_stopped_server_fails_reads_at_once(auth: StoreAuth, segment: np.ndarray, client: NativeClient) -> None:
    server = NativeServer(memoryview(segment), SegmentGate(auth, SEGMENT_ID, EPOCH), "127.0.0.1")
    ranges = [(0, 64)]
    read(client, server, ranges, grant_for(auth, ranges))
    server.stop()
    server.stop()  # idempotent
    start = time.monotonic()
    with pytest.raises(NativeReadFailed) as failed:
        read(client, server, ranges, grant_for(auth, ranges))
    assert failed.value.kind == "failed" and time.monotonic() - start < 5.0


def test_a_server_bound_to_a_name_or_a_busy_port_says_why(auth: StoreAuth, server: NativeServer) -> None:
    segment = bytearray(4096)
    with pytest.raises(OSError, match="not an IP address"):
        NativeServer(memoryview(segment), SegmentGate(auth, SEGMENT_ID, EPOCH), "localhost")
    with pytest.raises(OSError, match="listener"):
        NativeServer(memoryview(segment), SegmentGate(auth, SEGMENT_ID, EPOCH), "127.0.0.1", server.port)


# -- through UcxServer / UcxClient ------------------------------------------------------------------------


def test_the_client_reads_natively_and_falls_back_to_ucxx(auth: StoreAuth, segment: np.ndarray) -> None:
    with UcxServer(segment.data, gate=SegmentGate(auth, SEGMENT_ID, EPOCH)) as server:
        assert server.fast_port is not None and server._native is not None
        native = server._native
        address = server.address
        assert address is not None
        with UcxClient(auth=auth, timeout_s=TIMEOUT_S) as client:
            small, large = [(8192, 32768)], [(0, 512 << 10)]

            def fetch(ranges: list[tuple[int, int]]) -> bytes:
                into = bytearray(ranges[0][1])
                client.read(address, ranges, [into], grant_for(auth, ranges))
                return bytes(into)

            assert fetch(small) == segment[8192:40960].tobytes()  # connects over ucxx: learns the port
            assert native.stat(STAT_SERVED) == 0
            for _ in range(2):
                assert fetch(small) == segment[8192:40960].tobytes()
            assert fetch(large) == segment[: 512 << 10].tobytes()  # by rendezvous, into the caller's buffer
            assert native.stat(STAT_SERVED) == 3  # every read since: native
            # More ranges than a native read carries: ucxx, into buffers scattered over the segment's bytes.
            many = [(offset, 16) for offset in range(0, 16 * 1100, 16)]
            dests = [bytearray(16) for _ in many]
            client.read(address, many, dests, grant_for(auth, many))
            assert b"".join(dests) == segment[: 16 * 1100].tobytes() and native.stat(STAT_SERVED) == 3
            assert fetch(small) == segment[8192:40960].tobytes() and native.stat(STAT_SERVED) == 4  # still native
            with pytest.raises(TransportError, match=r"refused by the server: .*not granted"):
                client.read(address, small, [bytearray(32768)], grant_for(auth, [(0, 32768)]))
            # A grant past what a native read carries (the master's covers a whole lookup): ucxx reads it.
            wide = grant_for(auth, [(offset, 16) for offset in range(1 << 20, (1 << 20) + 16 * 2000, 16)] + small)
            into = bytearray(32768)
            client.read(address, small, [into], wide)
            assert bytes(into) == segment[8192:40960].tobytes() and native.stat(STAT_SERVED) == 4
            assert fetch(small) == segment[8192:40960].tobytes() and native.stat(STAT_SERVED) == 5  # still native
            native.stop()  # its native reader gone, the segment still served over ucxx
            assert fetch(small) == segment[8192:40960].tobytes()
            assert fetch(small) == segment[8192:40960].tobytes()


def test_without_the_library_every_read_takes_ucxx(
    auth: StoreAuth, segment: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAYTURN_KV_NATIVE", "0")
    ucx_native.library.cache_clear()
    try:
        assert ucx_native.library() is None
        assert "RAYTURN_KV_NATIVE" in (ucx_native.unavailable_reason() or "")
        with UcxServer(segment.data, gate=SegmentGate(auth, SEGMENT_ID, EPOCH)) as server:
            assert server.fast_port is None
            address = server.address
            assert address is not None
            with UcxClient(auth=auth, timeout_s=TIMEOUT_S) as client:
                for _ in range(2):
                    into = bytearray(64)
                    client.read(address, [(0, 64)], [into], grant_for(auth, [(0, 64)]))
                    assert bytes(into) == segment[:64].tobytes()
    finally:
        monkeypatch.delenv("RAYTURN_KV_NATIVE")
        ucx_native.library.cache_clear()
    assert ucx_native.library() is not None


def test_a_read_waiting_behind_a_busy_native_client_takes_ucxx(auth: StoreAuth, segment: np.ndarray) -> None:
    """Another thread's native read holding the client (a slow owner) sends this one the ucxx way after
    ``BUSY_WAIT_S``, instead of holding it up until that read times out."""
    with UcxServer(segment.data, gate=SegmentGate(auth, SEGMENT_ID, EPOCH)) as server:
        native, address = server._native, server.address
        assert native is not None and address is not None
        with UcxClient(auth=auth, timeout_s=TIMEOUT_S) as client:
            ranges = [(0, 4096)]
            for _ in range(2):  # the first connects over ucxx, the second is native
                client.read(address, ranges, [bytearray(4096)], grant_for(auth, ranges))
            assert native.stat(STAT_SERVED) == 1
            native_client = client._native._client
            assert native_client is not None
            with native_client._lock:  # as a read stuck on another owner would
                start = time.monotonic()
                into = bytearray(4096)
                client.read(address, ranges, [into], grant_for(auth, ranges))
                assert bytes(into) == segment[:4096].tobytes() and time.monotonic() - start < 2.0
            assert native.stat(STAT_SERVED) == 1  # it went through ucxx
            client.read(address, ranges, [bytearray(4096)], grant_for(auth, ranges))
            assert native.stat(STAT_SERVED) == 2  # and the next one natively again


SERVE_NATIVE = f"""
import sys
import numpy as np
from rayturn.kvstore.access import SegmentGate, StoreAuth
from rayturn.kvstore.ucx_native import NativeServer
segment = (np.arange({SEGMENT_BYTES}) % 251).astype(np.uint8)
served = NativeServer(memoryview(segment), SegmentGate(StoreAuth({SECRET!r}), {SEGMENT_ID!r}, {EPOCH!r}), "127.0.0.1")
print(served.port, flush=True)
sys.stdin.read()
served.stop()
"""
"""A native reader in a process of its own (for SIGSTOP): a segment of byte i % 251 at offset i; stops at EOF."""


@contextmanager
def owner_process(script: str) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """``script`` (``SERVE_NATIVE`` or ``SERVE_UCX``) in a process of its own, and the port it printed; once the
    ``with`` block is done, told to stop (EOF) and checked to have ended cleanly, killed if it did not."""
    process = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stdin is not None
        yield process, int(process.stdout.readline())
        process.stdin.close()
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def test_an_owner_that_stops_answering_times_the_read_out_and_recovers(auth: StoreAuth, client: NativeClient) -> None:
    with owner_process(SERVE_NATIVE) as (process, port):
        ranges = [(1000, 64)]
        expected = (np.arange(1000, 1064) % 251).astype(np.uint8).tobytes()
        into = bytearray(64)
        client.read("127.0.0.1", port, ranges, grant_for(auth, ranges), [memoryview(into)], TIMEOUT_S)
        assert bytes(into) == expected
        stop_process(process.pid)
        try:
            start = time.monotonic()
            with pytest.raises(NativeReadFailed) as stalled:
                client.read("127.0.0.1", port, ranges, grant_for(auth, ranges), [memoryview(bytearray(64))], 0.5)
            assert stalled.value.kind == "timeout" and 0.4 < time.monotonic() - start < 3.0
        finally:
            process.send_signal(signal.SIGCONT)
        into = bytearray(64)  # the timed-out connection was dropped: this one connects again
        client.read("127.0.0.1", port, ranges, grant_for(auth, ranges), [memoryview(into)], TIMEOUT_S)
        assert bytes(into) == expected


SERVE_UCX = f"""
import sys
import numpy as np
from rayturn.kvstore.access import SegmentGate, StoreAuth
from rayturn.kvstore.ucx_transport import UcxServer
segment = (np.arange({SEGMENT_BYTES}) % 251).astype(np.uint8)
with UcxServer(segment.data, gate=SegmentGate(StoreAuth({SECRET!r}), {SEGMENT_ID!r}, {EPOCH!r})) as server:
    assert server.fast_port is not None
    print(server.address[1], flush=True)
    sys.stdin.read()
"""
"""A segment's UcxServer, its native reader beside it, in a process of its own (for SIGSTOP); stops at EOF."""


def test_a_stopped_owner_costs_a_ucx_client_one_timeout_not_two(auth: StoreAuth) -> None:
    """The client knows the owner's native port but has no native connection yet when the owner stops: the
    native handshake gets no answer within the read's time, and the read ends there, a timeout, instead of
    trying the ucxx path for as long again."""
    with owner_process(SERVE_UCX) as (process, port):
        address = ("127.0.0.1", port)
        ranges = [(1000, 64)]
        expected = (np.arange(1000, 1064) % 251).astype(np.uint8).tobytes()
        with UcxClient(auth=auth, timeout_s=TIMEOUT_S) as client:
            into = bytearray(64)
            client.read(address, ranges, [into], grant_for(auth, ranges))  # over ucxx: learns the native port
            assert bytes(into) == expected
            stop_process(process.pid)
            try:
                start = time.monotonic()
                with pytest.raises(PeerTimedOut):
                    client.read(address, ranges, [bytearray(64)], grant_for(auth, ranges), timeout_s=2.0)
                assert time.monotonic() - start < 3.5  # one 2 s timeout (the two in a row took 4 s)
            finally:
                process.send_signal(signal.SIGCONT)
            into = bytearray(64)
            client.read(address, ranges, [into], grant_for(auth, ranges))  # back, and read again
            assert bytes(into) == expected

"""Reads served and waited for in native code: ``ucx_native.c``, over UCX, with no Python in between.

A one-page read through ucxx costs ~0.5 ms before the store does anything: ucxx's progress thread,
its notifier and the asyncio loop on both ends. The same read with UCP's callbacks in C, the
grant checked there, and the reader polling its own worker takes a fraction of that. So every
segment's :class:`~rayturn.kvstore.ucx_server.UcxServer` also runs a :class:`NativeServer` on the
same host (its own thread and UCP worker, bound to the advertised address, on a port of its own
that the ucxx handshake tells each client), and :class:`~rayturn.kvstore.ucx_client.UcxClient`
sends its reads there once it knows the port: the pages go straight from the segment into the
caller's buffers (UCX's rendezvous for large ones), with no staging copy on either side. Writes,
reads of more than ``MAX_RANGES`` ranges and every peer without the library keep the ucxx path.

Same doors as the ucxx server: a connection proves the store secret (the same challenge-response,
:mod:`rayturn.kvstore.access`) before any read, every read carries the master's grant (checked in C
exactly as ``SegmentGate.check_read``: signature, segment, epoch, expiry, every range granted,
every range inside the segment), at most 64 connections wait unproven and none for more than
``HANDSHAKE_TIMEOUT_S``. UCX lets a sender name the endpoint a message claims to come from, so
every read is also signed with its connection's session key (from the handshake's two nonces),
and a message the server cannot take as its connection's own is dropped unanswered.

The library is built once per host with the system C compiler against the UCX headers of the
``libucx`` wheel ucxx runs on, and cached under ``$RAYTURN_CACHE_DIR/native`` (default
``~/.cache/rayturn/native``), keyed by the source, compiler and UCX build, and loaded only from a
folder and a file that are this user's alone (``rayturn.native_build``). Without a compiler, or
with ``RAYTURN_KV_NATIVE=0``, ``library()`` is None and every read takes the ucxx path.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import itertools
import logging
import os
import struct
import subprocess
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Final, Protocol

from rayturn import native_build
from rayturn.kvstore.access import ReadGrant, SegmentGate, StoreAuth
from rayturn.kvstore.ucx_errors import PeerTimedOut, TransportError
from rayturn.kvstore.ucx_runtime import in_ucx_loop_thread

__all__ = ["NativeClient", "NativeReadFailed", "NativeReads", "NativeServer", "encode_read", "library"]

logger = logging.getLogger(__name__)

SOURCE: Final = Path(__file__).with_name("ucx_native.c")
MAX_RANGES: Final = 1024
"""Most ranges (and destinations) one native read carries, and its grant covers; as in the C source."""
MAX_EPOCH_BYTES: Final = 255
"""Longest master epoch (encoded) a native read carries; as ``MAX_EPOCH`` - 1 in the C source."""
READ_OK, READ_REFUSED, READ_TIMEOUT, READ_FAILED = 0, 1, 2, 3
STAT_SERVED, STAT_REFUSED, STAT_ACCEPTED, STAT_REJECTED = 0, 1, 2, 3
_ERR_BYTES: Final = 512
BUSY_WAIT_S: Final = 0.005
"""How long a read waits for another thread's native read before it takes the ucxx path instead: one owner
that stopped answering holds up no other reader for longer."""
_unavailable: list[str] = []


class NativeReadFailed(Exception):
    """A native read did not land: ``kind`` is "refused" (the server said why), "timeout" or "failed"."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _ucx_root() -> Path:
    import libucx  # type: ignore[import-untyped]  # the wheel ucxx loads its UCX from

    return Path(libucx.__file__).parent


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The native library for this host, built on first use; None when disabled or it cannot be built."""
    if os.environ.get("RAYTURN_KV_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        _unavailable.append("turned off by RAYTURN_KV_NATIVE")
        return None
    compiler = native_build.compiler()
    try:
        if compiler is None:
            raise OSError("no C compiler found (set $CC)")
        ucx = _ucx_root()
        version = native_build.compiler_version(compiler)
        key = [SOURCE.read_text(), compiler, version, str(ucx), (ucx / "VERSION.txt").read_text()]
        args, libraries = build_flags(SOURCE)
        return _declare(native_build.load(native_build.built("native", "ucx_native", key, compiler, args, libraries)))
    except (OSError, ImportError, subprocess.SubprocessError) as error:
        _unavailable.append(f"{type(error).__name__}: {error}")
        logger.warning("native KV reads unavailable, reads take the ucxx path: %s", error)
        return None


def build_flags(source: Path) -> tuple[list[str], list[str]]:
    """The compiler's arguments and libraries for a shared library of ``source`` against the UCX ucxx loads."""
    ucx = _ucx_root()
    lib = ucx / "lib"
    args = ["-O2", "-shared", "-fPIC", f"-I{ucx / 'include'}", str(source)]
    return args, [f"-L{lib}", "-lucp", "-lucs", f"-Wl,-rpath,{lib}", "-lpthread"]


def unavailable_reason() -> str | None:
    """Why ``library()`` returned None (after it did), else None."""
    return _unavailable[-1] if _unavailable else None


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    ptr, u64, i32, text = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p
    lib.rt_server_start.argtypes = [text, i32, ptr, u64, text, text, text, ctypes.c_char_p, i32]
    lib.rt_server_start.restype = ptr
    lib.rt_server_port.argtypes = [ptr]
    lib.rt_server_port.restype = i32
    lib.rt_server_set.argtypes = [ptr, text, text, text]
    lib.rt_server_set.restype = None
    lib.rt_server_stat.argtypes = [ptr, i32]
    lib.rt_server_stat.restype = u64
    lib.rt_server_stop.argtypes = [ptr]
    lib.rt_server_stop.restype = None
    lib.rt_client_new.argtypes = [text, ctypes.c_char_p, i32]
    lib.rt_client_new.restype = ptr
    lib.rt_client_set_key.argtypes = [ptr, text]
    lib.rt_client_set_key.restype = None
    lib.rt_client_read.argtypes = [ptr, text, i32, text, u64, ptr, ptr, i32, ctypes.c_double, ctypes.c_char_p, i32]
    lib.rt_client_read.restype = i32
    lib.rt_client_close.argtypes = [ptr]
    lib.rt_client_close.restype = None
    lib.rt_hmac_sha256.argtypes = [text, text, u64, ctypes.c_char_p]
    lib.rt_hmac_sha256.restype = None
    return lib


def encode_read(ranges: Sequence[tuple[int, int]], grant: ReadGrant) -> bytes:
    """A native read's body: the requested ranges and the grant (layout in ``ucx_native.c``)."""
    epoch = grant.epoch.encode()
    return b"".join(
        (
            struct.pack(f"<I{2 * len(ranges)}q", len(ranges), *itertools.chain.from_iterable(ranges)),
            struct.pack("<I", len(grant.ranges) // 16),
            grant.ranges,
            struct.pack("<dI", grant.expires_at, len(epoch)),
            epoch,
            grant.mac,
        )
    )


class NativeServer:
    """The native reader of one segment: its own thread and UCP worker, listening on ``host``.

    ``segment`` (any writable buffer) must outlive the server; the gate's epoch and the store's keys
    follow the gate and its ``StoreAuth`` (through their ``listeners``).
    """

    def __init__(self, segment: memoryview, gate: SegmentGate, host: str, port: int = 0) -> None:
        lib = library()
        if lib is None:
            raise OSError(f"native KV reads unavailable: {unavailable_reason()}")
        self._lib = lib
        self._gate = gate
        self._segment = (ctypes.c_char * segment.nbytes).from_buffer(segment)  # pins the buffer while served
        error = ctypes.create_string_buffer(_ERR_BYTES)
        peer_key, grant_key = gate.auth.keys()
        handle = lib.rt_server_start(
            host.encode(), port, ctypes.addressof(self._segment), segment.nbytes, gate.segment_id.encode(),
            peer_key, grant_key, error, _ERR_BYTES,
        )  # fmt: skip
        if not handle:
            raise OSError(error.value.decode(errors="replace") or "native server did not start")
        self._handle: int | None = handle
        self._lock = threading.Lock()
        self.port: int = lib.rt_server_port(handle)
        gate.listeners.add(self._refresh)  # before the first refresh: no change falls between
        gate.auth.listeners.add(self._refresh)
        self._refresh()
        _running.add(self)

    def _refresh(self) -> None:
        with self._lock:
            if self._handle is not None:
                peer_key, grant_key = self._gate.auth.keys()
                self._lib.rt_server_set(self._handle, (self._gate.epoch or "").encode(), peer_key, grant_key)

    def stat(self, which: int) -> int:
        with self._lock:
            return 0 if self._handle is None else int(self._lib.rt_server_stat(self._handle, which))

    def stop(self) -> None:
        """Close every connection and join the thread (idempotent); the segment is released after."""
        with self._lock:
            handle, self._handle = self._handle, None
        if handle is None:
            return
        _running.discard(self)
        self._gate.listeners.remove(self._refresh)
        self._gate.auth.listeners.remove(self._refresh)
        self._lib.rt_server_stop(handle)
        del self._segment


_running: weakref.WeakSet[NativeServer] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """At exit, before the interpreter lets go of the segments: no server thread sends from one after."""
    for server in list(_running):
        server.stop()


class NativeClient:
    """A reader's native worker: one connection per server address, one read at a time (a lock in C)."""

    def __init__(self, auth: StoreAuth) -> None:
        lib = library()
        if lib is None:
            raise OSError(f"native KV reads unavailable: {unavailable_reason()}")
        self._lib = lib
        self._auth = auth
        self._key = auth.keys()[0]
        error = ctypes.create_string_buffer(_ERR_BYTES)
        handle = lib.rt_client_new(self._key, error, _ERR_BYTES)
        if not handle:
            raise OSError(error.value.decode(errors="replace") or "native client did not start")
        self._handle: int | None = handle
        self._lock = threading.Lock()  # a read in flight keeps the worker from being closed under it
        self._error = ctypes.create_string_buffer(_ERR_BYTES)  # used under the lock

    def read(
        self, host: str, port: int, ranges: Sequence[tuple[int, int]], grant: ReadGrant, views: Sequence[memoryview],
        timeout_s: float,
    ) -> None:  # fmt: skip
        """Land each range in the view at its index; NativeReadFailed if it did not ("busy": another thread's
        read has held the client for ``BUSY_WAIT_S``, a slow owner perhaps: this one takes the ucxx path)."""
        if not self._lock.acquire(timeout=BUSY_WAIT_S):
            raise NativeReadFailed("busy", "the native client is busy with another read")
        try:
            self._read(host, port, ranges, grant, views, timeout_s)
        finally:
            self._lock.release()

    def _read(
        self, host: str, port: int, ranges: Sequence[tuple[int, int]], grant: ReadGrant, views: Sequence[memoryview],
        timeout_s: float,
    ) -> None:  # fmt: skip
        handle = self._handle
        if handle is None:
            raise NativeReadFailed("failed", "the native client is closed")
        key = self._auth.keys()[0]
        if key != self._key:  # the master was re-created with a new secret
            self._key = key
            self._lib.rt_client_set_key(handle, key)
        count = len(views)
        pinned = [(ctypes.c_char * view.nbytes).from_buffer(view) for view in views]
        buffers = (ctypes.c_void_p * count)(*(ctypes.addressof(buffer) for buffer in pinned))
        lengths = (ctypes.c_uint64 * count)(*(view.nbytes for view in views))
        body = encode_read(ranges, grant)
        error = self._error
        status = self._lib.rt_client_read(
            handle, host.encode(), port, body, len(body), buffers, lengths, count, timeout_s, error, _ERR_BYTES
        )
        del pinned
        if status != READ_OK:
            kind = {READ_REFUSED: "refused", READ_TIMEOUT: "timeout"}.get(status, "failed")
            raise NativeReadFailed(kind, error.value.decode(errors="replace"))

    def close(self) -> None:
        with self._lock:
            handle, self._handle = self._handle, None
        if handle is not None:
            self._lib.rt_client_close(handle)


def _carried(views: Sequence[memoryview], grant: ReadGrant) -> bool:
    """Whether a native read can carry this one (the C side's limits): else the ucxx path takes it."""
    return (
        len(views) <= MAX_RANGES
        and len(grant.ranges) // 16 <= MAX_RANGES
        and len(grant.epoch.encode()) <= MAX_EPOCH_BYTES
    )


class _Connection(Protocol):
    address: tuple[str, int]
    fast_port: int | None


class NativeReads:
    """A :class:`~rayturn.kvstore.ucx_client.UcxClient` 's native reads: its client, made on the first one."""

    def __init__(self, auth: StoreAuth) -> None:
        self._auth = auth
        self._client: NativeClient | None = None
        self._lock = threading.Lock()
        self._closed = False

    def read(
        self, connection: _Connection | None, ranges: Sequence[tuple[int, int]], grant: ReadGrant,
        views: Sequence[memoryview], timeout_s: float,
    ) -> bool:  # fmt: skip
        """True once landed; False where there is no native path to the connection's server yet (its ucxx
        handshake tells the port) or it failed: the caller takes the ucxx path.

        TransportError if the server refused the read, PeerTimedOut if it did not land in time.
        """
        if connection is None or not connection.fast_port or in_ucx_loop_thread() or not _carried(views, grant):
            return False
        with self._lock:
            if self._client is None and not self._closed and library() is not None:
                try:
                    self._client = NativeClient(self._auth)
                except OSError as error:  # UCX could not make a worker here: ucxx serves this client's reads
                    logger.warning("native KV reads off for this client: %s", error)
                    self._closed = True
            client = self._client
        if client is None:
            return False
        address, port = connection.address, connection.fast_port
        started = time.monotonic()
        try:
            client.read(address[0], port, ranges, grant, views, timeout_s)
        except NativeReadFailed as error:
            if error.kind == "refused":
                raise TransportError(f"read {address} refused by the server: {error}") from None
            # A server that did not even answer the handshake within the read's time (a stopped process) has
            # left none for the ucxx path: trying there would make the caller wait the timeout twice.
            if error.kind == "timeout" or time.monotonic() - started >= timeout_s:
                raise PeerTimedOut(f"read {address} timed out after {timeout_s} s: {error}") from None
            if error.kind == "busy":
                return False
            logger.info("native read from %s:%d failed, back to the ucxx path: %s", address[0], port, error)
            connection.fast_port = None  # its native reader is gone: the ucxx path from now on
            return False
        return True

    def close(self) -> None:
        with self._lock:
            client, self._client, self._closed = self._client, None, True
        if client is not None:
            client.close()

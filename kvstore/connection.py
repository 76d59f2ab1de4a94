"""How a client reaches the master and other owners' segments: production or in-process.

``KVStoreClient`` talks to the master through a ``MasterConnection`` and to
remote segments through a ``RemoteServer`` / ``RemoteClient`` pair. In
production these are the Ray actor (``RayMaster``) and UCX
(``UcxServer``/``UcxClient``). ``LocalMaster`` and the in-process transport
run the same master code and the same client code inside one process, for
unit tests only: they never cross a process boundary.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import ray

from .access import AccessDenied, ReadGrant, SegmentGate, StoreAuth, WriteGrant
from .bytes_view import as_bytes_view
from .lookup_client import LookupClient, LookupFailed
from .master import KVMaster
from .master_lookup import LOCATING_METHODS, LOOKUP_METHODS
from .ucx_transport import PeerUnreachable, TransportError

Address = tuple[str, int]
WriteCallback = Callable[[list[bytes], list[tuple[int, int]], str], None]

MASTER_TIMEOUT_S = 2.0
"""How long a call waits for the master unless it says otherwise: the master restarts in a few seconds, and
a lookup that waits for it costs a request more than recomputing the pages does."""
# Joining the store and re-advertising a segment's objects may wait for a master that is just starting.
MEMBERSHIP_TIMEOUT_S = 30.0
# A put runs off the request's critical path: it may wait longer for the master than a lookup does.
PUT_TIMEOUT_S = 5.0
TRANSFER_TIMEOUT_S = 10.0
"""Longest a read or write of another owner's segment over UCX may take (connecting included): a batch
of pages moves in milliseconds, and an owner that stops answering must cost a miss, not a stuck worker."""


class MasterUnavailable(TransportError):
    """The master did not answer in time (it is restarting, or swamped): the call's keys count as misses."""


class MasterConnection(Protocol):
    auth: StoreAuth  # the store secret's keys: proofs for the store's sockets, grant checks for the segment

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """Run a master method and return its result."""

    def notify(self, method: str, *args: Any) -> None:
        """Run a master method without waiting for it."""

    def refresh_auth(self) -> None:
        """Fetch the store secret again (the master was re-created, perhaps with a new one)."""


class RemoteServer(Protocol):
    def start(self) -> Address: ...

    def stop(self) -> None: ...


class RemoteClient(Protocol):
    def read(
        self, address: Address, ranges: Sequence[tuple[int, int]], dests: Sequence[Any], grant: ReadGrant
    ) -> None: ...

    def write(
        self,
        address: Address,
        keys: Sequence[bytes],
        ranges: Sequence[tuple[int, int]],
        sources: Sequence[Any],
        tenant: str,
        grant: WriteGrant,
    ) -> None: ...

    def close(self) -> None: ...


class RayMaster:
    """The master actor, called through Ray; lookups through its socket (``master_lookup``) where it can."""

    def __init__(self, handle: Any, lookups: bool = True, timeout_s: float = MASTER_TIMEOUT_S) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.handle = handle
        self.timeout_s = timeout_s
        self.auth = StoreAuth(self._secret())
        self.lookup = LookupClient(self._lookup_address, self.auth) if lookups else None

    def _secret(self) -> bytes:
        secret: bytes = ray.get(self.handle.store_secret.remote(), timeout=30)
        return secret

    def refresh_auth(self) -> None:
        self.auth.update(self._secret())

    def _lookup_address(self) -> tuple[str, int] | None:
        address = ray.get(self.handle.lookup_address.remote(), timeout=self.timeout_s)
        return None if address is None else (address[0], int(address[1]))

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        if self.lookup is not None and method in LOOKUP_METHODS:
            try:
                if method in LOCATING_METHODS:
                    keys, node_id, tenant = args
                    return self.lookup.call(method, keys, tenant, node_id)
                keys, tenant = args
                return self.lookup.call(method, keys, tenant)
            except LookupFailed:
                pass  # answered through Ray below
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            return ray.get(getattr(self.handle, method).remote(*args), timeout=wait_s)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as err:
            # A restarting master runs the call once it is back (tasks are retried): a late put_start's
            # placements are reclaimed after the put timeout, a late lease simply ends.
            raise MasterUnavailable(f"the kv master did not answer {method} within {wait_s} s: {err}") from err

    def notify(self, method: str, *args: Any) -> None:
        getattr(self.handle, method).remote(*args)


class LocalMaster:
    """A ``KVMaster`` on a private event loop thread of this process (unit tests)."""

    def __init__(self, master: KVMaster | None = None) -> None:
        self.master = master or KVMaster()
        self.auth = StoreAuth(self.master.secret)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kv-local-master", daemon=True)
        self._thread.start()

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        coroutine = getattr(self.master, method)(*args)
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

    def notify(self, method: str, *args: Any) -> None:
        asyncio.run_coroutine_threadsafe(getattr(self.master, method)(*args), self._loop)

    def refresh_auth(self) -> None:
        self.auth.update(self.master.secret)

    def close(self) -> None:
        """Cancel the master's housekeeping and stop the loop thread."""
        asyncio.run_coroutine_threadsafe(_cancel_other_tasks(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()


async def _cancel_other_tasks() -> None:
    for task in asyncio.all_tasks():
        if task is not asyncio.current_task():
            task.cancel()


_in_process_servers: dict[Address, InProcessServer] = {}
_ports = itertools.count(1)


class InProcessServer:
    """Serves a segment buffer to ``InProcessClient`` in the same process (unit tests), with the UCX server's
    grant checks (``SegmentGate``)."""

    def __init__(self, buffer: memoryview, *, gate: SegmentGate, on_write: WriteCallback | None = None) -> None:
        self.array: np.ndarray = np.frombuffer(buffer, dtype=np.uint8)
        self.gate = gate
        self.on_write = on_write
        self.address: Address | None = None

    def start(self) -> Address:
        self.address = ("in-process", next(_ports))
        _in_process_servers[self.address] = self
        return self.address

    def stop(self) -> None:
        if self.address is not None:
            _in_process_servers.pop(self.address, None)
        self.array = np.empty(0, dtype=np.uint8)  # release the segment's memory

    def check(self, ranges: Sequence[tuple[int, int]]) -> None:
        for index, (offset, length) in enumerate(ranges):
            if offset < 0 or length <= 0 or offset + length > self.array.size:
                raise TransportError(f"range {index} ({offset}, {length}) lies beyond the segment")


class InProcessClient:
    """Reads and writes ``InProcessServer`` segments by address, with the UCX client's checks."""

    def read(self, address: Address, ranges: Sequence[tuple[int, int]], dests: Sequence[Any], grant: ReadGrant) -> None:
        server = _server_at(address)
        server.check(ranges)
        _gate(lambda: server.gate.check_read(grant, ranges))
        for (offset, length), dest in zip(ranges, dests):
            target = np.frombuffer(dest, dtype=np.uint8) if not isinstance(dest, np.ndarray) else dest.view(np.uint8)
            if target.nbytes != length:
                raise ValueError(f"destination holds {target.nbytes} bytes but the range has {length}")
            np.copyto(target.reshape(-1), server.array[offset : offset + length])

    def write(
        self,
        address: Address,
        keys: Sequence[bytes],
        ranges: Sequence[tuple[int, int]],
        sources: Sequence[Any],
        tenant: str,
        grant: WriteGrant,
    ) -> None:
        server = _server_at(address)
        server.check(ranges)
        _gate(lambda: server.gate.check_write(tenant, grant, keys, ranges))
        for (offset, length), source in zip(ranges, sources):
            data = np.frombuffer(as_bytes_view(source), dtype=np.uint8)
            if data.nbytes != length:
                raise ValueError(f"source holds {data.nbytes} bytes but the range has {length}")
            server.array[offset : offset + length] = data
        if server.on_write is not None:
            server.on_write(list(keys), list(ranges), tenant)

    def close(self) -> None:
        pass


def _gate(check: Callable[[], None]) -> None:
    try:
        check()
    except AccessDenied as err:  # what a UCX client sees: the server refused the request
        raise TransportError(f"refused by the server: {err}") from err


def _server_at(address: Address) -> InProcessServer:
    server = _in_process_servers.get(tuple(address))  # type: ignore[arg-type]
    if server is None:
        raise PeerUnreachable(f"no in-process server at {address}")
    return server

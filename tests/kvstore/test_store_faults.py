"""The KV store under faults, with real Ray actors, real shared memory and real UCX; faults are real kills.

A segment owner killed (its replicated pages served from the other copy, its
lost pages misses), the master killed and restarted under load (calls degrade
to misses, never errors; owners re-advertise what they hold), an offset reused
behind a stale snapshot (never another page's bytes), an owner that stops
answering (SIGSTOP: bounded timeouts, no stuck reader), and a rogue peer's
garbage on an owner's UCX port (refused, the owner keeps serving).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from rayturn.kvstore import KVStoreClient, MasterConfig, start_master, wire  # noqa: E402
from rayturn.kvstore.access import StoreAuth  # noqa: E402
from rayturn.kvstore.ucx_client import _ClientConnection  # noqa: E402
from rayturn.kvstore.ucx_framing import (  # noqa: E402
    CONTROL_HEADER,
    CONTROL_MAGIC,
    CONTROL_VERSION,
    FLAG_BODY_FOLLOWS,
    Channel,
    abort_endpoint,
)
from rayturn.kvstore.ucx_runtime import load_ucxx, run_in_ucx_loop  # noqa: E402

PAGE = 32 << 10
SEGMENT = 4 << 20
CONFIG = MasterConfig(heartbeat_timeout_s=3.0)


@pytest.fixture(scope="module", autouse=True)
def ray_session() -> Iterator[None]:
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="kvstore-faults")
    yield
    ray.shutdown()


@ray.remote(num_cpus=0.1)
class Owner:
    """A store member in its own process: a segment, its UCX server, a client."""

    def __init__(self, master_name: str, transport: str = "auto") -> None:
        self.client = KVStoreClient.connect(
            master_name, SEGMENT, transport=transport, heartbeat_interval_s=0.5, page_bytes=PAGE
        )

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.client, method)(*args, **kwargs)

    def pid(self) -> int:
        return os.getpid()

    def held(self) -> dict[bytes, int]:
        """Key -> offset of what this owner's segment holds."""
        return {key: offset for key, _, offset, _ in self.client.held.items()}

    def ucx_address(self) -> tuple[str, int]:
        return self.client.ucx_address

    def churn(self, prefix: str, duration_s: float) -> dict[str, Any]:
        """Puts of pages (64 keys in turn, well under the segment's watermark) and gets of stored ones for
        ``duration_s``; what each call came to."""
        counts = {"sent": 0, "completed": 0, "failed_cleanly": 0, "wrong": 0, "errors": 0}
        stored: dict[bytes, bytes] = {}
        deadline = time.monotonic() + duration_s
        round_index = 0
        while time.monotonic() < deadline:
            keys = [f"{prefix}-{round_index % 16}-{i}".encode() for i in range(4)]
            values = [page((round_index % 16) * 4 + i) for i in range(4)]
            recent = list(stored)[-8:]
            counts["sent"] += 2
            try:
                done = self.client.put_batch(keys, values)
                got = self.client.get_batch(recent)
            except Exception:
                counts["errors"] += 1
                continue
            stored.update((key, value) for key, value, ok in zip(keys, values, done) if ok)
            counts["completed" if all(done) else "failed_cleanly"] += 1
            if any(value is not None and value != stored[key] for key, value in zip(recent, got)):
                counts["wrong"] += 1
            else:
                counts["completed" if None not in got else "failed_cleanly"] += 1
            round_index += 1
        counts["stored_keys"] = list(stored)
        return counts


def page(seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, PAGE, dtype=np.uint8).tobytes()


def keys_for(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(n)]


def until(predicate: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.2)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def started(master_name: str, *transports: str, **master_options: Any) -> tuple[Any, list[Any]]:
    master = start_master(master_name, config=CONFIG, **master_options)
    owners = [Owner.remote(master_name, transport) for transport in transports]
    ray.get([owner.pid.remote() for owner in owners])
    return master, owners


@pytest.mark.parametrize("transport", ["auto", "ucx"])
def test_a_killed_owners_replicated_pages_come_from_the_other_copy(transport: str) -> None:
    _, (owner, _other, reader) = started(f"kv-owner-killed-{transport}", transport, transport, transport)
    twice, once = keys_for("twice", 8), keys_for("once", 4)
    assert ray.get(owner.call.remote("put_batch", twice, [page(i) for i in range(8)], replicas=2)) == [True] * 8
    assert ray.get(owner.call.remote("put_batch", once, [page(10 + i) for i in range(4)])) == [True] * 4
    pid = ray.get(owner.pid.remote())
    os.kill(pid, signal.SIGKILL)
    until(lambda: not _running(pid))  # reaped: a same-node reader now sees the owner gone
    assert ray.get(reader.call.remote("get_batch", twice)) == [page(i) for i in range(8)]
    assert ray.get(reader.call.remote("get_batch", once)) == [None] * 4  # lost: recomputed by the caller
    until(lambda: ray.get(reader.call.remote("exists", twice + once)) == [True] * 8 + [False] * 4)
    assert ray.get(reader.call.remote("stats"))["client"]["wrong_pages"] == 0


def test_an_offset_reused_behind_a_stale_snapshot_never_hands_out_another_pages_bytes(tmp_path: Any) -> None:
    master, (writer, reader) = started(
        "kv-reused-offset", "auto", "auto", snapshot_dir=str(tmp_path), snapshot_interval_s=3600.0
    )
    assert ray.get(writer.call.remote("put", b"old", page(1)))
    old_offset = ray.get(writer.held.remote())[b"old"]
    assert ray.get(master.snapshot_now.remote())  # the snapshot the master will restart from
    assert ray.get(writer.call.remote("remove", [b"old"])) == 1
    assert ray.get(writer.call.remote("put", b"new", page(2)))
    assert ray.get(writer.held.remote()) == {b"new": old_offset}  # "new" took "old"'s place
    epoch = ray.get(master.ready.remote())
    ray.kill(master, no_restart=False)
    until(lambda: _epoch_changed(master, epoch), timeout_s=60)
    seen: list[list[bytes | None]] = []

    def served() -> bool:
        seen.append(ray.get(reader.call.remote("get_batch", [b"old", b"new"])))
        return seen[-1] == [None, page(2)]

    until(served)
    assert all(old != page(2) for old, _ in seen)  # "old" was never answered with "new"'s bytes


def test_the_master_killed_under_load_costs_misses_not_errors_and_its_keys_come_back() -> None:
    master, (worker, reader) = started("kv-master-killed", "auto", "auto")
    before = keys_for("before", 8)
    assert ray.get(worker.call.remote("put_batch", before, [page(100 + i) for i in range(8)])) == [True] * 8
    epoch = ray.get(master.ready.remote())
    load = worker.churn.remote("load", 6.0)
    time.sleep(2.0)
    ray.kill(master, no_restart=False)  # no snapshot: only the owners can bring the keys back
    counts = ray.get(load)
    assert counts["errors"] == 0 and counts["wrong"] == 0
    assert counts["completed"] + counts["failed_cleanly"] == counts["sent"]
    assert _epoch_changed(master, epoch)
    stored = counts["stored_keys"]
    until(lambda: ray.get(reader.call.remote("exists", before + stored)) == [True] * (8 + len(stored)))
    assert ray.get(reader.call.remote("get_batch", before)) == [page(100 + i) for i in range(8)]


def _epoch_changed(master: Any, old_epoch: str) -> bool:
    try:
        return bool(ray.get(master.ready.remote(), timeout=5) != old_epoch)
    except Exception:
        return False


def test_an_owner_that_stops_answering_costs_a_miss_not_a_stuck_reader() -> None:
    _, (owner, other, reader) = started("kv-silent-owner", "ucx", "ucx", "ucx")
    twice, once, elsewhere = keys_for("twice", 4), keys_for("once", 4), keys_for("elsewhere", 4)
    assert ray.get(owner.call.remote("put_batch", twice, [page(i) for i in range(4)], replicas=2)) == [True] * 4
    assert ray.get(owner.call.remote("put_batch", once, [page(10 + i) for i in range(4)])) == [True] * 4
    assert ray.get(other.call.remote("put_batch", elsewhere, [page(20 + i) for i in range(4)])) == [True] * 4
    assert ray.get(reader.call.remote("get_batch", once)) == [page(10 + i) for i in range(4)]  # connected
    from proc_threads import stop_process  # here: the module is imported by Ray's workers too, without tests/kvstore

    pid = ray.get(owner.pid.remote())
    stop_process(pid)
    try:
        # The open connection and any new one both stop answering: each read gives up in bounded time.
        assert ray.get(reader.call.remote("get_batch", once), timeout=60) == [None] * 4
        assert ray.get(reader.call.remote("get_batch", twice), timeout=60) == [page(i) for i in range(4)]
        assert ray.get(reader.call.remote("get_batch", elsewhere), timeout=60) == [page(20 + i) for i in range(4)]
    finally:
        os.kill(pid, signal.SIGCONT)
    # Back: it registers again, re-advertises, and serves.
    until(lambda: ray.get(reader.call.remote("get_batch", once)) == [page(10 + i) for i in range(4)], timeout_s=60)
    assert ray.get(owner.call.remote("put", b"after", page(30)))
    assert ray.get(reader.call.remote("get", b"after")) == page(30)


def _frame(body: bytes, flags: int = 0, announced_bytes: int | None = None) -> bytes:
    size = len(body) if announced_bytes is None else announced_bytes
    return CONTROL_HEADER.pack(CONTROL_MAGIC, CONTROL_VERSION, flags, size) + body


GARBAGE = {
    "random bytes": np.random.default_rng(0).integers(0, 256, 300, dtype=np.uint8).tobytes(),
    "not msgpack": _frame(b"\xc1\xc1\xc1 not msgpack"),
    "a list, not a map": _frame(b"\x93\x01\x02\x03"),
    "unknown type": _frame(wire.encode({"type": "challenge", "nonce": bytes(32)}).replace(b"challenge", b"chaLLenge")),
    "huge announced body": _frame(b"", FLAG_BODY_FOLLOWS, 1 << 40),
    "truncated header": CONTROL_HEADER.pack(CONTROL_MAGIC, CONTROL_VERSION, 0, 10)[:7],
    "forged read grant": _frame(
        wire.encode(
            {"type": "read_request", "request_id": 1, "ranges": [[0, PAGE]], "grant": ["x", 0.0, b"", bytes(32)]}
        )
    ),
    "write with an empty grant": _frame(
        wire.encode(
            {
                "type": "write_request",
                "request_id": 3,
                "ranges": [[0, PAGE]],
                "keys": [b"k"],
                "tenant": "t",
                "grant": [],
            }
        )
    ),
}


async def _send_garbage(address: tuple[str, int], auth: StoreAuth | None, garbage: bytes) -> dict[str, Any] | None:
    """Send ``garbage`` on a new connection, as a member (``auth``) or as a stranger who ignores the challenge;
    the owner's reply, or None if it hung up without one."""
    if auth is None:
        channel = Channel(await load_ucxx().create_endpoint(*address, connect_timeout=5.0))
        await channel.recv_control(expected_type="challenge")
    else:
        channel = await _ClientConnection(address, 5.0, auth)._connect()
    try:
        await channel.endpoint.send(garbage)
        return await asyncio.wait_for(channel.recv_control(expected_type="reply"), 5.0)
    except Exception:
        return None
    finally:
        abort_endpoint(channel.endpoint)


def test_a_rogue_peers_garbage_is_refused_and_the_owner_keeps_serving() -> None:
    master, (owner, reader) = started("kv-rogue-peer", "ucx", "ucx")
    assert ray.get(owner.call.remote("put", b"legit", page(40)))
    pid = ray.get(owner.pid.remote())
    address = tuple(ray.get(owner.ucx_address.remote()))
    auth = StoreAuth(ray.get(master.store_secret.remote()))
    # Even a member's request, with the master's own signature, may not reach past the segment.
    segment_id = ray.get(owner.call.remote("stats"))["client"]["segment_id"]
    past_the_end = np.array([[SEGMENT, PAGE]])
    grant = auth.read_grant(segment_id, ray.get(master.ready.remote()), past_the_end, 60.0)
    request = {"type": "read_request", "request_id": 2, "ranges": past_the_end.tolist(), "grant": grant.to_wire()}
    garbage = {**GARBAGE, "range past the segment": _frame(wire.encode(request))}
    replies = {
        (name, member is not None): run_in_ucx_loop(_send_garbage(address, member, message), timeout_s=30)
        for name, message in garbage.items()
        for member in (None, auth)
    }
    for (name, as_member), reply in replies.items():
        if reply is not None:  # refused in so many words, or hung up on: never served
            assert reply["ok"] is False, (name, reply)
            assert as_member or "authentication refused" in reply["error"], (name, reply)
    assert "malformed request" in replies[("not msgpack", True)]["error"]
    assert "read refused" in replies[("forged read grant", True)]["error"]
    assert "beyond the" in replies[("range past the segment", True)]["error"]
    assert ray.get(owner.pid.remote()) == pid
    assert ray.get(reader.call.remote("get", b"legit")) == page(40)
    assert ray.get(owner.call.remote("put", b"legit-after", page(41)))
    assert ray.get(reader.call.remote("get", b"legit-after")) == page(41)

"""Who may talk to the store's sockets, and which bytes of a segment a request may touch.

Two listeners of the store sit outside Ray: the master's lookup socket and
every segment's UCX server. Both serve the store's members only, and each
request touches only what the master handed out for it.

**The store secret.** 32 random bytes, made when the master is first
created and kept across its restarts (Ray restarts an actor with its
constructor arguments). Members fetch it through Ray (``KVMaster.
store_secret``), so exactly the processes that may call the cluster's
actors have it (with Ray's token authentication, those holding Ray's token).
It never travels on the store's own sockets: they carry proofs of it.

**Both ends prove the secret on connect** (challenge-response over two
fresh nonces: a proof sniffed on one connection is worthless on another, and
a stranger on a member's port cannot pass for the member)::

    server --challenge {nonce: S}------------------------> client
    server <--auth {nonce: C, proof: HMAC(peer key, "client" S C)}-- client
    server --ok {proof: HMAC(peer key, "server" S C)}----> client   (requests follow)
           --refusal, hang up------------------------------->      (wrong proof, or none in time)

**Grants** say which ranges of a segment a request may touch. The master
signs them with the grant key when it hands out locations (reads: the
ranges of the objects it just leased to the reader) or places a put
(writes: the ranges it allocated, with the keys and tenant they are for);
the segment's owner checks the signature, the segment id, the master's epoch
(a grant from before a master restart is refused once the owner has
registered with the new one), the expiry, and that every requested range is
granted, without asking the master. A grant lives half the master's lease
(reads) or put timeout (writes), and the master keeps a leased or revoked
range from other objects at least that long.

What grants guard against is a request that is stale or misdirected: a
member still reading after its lease, writing after its put was revoked, or
aiming at the wrong segment. They do not make members distrust each other:
every member holds the secret and could sign a grant itself, and asks the
master for pages in the name of the call's tenant. A member is trusted; a
stranger is not let in.

What this does not do: encrypt. Bytes on the wire can be read by whoever
can watch the network; keep the store's traffic on the cluster's network
(or an encrypted overlay). Readers on the same node copy straight out of an
owner's shared memory, which the operating system gives to the owner's own
user only.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import secrets
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

SECRET_BYTES = 32
NONCE_BYTES = 32
PROOF_BYTES = 32
HANDSHAKE_TIMEOUT_S = 5.0
"""How long a new connection may take to prove the store secret."""
_EXPIRY = struct.Struct("<d")
_RANGE = struct.Struct("<qq")


class AccessDenied(PermissionError):
    """A peer failed authentication, or a request asked for ranges its grant does not cover."""


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def _derive(secret: bytes, purpose: bytes) -> bytes:
    return hmac.new(secret, b"rayturn-kv/" + purpose, hashlib.sha256).digest()


def _length_prefixed(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


@dataclass(frozen=True, slots=True)
class ReadGrant:
    """Reads of ``ranges`` (int64 ``[n, 2]`` offset, length, sorted by offset) of one segment, issued by the
    master in ``epoch``, until ``expires_at`` (wall clock seconds)."""

    epoch: str
    expires_at: float
    ranges: bytes
    mac: bytes

    def to_wire(self) -> list[object]:
        return [self.epoch, self.expires_at, self.ranges, self.mac]

    @classmethod
    def from_wire(cls, value: object) -> ReadGrant:
        epoch, expires_at, ranges, mac = _wire_fields(value, 4, "read grant")
        if not isinstance(ranges, bytes) or len(ranges) % _RANGE.size:
            raise AccessDenied("read grant ranges are malformed")
        return cls(epoch, expires_at, ranges, _mac_field(mac))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class WriteGrant:
    """Writes of the keys and ranges the master (in ``epoch``) placed on one segment, for one tenant, until
    ``expires_at``."""

    epoch: str
    expires_at: float
    mac: bytes

    def to_wire(self) -> list[object]:
        return [self.epoch, self.expires_at, self.mac]

    @classmethod
    def from_wire(cls, value: object) -> WriteGrant:
        epoch, expires_at, mac = _wire_fields(value, 3, "write grant")
        return cls(epoch, expires_at, _mac_field(mac))  # type: ignore[arg-type]


def _wire_fields(value: object, count: int, what: str) -> list[object]:
    if not isinstance(value, list | tuple) or len(value) != count:
        raise AccessDenied(f"{what} is malformed")
    epoch, expires_at = value[0], value[1]
    if not isinstance(epoch, str) or isinstance(expires_at, bool) or not isinstance(expires_at, int | float):
        raise AccessDenied(f"{what} is malformed")
    return [epoch, float(expires_at), *value[2:]]


def _mac_field(mac: object) -> bytes:
    if not isinstance(mac, bytes) or len(mac) != PROOF_BYTES:
        raise AccessDenied("grant signature is malformed")
    return mac


def sorted_ranges(ranges: np.ndarray) -> bytes:
    """int64 ``[n, 2]`` (offset, length) rows sorted by offset, one per offset, as bytes: a read grant's coverage.

    One offset of a segment holds one object at a time, so rows with the same offset are the same range
    (a key asked for twice).
    """
    rows = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
    rows = rows[np.argsort(rows[:, 0], kind="stable")]
    if len(rows) > 1:
        rows = rows[np.concatenate(([True], rows[1:, 0] != rows[:-1, 0]))]
    return rows.astype("<i8").tobytes()


class Listeners:
    """Callbacks run after a change (the native reader follows the store's keys and a segment's epoch so)."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[[], None]] = []

    def add(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)

    def remove(self, callback: Callable[[], None]) -> None:
        if callback in self._callbacks:
            self._callbacks.remove(callback)

    def notify(self) -> None:
        for callback in list(self._callbacks):
            callback()


class StoreAuth:
    """The store secret's keys; ``update`` swaps them when the master was re-created with a new secret."""

    def __init__(self, secret: bytes) -> None:
        self._keys = self._derive_keys(secret)
        self.listeners = Listeners()  # told after every ``update``

    def __repr__(self) -> str:
        return "StoreAuth(<secret>)"

    @staticmethod
    def _derive_keys(secret: bytes) -> tuple[bytes, bytes]:
        if not isinstance(secret, bytes) or len(secret) < 16:
            raise ValueError("the store secret must be at least 16 bytes")
        return _derive(secret, b"peer"), _derive(secret, b"grant")

    def update(self, secret: bytes) -> None:
        self._keys = self._derive_keys(secret)  # one reference swap: readers see the old keys or the new
        self.listeners.notify()

    def keys(self) -> tuple[bytes, bytes]:
        """The peer key (handshake proofs) and the grant key (grant signatures), for the native reader."""
        return self._keys

    # -- peers (the handshake in the module docstring) ----------------------

    @staticmethod
    def challenge() -> bytes:
        return secrets.token_bytes(NONCE_BYTES)

    def _proof(self, side: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
        return hmac.new(self._keys[0], side + server_nonce + client_nonce, hashlib.sha256).digest()

    def answer(self, server_nonce: bytes) -> tuple[bytes, bytes]:
        """The client's (nonce, proof) for a server's challenge."""
        client_nonce = secrets.token_bytes(NONCE_BYTES)
        return client_nonce, self._proof(b"client", server_nonce, client_nonce)

    def check_answer(self, server_nonce: bytes, client_nonce: object, proof: object) -> bytes:
        """The server's side: AccessDenied unless the client proved the secret; the server's own proof."""
        if not isinstance(client_nonce, bytes) or len(client_nonce) != NONCE_BYTES:
            raise AccessDenied("authentication failed: the peer sent no nonce of its own")
        expected = self._proof(b"client", server_nonce, client_nonce)
        if not isinstance(proof, bytes) or not hmac.compare_digest(expected, proof):
            raise AccessDenied("authentication failed: the peer does not hold the store secret")
        return self._proof(b"server", server_nonce, client_nonce)

    def check_server(self, server_nonce: bytes, client_nonce: bytes, proof: object) -> None:
        """The client's side: AccessDenied unless the server proved the secret too."""
        expected = self._proof(b"server", server_nonce, client_nonce)
        if not isinstance(proof, bytes) or not hmac.compare_digest(expected, proof):
            raise AccessDenied("authentication failed: the server does not hold the store secret")

    # -- grants -----------------------------------------------------------

    def _sign(self, *parts: bytes) -> bytes:
        return hmac.new(self._keys[1], b"".join(_length_prefixed(part) for part in parts), hashlib.sha256).digest()

    def read_grant(self, segment_id: str, epoch: str, ranges: np.ndarray, ttl_s: float) -> ReadGrant:
        covered = sorted_ranges(ranges)
        expires_at = time.time() + ttl_s
        return ReadGrant(epoch, expires_at, covered, self._read_mac(segment_id, epoch, expires_at, covered))

    def _read_mac(self, segment_id: str, epoch: str, expires_at: float, covered: bytes) -> bytes:
        return self._sign(b"read", segment_id.encode(), epoch.encode(), _EXPIRY.pack(expires_at), covered)

    def write_grant(
        self, segment_id: str, epoch: str, tenant: str, entries: Sequence[tuple[bytes, int, int]], ttl_s: float
    ) -> WriteGrant:
        """A grant for writing each ``(key, offset, length)`` of ``entries`` on one segment."""
        expires_at = time.time() + ttl_s
        return WriteGrant(epoch, expires_at, self._write_mac(segment_id, epoch, tenant, expires_at, entries))

    def _write_mac(
        self, segment_id: str, epoch: str, tenant: str, expires_at: float, entries: Sequence[tuple[bytes, int, int]]
    ) -> bytes:
        ordered = sorted(entries, key=lambda entry: entry[1])
        body = b"".join(_RANGE.pack(offset, length) + _length_prefixed(key) for key, offset, length in ordered)
        parts = (segment_id.encode(), epoch.encode(), tenant.encode(), _EXPIRY.pack(expires_at), body)
        return self._sign(b"write", *parts)

    def check_read(self, segment_id: str, epoch: str, grant: ReadGrant, ranges: Sequence[tuple[int, int]]) -> None:
        """AccessDenied unless ``grant`` is the master's, for this segment and epoch, unexpired, and covers every
        range."""
        if not hmac.compare_digest(grant.mac, self._read_mac(segment_id, grant.epoch, grant.expires_at, grant.ranges)):
            raise AccessDenied("read refused: the grant is not the master's, or not for this segment")
        _check_fresh(grant.epoch, epoch, grant.expires_at)
        # Most requests ask for exactly what was granted, in offset order: one comparison of bytes.
        if struct.pack(f"<{2 * len(ranges)}q", *itertools.chain.from_iterable(ranges)) == grant.ranges:
            return
        covered = set(_RANGE.iter_unpack(grant.ranges))
        for index, (offset, length) in enumerate(ranges):
            if (offset, length) not in covered:
                raise AccessDenied(f"read refused: range {index} {(offset, length)} is not granted")

    def check_write(
        self,
        segment_id: str,
        epoch: str,
        tenant: str,
        grant: WriteGrant,
        keys: Sequence[bytes],
        ranges: Sequence[tuple[int, int]],
    ) -> None:
        """AccessDenied unless ``grant`` covers exactly these keys at these ranges, for this segment, epoch and
        tenant."""
        if len(keys) != len(ranges):
            raise AccessDenied(f"write refused: {len(keys)} keys for {len(ranges)} ranges")
        entries = [(key, offset, length) for key, (offset, length) in zip(keys, ranges)]
        expected = self._write_mac(segment_id, grant.epoch, tenant, grant.expires_at, entries)
        if not hmac.compare_digest(grant.mac, expected):
            raise AccessDenied("write refused: the grant does not cover these keys and ranges of this segment")
        _check_fresh(grant.epoch, epoch, grant.expires_at)


def _check_fresh(grant_epoch: str, epoch: str, expires_at: float) -> None:
    if grant_epoch != epoch:
        raise AccessDenied("refused: the grant comes from another run of the master than this segment knows")
    if time.time() > expires_at:
        raise AccessDenied(f"refused: the grant expired {time.time() - expires_at:.1f} s ago")


class SegmentGate:
    """One segment's door: the checks its server makes on every connection and request.

    ``epoch`` is the master's run this segment last registered with (None before: no grant passes).
    """

    def __init__(self, auth: StoreAuth, segment_id: str, epoch: str | None = None) -> None:
        self.auth = auth
        self.segment_id = segment_id
        self._epoch = epoch
        self.listeners = Listeners()  # told after every change of the epoch

    @property
    def epoch(self) -> str | None:
        return self._epoch

    @epoch.setter
    def epoch(self, epoch: str | None) -> None:
        self._epoch = epoch
        self.listeners.notify()

    def check_read(self, grant: ReadGrant, ranges: Sequence[tuple[int, int]]) -> None:
        self.auth.check_read(self.segment_id, self.epoch or "", grant, ranges)

    def check_write(
        self, tenant: str, grant: WriteGrant, keys: Sequence[bytes], ranges: Sequence[tuple[int, int]]
    ) -> None:
        self.auth.check_write(self.segment_id, self.epoch or "", tenant, grant, keys, ranges)


WARN_EVERY_S = 10.0
_last_warned_s: dict[str, float] = {}


def refused_peer(logger: logging.Logger, listener: str, peer: object, reason: str) -> None:
    """Log a peer a listener refused, as a warning at most every ``WARN_EVERY_S`` per listener (a scan of the
    port must not flood the log)."""
    now_s = time.monotonic()
    if now_s - _last_warned_s.get(listener, -WARN_EVERY_S) >= WARN_EVERY_S:
        _last_warned_s[listener] = now_s
        logger.warning("%s refused a peer%s: %s", listener, f" at {peer}" if peer else "", reason)

"""Who may talk to the store's sockets, and which bytes of a segment a peer may touch.

Two listeners of the store sit outside Ray: the master's lookup socket and
every segment's UCX server. Both belong to the cluster's members only, and a
member may touch only what the master handed it.

**The store secret.** 32 random bytes, made when the master is first
created and kept across its restarts (Ray restarts an actor with its
constructor arguments). Members fetch it through Ray (``KVMaster.
store_secret``), so exactly the processes that may call the cluster's
actors have it (with Ray's token authentication, those holding Ray's token).
It never travels on the store's own sockets: those carry proofs of it.

**Peers prove the secret on connect** (challenge-response: a sniffed proof
cannot be replayed on another connection)::

    server --challenge {nonce: 32 random bytes}--> client
    server <--auth {proof: HMAC(peer key, nonce)}-- client
    server --ok--> client                        (requests follow)
           --refusal, hang up-->                 (wrong proof, or none within the timeout)

**Grants** say which ranges of a segment a request may touch. The master
signs them with the grant key when it hands out locations (reads: the
ranges of the objects it just leased to the reader) or places a put
(writes: the ranges it allocated, with the keys and tenant they are for);
the segment's owner checks the signature, the segment id, the expiry and
that every requested range is granted, without asking the master. A grant
lives half the master's lease (reads) or put timeout (writes), so a range it
names cannot have been given to another object before the grant runs out,
even with node clocks half that far apart.

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
import secrets
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SECRET_BYTES = 32
NONCE_BYTES = 32
PROOF_BYTES = 32
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
    """Reads of ``ranges`` (int64 ``[n, 2]`` offset, length, sorted by offset) of one segment until ``expires_at``."""

    expires_at: float  # wall clock (time.time) seconds
    ranges: bytes
    mac: bytes

    def to_wire(self) -> list[object]:
        return [self.expires_at, self.ranges, self.mac]

    @classmethod
    def from_wire(cls, value: object) -> ReadGrant:
        expires_at, ranges, mac = _wire_fields(value, 3, "read grant")
        if not isinstance(ranges, bytes) or len(ranges) % _RANGE.size:
            raise AccessDenied("read grant ranges are malformed")
        return cls(float(expires_at), ranges, _mac_field(mac))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class WriteGrant:
    """Writes of the keys and ranges the master placed on one segment, for one tenant, until ``expires_at``."""

    expires_at: float
    mac: bytes

    def to_wire(self) -> list[object]:
        return [self.expires_at, self.mac]

    @classmethod
    def from_wire(cls, value: object) -> WriteGrant:
        expires_at, mac = _wire_fields(value, 2, "write grant")
        return cls(float(expires_at), _mac_field(mac))  # type: ignore[arg-type]


def _wire_fields(value: object, count: int, what: str) -> list[object]:
    if not isinstance(value, list | tuple) or len(value) != count:
        raise AccessDenied(f"{what} is malformed")
    if isinstance(value[0], bool) or not isinstance(value[0], int | float):
        raise AccessDenied(f"{what} expiry is malformed")
    return list(value)


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


class StoreAuth:
    """The store secret's keys; ``update`` swaps them when the master was re-created with a new secret."""

    def __init__(self, secret: bytes) -> None:
        self._lock = threading.Lock()
        self._keys = self._derive_keys(secret)

    def __repr__(self) -> str:
        return "StoreAuth(<secret>)"

    @staticmethod
    def _derive_keys(secret: bytes) -> tuple[bytes, bytes]:
        if not isinstance(secret, bytes) or len(secret) < 16:
            raise ValueError("the store secret must be at least 16 bytes")
        return _derive(secret, b"peer"), _derive(secret, b"grant")

    def update(self, secret: bytes) -> None:
        keys = self._derive_keys(secret)
        with self._lock:
            self._keys = keys

    # -- peers ------------------------------------------------------------

    @staticmethod
    def challenge() -> bytes:
        return secrets.token_bytes(NONCE_BYTES)

    def proof(self, nonce: bytes) -> bytes:
        return hmac.new(self._keys[0], b"peer/" + nonce, hashlib.sha256).digest()

    def check_proof(self, nonce: bytes, proof: object) -> None:
        if not isinstance(proof, bytes) or not hmac.compare_digest(self.proof(nonce), proof):
            raise AccessDenied("authentication failed: the peer does not hold the store secret")

    # -- grants -----------------------------------------------------------

    def _sign(self, *parts: bytes) -> bytes:
        return hmac.new(self._keys[1], b"".join(_length_prefixed(part) for part in parts), hashlib.sha256).digest()

    def read_grant(self, segment_id: str, ranges: np.ndarray, ttl_s: float) -> ReadGrant:
        covered = sorted_ranges(ranges)
        expires_at = time.time() + ttl_s
        return ReadGrant(expires_at, covered, self._read_mac(segment_id, expires_at, covered))

    def _read_mac(self, segment_id: str, expires_at: float, covered: bytes) -> bytes:
        return self._sign(b"read", segment_id.encode(), _EXPIRY.pack(expires_at), covered)

    def write_grant(
        self, segment_id: str, tenant: str, entries: Sequence[tuple[bytes, int, int]], ttl_s: float
    ) -> WriteGrant:
        """A grant for writing each ``(key, offset, length)`` of ``entries`` on one segment."""
        expires_at = time.time() + ttl_s
        return WriteGrant(expires_at, self._write_mac(segment_id, tenant, expires_at, entries))

    def _write_mac(
        self, segment_id: str, tenant: str, expires_at: float, entries: Sequence[tuple[bytes, int, int]]
    ) -> bytes:
        ordered = sorted(entries, key=lambda entry: entry[1])
        body = b"".join(_RANGE.pack(offset, length) + _length_prefixed(key) for key, offset, length in ordered)
        return self._sign(b"write", segment_id.encode(), tenant.encode(), _EXPIRY.pack(expires_at), body)

    def check_read(self, segment_id: str, grant: ReadGrant, ranges: Sequence[tuple[int, int]]) -> None:
        """AccessDenied unless ``grant`` is the master's, for this segment, unexpired, and covers every range."""
        if not hmac.compare_digest(grant.mac, self._read_mac(segment_id, grant.expires_at, grant.ranges)):
            raise AccessDenied("read refused: the grant is not the master's, or not for this segment")
        _check_expiry(grant.expires_at)
        # Most requests ask for exactly what was granted, in offset order: one comparison of bytes.
        if struct.pack(f"<{2 * len(ranges)}q", *itertools.chain.from_iterable(ranges)) == grant.ranges:
            return
        covered = set(_RANGE.iter_unpack(grant.ranges))
        for index, (offset, length) in enumerate(ranges):
            if (offset, length) not in covered:
                raise AccessDenied(f"read refused: range {index} {(offset, length)} is not granted")

    def check_write(
        self, segment_id: str, tenant: str, grant: WriteGrant, keys: Sequence[bytes], ranges: Sequence[tuple[int, int]]
    ) -> None:
        """AccessDenied unless ``grant`` covers exactly these keys at these ranges, for this segment and tenant."""
        if len(keys) != len(ranges):
            raise AccessDenied(f"write refused: {len(keys)} keys for {len(ranges)} ranges")
        entries = [(key, offset, length) for key, (offset, length) in zip(keys, ranges)]
        if not hmac.compare_digest(grant.mac, self._write_mac(segment_id, tenant, grant.expires_at, entries)):
            raise AccessDenied("write refused: the grant does not cover these keys and ranges of this segment")
        _check_expiry(grant.expires_at)


def _check_expiry(expires_at: float) -> None:
    if time.time() > expires_at:
        raise AccessDenied(f"refused: the grant expired {time.time() - expires_at:.1f} s ago")


@dataclass(frozen=True, slots=True)
class SegmentGate:
    """One segment's door: the checks its server makes on every connection and request."""

    auth: StoreAuth
    segment_id: str

    def check_read(self, grant: ReadGrant, ranges: Sequence[tuple[int, int]]) -> None:
        self.auth.check_read(self.segment_id, grant, ranges)

    def check_write(
        self, tenant: str, grant: WriteGrant, keys: Sequence[bytes], ranges: Sequence[tuple[int, int]]
    ) -> None:
        self.auth.check_write(self.segment_id, tenant, grant, keys, ranges)

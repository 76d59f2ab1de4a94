"""Value types of the KV store master: objects, replicas, segments, put plans, settings."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .access import WriteGrant
from .allocator import SegmentAllocator


class ObjectState(enum.Enum):
    PENDING = "pending"
    COMPLETE = "complete"


@dataclass(frozen=True, slots=True)
class MasterConfig:
    high_watermark: float = 0.90
    low_watermark: float = 0.80
    put_timeout_s: float = 30.0
    lease_ttl_s: float = 10.0
    heartbeat_timeout_s: float = 5.0
    tenant_quota_bytes: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            raise ValueError(
                f"watermarks must satisfy 0 < low < high <= 1, got low={self.low_watermark} high={self.high_watermark}"
            )
        for name in ("put_timeout_s", "lease_ttl_s", "heartbeat_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class Location(NamedTuple):
    """Where one replica's bytes are. A named tuple: batches of these cross Ray cheaply."""

    segment_id: str
    offset: int
    num_bytes: int


# A replica as the master keeps it: a ``Location``'s values, (segment id, offset, num_bytes), as a plain tuple.
Replica = tuple[str, int, int]


@dataclass(slots=True)
class ObjectMeta:
    tenant: str
    num_bytes: int
    state: ObjectState
    # Plain tuples of plain values: the garbage collector stops tracking them, so its full passes over a
    # million objects visit one thing per object, not three.
    replicas: tuple[Replica, ...]
    last_access_s: float
    put_deadline_s: float = 0.0
    lease_until_s: float = 0.0
    pin_until_s: float = 0.0
    hard_pinned: bool = False
    pin_ttl_on_complete_s: float | None = None
    # The identity digest of the object's bytes (None: not known): readers check what landed against it (``reader``).
    digest: int | None = None

    def evictable(self, now_s: float) -> bool:
        return (
            self.state is ObjectState.COMPLETE
            and self.lease_until_s <= now_s
            and self.pin_until_s <= now_s
            and not self.hard_pinned
        )


@dataclass(slots=True)
class SegmentInfo:
    segment_id: str
    node_id: str
    shm_name: str
    ucx_address: tuple[str, int] | None
    allocator: SegmentAllocator
    last_heartbeat_s: float
    # False for a segment restored from a snapshot until its owner registers again: before that, grants of the
    # master's previous run may still name its free ranges, so nothing new is placed there.
    confirmed: bool = True

    def public(self) -> dict[str, Any]:
        return {
            "segment_id": self.segment_id,
            "node_id": self.node_id,
            "shm_name": self.shm_name,
            "ucx_address": list(self.ucx_address) if self.ucx_address else None,
            "capacity_bytes": self.allocator.capacity_bytes,
        }


@dataclass(frozen=True, slots=True)
class PutPlan:
    """What a writer must do for one key: write ``locations``, or nothing if ``status`` says so."""

    # "write", "exists" (already stored or being stored), "no_space", "quota", "conflict" (another tenant's key)
    status: str
    locations: tuple[Location, ...] = ()


@dataclass(frozen=True, slots=True)
class PutStart:
    """The master's answer to a put's first phase: a plan per key, and per segment the write grant for the
    ranges placed on it."""

    plans: list[PutPlan]
    grants: dict[str, WriteGrant]


@dataclass(slots=True)
class Counters:
    puts: int = 0
    put_failures: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    lease_expiries: int = 0
    reclaimed_puts: int = 0


def parse_address(raw: Sequence[Any] | None) -> tuple[str, int] | None:
    """A (host, port) pair from its plain-data form (a list after msgpack or JSON)."""
    return (str(raw[0]), int(raw[1])) if raw else None


def check_keys(keys: Sequence[bytes]) -> None:
    """Store keys are non-empty bytes (the chained page hashes); ``ValueError`` naming the first that is not."""
    for i, key in enumerate(keys):
        if not isinstance(key, bytes) or not key:
            raise ValueError(f"key {i} must be non-empty bytes, got {type(key).__name__}")

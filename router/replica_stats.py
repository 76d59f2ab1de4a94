"""What a replica tells the routers: ``ReplicaStats`` (its load, the page keys it caches, the sessions it follows),
built by ``routing_report`` on the replica and read back with ``ReplicaStats.from_dict`` by every router, and
``page_hash_key``, the short form in which page hashes travel."""

from __future__ import annotations

import bisect
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# Page hashes travel as hex prefixes: 16 hex chars (64 bits) keep collisions
# among the pages of a cluster negligible and make stats messages 4x smaller.
PAGE_HASH_PREFIX_CHARS = 16

# Tokens per KV page when a replica does not say (the engine's default).
DEFAULT_PAGE_SIZE = 16

_COUNT_FIELDS = ("queued_prompt_tokens", "running_seqs", "max_num_seqs", "free_pages", "total_pages")


# ``page_hash_key`` of a hex string.
_KEY_OF_HEX = operator.itemgetter(slice(PAGE_HASH_PREFIX_CHARS))


def page_hash_key(page_hash: bytes | str) -> str:
    """The short hex form of a page hash that stats and routing hints carry."""
    text = page_hash.hex() if isinstance(page_hash, bytes) else page_hash
    return text[:PAGE_HASH_PREFIX_CHARS]


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    """What one replica reports about itself (its `record_routing_stats`)."""

    replica_id: str
    queued_prompt_tokens: int
    running_seqs: int
    max_num_seqs: int
    free_pages: int
    total_pages: int
    # Short hex prefixes (`page_hash_key`) of pages held in device memory: a
    # bounded set of the most recently used ones, not the whole cache.
    cached_page_hashes: frozenset[str]
    # The same for pages in the replica's host segment.
    host_page_hashes: frozenset[str] = frozenset()
    page_size: int = DEFAULT_PAGE_SIZE
    # `session_key` -> when the replica last saw a call of the session (epoch seconds), for the
    # sessions it follows between calls (the most recent ones).
    sessions: Mapping[str, float] = field(default_factory=dict)
    # The replica publishes the pages it computes to a KV store its pool shares, and loads from it what it
    # lacks: a page another replica holds is a load away, not a recompute.
    kv_store: bool = False
    # The values of ``sessions``, ascending: how many sessions it saw since a time is one bisection.
    session_times: tuple[float, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "session_times", tuple(sorted(self.sessions.values())))
        for name in _COUNT_FIELDS:
            if getattr(self, name) < 0:
                raise ValueError(f"ReplicaStats.{name} must be >= 0, got {getattr(self, name)}")
        if self.page_size <= 0:
            raise ValueError(f"ReplicaStats.page_size must be > 0, got {self.page_size}")

    def sessions_seen_since(self, since_s: float) -> int:
        """How many of the sessions it follows it saw a call of at ``since_s`` (epoch seconds) or later."""
        return len(self.session_times) - bisect.bisect_left(self.session_times, since_s)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], replica_id: str | None = None) -> ReplicaStats:
        """Parse a stats dict; ``replica_id`` (Serve's id) wins over the one in ``data``.

        Page hashes may be full hex digests or any iterable of them; they are
        cut to ``PAGE_HASH_PREFIX_CHARS``. Raises ValueError naming the bad key.
        """
        replica_id = replica_id if replica_id is not None else data.get("replica_id")
        if not isinstance(replica_id, str) or not replica_id:
            raise ValueError("replica stats need a non-empty string 'replica_id'")
        counts = {name: _int_field(data, name) for name in _COUNT_FIELDS}
        page_size = _int_field(data, "page_size") if "page_size" in data else DEFAULT_PAGE_SIZE
        kv_store = data.get("kv_store", False)
        if not isinstance(kv_store, bool):
            raise ValueError(f"replica stats 'kv_store' must be a bool, got {kv_store!r}")
        return cls(
            replica_id=replica_id,
            cached_page_hashes=_hash_set(data, "cached_page_hashes", required=True),
            host_page_hashes=_hash_set(data, "host_page_hashes", required=False),
            page_size=page_size,
            sessions=_session_times(data),
            kv_store=kv_store,
            **counts,
        )

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (lists, not sets) that Serve can ship and ``from_dict`` reads back."""
        return {
            "replica_id": self.replica_id,
            "queued_prompt_tokens": self.queued_prompt_tokens,
            "running_seqs": self.running_seqs,
            "max_num_seqs": self.max_num_seqs,
            "free_pages": self.free_pages,
            "total_pages": self.total_pages,
            "cached_page_hashes": sorted(self.cached_page_hashes),
            "host_page_hashes": sorted(self.host_page_hashes),
            "page_size": self.page_size,
            "sessions": dict(self.sessions),
            "kv_store": self.kv_store,
        }


# Outside Serve (tests, a replica built by hand) a replica reports under this id; Serve's own id wins.
UNSERVED_REPLICA_ID = "unserved"


def routing_report(
    engine_stats: Mapping[str, Any],
    replica_id: str | None,
    sessions: Mapping[str, float] | None = None,
    kv_store: bool = False,
) -> dict[str, Any]:
    """What a replica's ``record_routing_stats`` returns: its engine's figures (``AsyncEngine.stats``) as
    ``ReplicaStats``, in the plain form Serve ships to every router (which reads it back with ``from_dict``)."""
    stats = ReplicaStats(
        replica_id=replica_id or UNSERVED_REPLICA_ID,
        cached_page_hashes=frozenset(engine_stats["cached_page_hashes"]),
        page_size=engine_stats["page_size"],
        sessions=dict(sessions or {}),
        kv_store=kv_store,
        **{name: engine_stats[name] for name in _COUNT_FIELDS},
    )
    return stats.to_dict()


def _int_field(data: Mapping[str, Any], name: str) -> int:
    if name not in data:
        raise ValueError(f"replica stats lack {name!r}")
    value = data[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"replica stats {name!r} must be an int, got {value!r}")
    return value


def _hash_set(data: Mapping[str, Any], name: str, *, required: bool) -> frozenset[str]:
    if name not in data:
        if required:
            raise ValueError(f"replica stats lack {name!r}")
        return frozenset()
    values = data[name]
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise ValueError(f"replica stats {name!r} must be a list of hex strings")
    if not all(isinstance(value, str) for value in values):
        raise ValueError(f"replica stats {name!r} must hold only strings")
    return frozenset(map(_KEY_OF_HEX, values))  # ``page_hash_key`` of each (all strings), at C speed


def _session_times(data: Mapping[str, Any]) -> dict[str, float]:
    values = data.get("sessions", {})
    if not isinstance(values, Mapping):
        raise ValueError("replica stats 'sessions' must map session keys to epoch seconds")
    times = {}
    for key, seen_s in values.items():
        if not isinstance(key, str) or isinstance(seen_s, bool) or not isinstance(seen_s, int | float):
            raise ValueError("replica stats 'sessions' must map session keys (strings) to epoch seconds (numbers)")
        times[key[:PAGE_HASH_PREFIX_CHARS]] = float(seen_s)
    return times

"""KV store metrics, exported through Ray's metrics agent (``rayturn_kv_*``).

Clients count the bytes they move per segment and tenant, and the pages they
read by where each was: ``host`` (the client's own segment, in its process's
host memory), ``node`` (another segment on the node, shared memory) or
``remote`` (over UCX); a read's counts reach Ray at most ``FLUSH_EVERY_S`` later
(a counter update costs ~10 us, a third of a one-page UCX read). The master
publishes what only it knows on every housekeeping tick: hits, misses, evictions, lease expiries and put failures
per tenant, bytes used and capacity per segment, objects stored.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

from ray.util import metrics

_TAGS = ("segment", "tenant")
FLUSH_EVERY_S = 1.0


class KVMetrics:
    """Per-segment, per-tenant byte counters of one client (also kept as plain totals)."""

    def __init__(self, segment_id: str, tenant: str) -> None:
        self.tags = {"segment": segment_id, "tenant": tenant}
        self._lock = threading.Lock()  # the UCX server thread counts too
        self._totals = {"bytes_in": 0, "bytes_out": 0, "put_failures": 0, "wrong_pages": 0}
        self._unsent: Counter[str] = Counter()  # reads' counts not yet given to Ray: "bytes_in", or a source
        self._next_flush_s = time.monotonic() + FLUSH_EVERY_S
        self._bytes_in = metrics.Counter(
            "rayturn_kv_bytes_in_total", description="Bytes landed in KV segments or caller buffers", tag_keys=_TAGS
        )
        self._bytes_out = metrics.Counter(
            "rayturn_kv_bytes_out_total", description="Bytes sent to other workers' KV segments", tag_keys=_TAGS
        )
        self._put_failures = metrics.Counter(
            "rayturn_kv_client_put_failures_total", description="KV puts that stored nothing", tag_keys=_TAGS
        )
        self._pages_read = metrics.Counter(
            "rayturn_kv_pages_read_total",
            description="Objects (pages) read from the KV store, by where they were: host, node or remote",
            tag_keys=(*_TAGS, "source"),
        )
        self._wrong_pages = metrics.Counter(
            "rayturn_kv_wrong_pages_total",
            description="KV reads whose bytes failed the object's digest, taken as misses",
            tag_keys=_TAGS,
        )

    def bytes_in(self, num_bytes: int) -> None:
        with self._lock:
            self._totals["bytes_in"] += num_bytes
            self._unsent["bytes_in"] += num_bytes
        self._flush_when_due()

    def bytes_out(self, num_bytes: int) -> None:
        with self._lock:
            self._totals["bytes_out"] += num_bytes
        self._bytes_out.inc(num_bytes, tags=self.tags)

    def pages_read(self, source: str, num_pages: int) -> None:
        """``num_pages`` objects landed from ``source``: ``host``, ``node`` or ``remote``."""
        with self._lock:
            self._unsent[source] += num_pages
        self._flush_when_due()

    def _flush_when_due(self) -> None:
        if time.monotonic() >= self._next_flush_s:
            self.flush()

    def flush(self) -> None:
        """Give Ray the reads' counts gathered since the last flush (the client's heartbeat calls this too)."""
        with self._lock:
            unsent, self._unsent = self._unsent, Counter()
            self._next_flush_s = time.monotonic() + FLUSH_EVERY_S
        for name, count in unsent.items():
            if count and name == "bytes_in":
                self._bytes_in.inc(count, tags=self.tags)
            elif count:
                self._pages_read.inc(count, tags={**self.tags, "source": name})

    def put_failure(self) -> None:
        with self._lock:
            self._totals["put_failures"] += 1
        self._put_failures.inc(1, tags=self.tags)

    def wrong_page(self) -> None:
        """A read landed bytes that failed the object's digest (and was taken as a miss)."""
        with self._lock:
            self._totals["wrong_pages"] += 1
        self._wrong_pages.inc(1, tags=self.tags)

    def totals(self) -> dict[str, int]:
        with self._lock:
            return dict(self._totals)


class MasterMetrics:
    """Publishes the master's counters (as deltas) and per-segment gauges."""

    COUNTERS = ("hits", "misses", "evictions", "lease_expiries", "put_failures", "puts", "reclaimed_puts")

    def __init__(self) -> None:
        self._counters = {
            name: metrics.Counter(
                f"rayturn_kv_{name}_total", description=f"KV store {name.replace('_', ' ')}", tag_keys=("tenant",)
            )
            for name in self.COUNTERS
        }
        self._last: dict[tuple[str, str], int] = {}
        self._used_bytes = metrics.Gauge(
            "rayturn_kv_segment_used_bytes", description="Bytes allocated in a KV segment", tag_keys=("segment",)
        )
        self._objects = metrics.Gauge("rayturn_kv_objects_stored", description="Objects (pages) in the KV store")
        self._capacity_bytes = metrics.Gauge(
            "rayturn_kv_segment_capacity_bytes", description="Bytes a KV segment can hold", tag_keys=("segment",)
        )
        self._tenant_bytes = metrics.Gauge(
            "rayturn_kv_tenant_bytes", description="Bytes stored per tenant", tag_keys=("tenant",)
        )

    def publish(self, stats: dict[str, Any]) -> None:
        for tenant, counters in stats["tenants"].items():
            for name in self.COUNTERS:
                delta = counters[name] - self._last.get((tenant, name), 0)
                if delta > 0:
                    self._counters[name].inc(delta, tags={"tenant": tenant})
                self._last[(tenant, name)] = counters[name]
        self._objects.set(stats["complete_objects"])
        for segment_id, segment in stats["segments"].items():
            self._used_bytes.set(segment["used_bytes"], tags={"segment": segment_id})
            self._capacity_bytes.set(segment["capacity_bytes"], tags={"segment": segment_id})
        for tenant, num_bytes in stats["tenant_bytes"].items():
            self._tenant_bytes.set(num_bytes, tags={"tenant": tenant})

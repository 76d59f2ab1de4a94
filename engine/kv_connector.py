"""The engine's door to KV pages kept outside it (the distributed KV store).

The engine names pages by their chained hashes (``page_hash.py``); so does
the store. A connector moves whole pages, each one contiguous block of the
engine's cache (``[layers, 2, page_size, kv_heads, head_dim]``):

- ``longest_prefix(keys, tenant)``: how many leading pages the store holds;
- ``load(keys, pages, tenant)``: land pages straight in the engine's cache pages;
- optionally (``PrefixConnector``), ``locate_prefix(keys, tenant)`` and
  ``load_prefix(prefix, pages)``: the same two steps with one lookup, where
  the store can say how much of a prefix it holds and where in one answer;
- ``save(keys, pages, tenant)``: publish pages (a key the store has already
  counts as saved);
- ``pin(keys, ttl_s, tenant)``: keep the tenant's stored pages from eviction
  for ``ttl_s`` seconds (an earlier, longer pin stands).

``tenant`` is a sequence's ``cache_salt``, which the serving layer sets to
the caller's tenant ("" for a server without tenants: the store client's
own), followed by the call's own salt where it names one
(``page_hash.salted``). The store keeps pages under their owner, the salt's
tenant (``page_hash.salt_owner``): that tenant's quota counts them, and only
its lookups see them. A tenant's pages are invisible to every other tenant,
in the store as in the engine's own cache; a salted call's pages, hashed
with its salt, are found only by calls with the same tenant and salt.

``StoreConnector`` adapts a ``rayturn.kvstore.KVStoreClient``. On a CPU the
store reads into and writes from the cache pages themselves (no staging
copy); on an accelerator pages pass through a host staging buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from .page_hash import salt_owner


class KVConnector(Protocol):
    def longest_prefix(self, keys: Sequence[bytes], tenant: str = "") -> int: ...

    def load(self, keys: Sequence[bytes], pages: Sequence[torch.Tensor], tenant: str = "") -> list[bool]: ...

    def save(self, keys: Sequence[bytes], pages: Sequence[torch.Tensor], tenant: str = "") -> list[bool]: ...

    def pin(self, keys: Sequence[bytes], ttl_s: float, tenant: str = "") -> None: ...


class StoredPrefix(Protocol):
    """What ``locate_prefix`` found: the leading ``num_keys`` keys are held (and the connector knows where)."""

    @property
    def num_keys(self) -> int: ...


@runtime_checkable
class PrefixConnector(Protocol):
    """A connector that finds a prefix and where it is in one lookup; the engine then loads without asking again."""

    def locate_prefix(self, keys: Sequence[bytes], tenant: str = "") -> StoredPrefix: ...

    def load_prefix(self, prefix: Any, pages: Sequence[torch.Tensor]) -> list[bool]: ...


class _StoreClient(Protocol):
    """The part of ``rayturn.kvstore.KVStoreClient`` a connector uses (``tenant`` None or "": the client's own)."""

    def longest_prefix(self, keys: Sequence[bytes], tenant: str | None = None) -> int: ...

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[object], tenant: str | None = None) -> list[bool]: ...

    def locate_prefix(self, keys: Sequence[bytes], tenant: str | None = None) -> Any: ...

    def get_prefix_into(self, prefix: Any, buffers: Sequence[object]) -> list[bool]: ...

    def put_batch(
        self,
        keys: Sequence[bytes],
        values: Sequence[object],
        replicas: int = 1,
        pin_ttl_s: float | None = None,
        tenant: str | None = None,
    ) -> list[bool]: ...

    def pin(self, keys: Sequence[bytes], ttl_s: float | None, tenant: str | None = None) -> None: ...


class StoreConnector:
    """A ``KVConnector`` over the distributed KV store's client."""

    def __init__(self, client: _StoreClient, replicas: int = 1) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.client = client
        self.replicas = replicas

    def longest_prefix(self, keys: Sequence[bytes], tenant: str = "") -> int:
        return self.client.longest_prefix(keys, salt_owner(tenant)) if keys else 0

    def load(self, keys: Sequence[bytes], pages: Sequence[torch.Tensor], tenant: str = "") -> list[bool]:
        if not keys:
            return []
        return _land(pages, lambda buffers: self.client.get_into(keys, buffers, salt_owner(tenant)))

    def locate_prefix(self, keys: Sequence[bytes], tenant: str = "") -> StoredPrefix:
        """The store client's ``locate_prefix``: how many leading pages it holds, and where, in one lookup."""
        prefix: StoredPrefix = self.client.locate_prefix(keys, salt_owner(tenant))
        return prefix

    def load_prefix(self, prefix: Any, pages: Sequence[torch.Tensor]) -> list[bool]:
        """Land the first ``len(pages)`` pages of a ``locate_prefix`` answer, as ``load`` does, without a lookup."""
        if not pages:
            return []
        return _land(pages, lambda buffers: self.client.get_prefix_into(prefix, buffers))

    def save(self, keys: Sequence[bytes], pages: Sequence[torch.Tensor], tenant: str = "") -> list[bool]:
        if not keys:
            return []
        tenant = salt_owner(tenant)
        if all(page.device.type == "cpu" and page.is_contiguous() for page in pages):
            return self.client.put_batch(keys, list(pages), replicas=self.replicas, tenant=tenant)
        host = torch.stack([page.to("cpu") for page in pages])
        return self.client.put_batch(keys, list(host.unbind(0)), replicas=self.replicas, tenant=tenant)

    def pin(self, keys: Sequence[bytes], ttl_s: float, tenant: str = "") -> None:
        if keys:
            self.client.pin(keys, ttl_s, salt_owner(tenant))


def _land(pages: Sequence[torch.Tensor], read: Callable[[list[torch.Tensor]], list[bool]]) -> list[bool]:
    """``read`` into the cache pages themselves on a CPU, or through a host staging buffer."""
    if all(page.device.type == "cpu" and page.is_contiguous() for page in pages):
        return read(list(pages))
    staging = torch.empty((len(pages), *pages[0].shape), dtype=pages[0].dtype, pin_memory=_can_pin())
    landed = read(list(staging.unbind(0)))
    for page, host, ok in zip(pages, staging, landed):
        if ok:
            page.copy_(host)
    return landed


def _can_pin() -> bool:
    return torch.cuda.is_available()

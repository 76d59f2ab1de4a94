"""Page traffic between the engine's KV cache and the store behind a ``KVConnector``.

Loads happen at arrival (the prompt's pages missing here) and at a session
prewarm; saves at a sequence's finish (with asynchronous saves also once its
prompt is computed), at a session offload and when memory pressure moves a
pinned prefix (``prefix_pins.py``), whose pages the store then soft-pins.
Both move whole pages between the store and the runner's cache tensor, addressed by
their chained hashes (``page_hash.py``). The store is an optimisation: a
failed lookup, load or save is logged and only costs compute.

A page of an asynchronous save (``kv_save="async"``) goes through::

    cached, ref'd by its sequence --publish--> pinned (an extra reference)
        --saver thread writes it--> queued on ``_saved`` --next step--> released

so a decode loop never waits on the store, and a page is never reallocated
while the saver thread still reads it.
"""

from __future__ import annotations

import functools
import logging
import queue
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from .kv_cache_manager import KVCacheManager
from .kv_connector import KVConnector, PrefixConnector
from .page_hash import PageHash
from .page_pool import Page
from .page_views import PageViews
from .scheduler import ScheduledChunk
from .sequence import Sequence
from .session_holds import SessionHolds, SessionMove

logger = logging.getLogger(__name__)

KV_SAVE_MODES = ("sync", "async")
# How many page hashes the store's contents are remembered for, per page of the cache.
_STORED_MEMORY_PER_PAGE = 4
# A prewarm never takes the last free pages: this share of the pool stays free (or evictable) for arrivals.
PREWARM_FREE_FRACTION = 0.25


def check_kv_save(kv_save: str) -> None:
    if kv_save not in KV_SAVE_MODES:
        raise ValueError(f"kv_save must be 'sync' or 'async', got {kv_save!r}")


class KVTransfer:
    """Loads pages from and saves pages to one connector, for one engine's cache.

    ``reclaim_idle`` frees at least the given number of pages by releasing
    idle sessions' holds (``SessionHolds.reclaim``); returns how many it freed.
    """

    def __init__(
        self,
        connector: KVConnector,
        kv_cache: KVCacheManager,
        page_views: PageViews,
        reclaim_idle: Callable[[int], int],
        kv_save: str = "sync",
    ) -> None:
        check_kv_save(kv_save)
        self.connector = connector
        self.kv_cache = kv_cache
        self.page_size = kv_cache.page_size
        self.page_views = page_views  # one contiguous block per page, all layers
        self.reclaim_idle = reclaim_idle
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="rayturn-kv-save") if kv_save == "async" else None
        self._saved: queue.SimpleQueue[list[Page]] = queue.SimpleQueue()
        # Hashes this engine loaded from or gave to the store, least recently first (a bounded memory).
        self.stored: OrderedDict[PageHash, None] = OrderedDict()
        # A page keeps its sliding layers' window slot (window_slots.py) until the store has it whole.
        kv_cache.may_release = lambda page: page.page_hash is None or page.page_hash in self.stored

    # -- loads ------------------------------------------------------------

    def load_prefix(self, seq: Sequence, min_tokens: int) -> None:
        """Bring the pages of ``seq``'s prefix that the connector holds and this cache lacks into the cache.

        None for a sequence that scores its prompt (prompt logprobs): it computes every position.
        """
        if seq.needs_prompt_logprobs:
            return
        max_pages = (seq.num_tokens - 1) // self.page_size  # the last token is always computed
        hashes = self.kv_cache.hash_prefix(seq, max_pages * self.page_size)[:max_pages]
        # The request needs these pages now: idle sessions' holds give way, as for any allocation.
        loaded = self.load_missing(hashes, min_tokens, reclaim=True, tenant=seq.cache_salt)
        seq.num_loaded_prompt_tokens = loaded * self.page_size

    def load_missing(
        self, hashes: list[PageHash], min_tokens: int, reclaim: bool = False, keep_free: int = 0, tenant: str = ""
    ) -> int:
        """Load ``tenant``'s pages of the prefix ``hashes`` missing here from the connector; returns how many landed.

        They enter the prefix cache as free, cached pages at the tail of the
        free queue (evicted last), so admission finds them like any other hit.
        Only as many load as there are free pages (with ``reclaim``, after idle
        sessions' holds gave way; less ``keep_free``), and none when fewer than
        ``min_tokens`` tokens are missing. A failed or partial load only means
        more tokens to compute.
        """
        pool = self.kv_cache.pool
        local = pool.cached_prefix(hashes)
        missing = hashes[len(local) :]
        if not missing or len(missing) * self.page_size < min_tokens:
            return 0
        # No more than could land is looked up: a store leases what it locates (keeps it from eviction a while).
        limit = (pool.num_pages if reclaim else pool.num_allocatable) - keep_free
        if limit <= 0:
            return 0
        try:
            available, load = self._find(missing[:limit], tenant)
        except Exception as err:  # the store is an optimisation: never fail a request over it
            logger.warning("KV store lookup failed, computing instead: %s", err)
            return 0
        pool.touch(local)  # keep local hits from being evicted by the allocation below
        if reclaim and available > pool.num_allocatable:
            # Idle holds only: requests queued before this one keep their reservations.
            self.reclaim_idle(available - pool.num_allocatable)
        pages = pool.allocate(max(0, min(available, pool.num_allocatable - keep_free)))
        views = self.page_views.for_load(pages)
        try:
            landed = load(views)
        except Exception as err:
            logger.warning("KV store load failed, computing instead: %s", err)
            landed = [False] * len(pages)
        num_loaded = next((i for i, ok in enumerate(landed) if not ok), len(landed))
        self.page_views.landed(pages[:num_loaded], views[:num_loaded])
        for page, page_hash in zip(pages[:num_loaded], missing):
            pool.cache(page, page_hash)
        self._remember_stored(missing[:num_loaded])
        pool.free(reversed(pages))
        pool.free(reversed(local))
        return num_loaded

    def _find(self, keys: list[PageHash], tenant: str) -> tuple[int, Callable[[list[torch.Tensor]], list[bool]]]:
        """How many leading pages of ``keys`` the connector holds, and how to land the first ones in given views.

        A ``PrefixConnector`` answers both in one lookup, which its load then reuses; any other is asked how
        many, and its load looks the pages up again.
        """
        connector = self.connector
        if isinstance(connector, PrefixConnector):
            prefix = connector.locate_prefix(keys, tenant)
            return prefix.num_keys, functools.partial(connector.load_prefix, prefix)
        count = connector.longest_prefix(keys, tenant)
        return count, lambda views: connector.load(keys[: len(views)], views, tenant)

    def load_for_prewarm(self, hashes: list[PageHash], tenant: str, announced: bool) -> int:
        """A session prewarm's load of the pages of ``hashes`` missing here; returns how many landed.

        An unannounced prewarm is a guess: it leaves a share of the pool free
        for calls that have arrived. An announced one (the client said the
        call is coming) loads as for an arrived call: idle sessions' holds give way.
        """
        keep_free = 0 if announced else int(self.kv_cache.pool.num_pages * PREWARM_FREE_FRACTION)
        return self.load_missing(hashes, 0, reclaim=announced, keep_free=keep_free, tenant=tenant)

    # -- saves ------------------------------------------------------------

    def save_pages(self, seq: Sequence) -> None:
        """Publish the full pages ``seq`` has computed to the connector.

        With ``kv_save="sync"`` this returns once the connector has them (a
        prefill server answers only after its pages are in the store). With
        ``"async"`` the pages are pinned, written by the saver thread, and
        released by a later ``release_saved``.
        """
        hashes = self.kv_cache.computed_hashes(seq)
        owner = f"request {seq.request_id}"
        self._publish(owner, hashes, seq.pages[: len(hashes)], seq.cache_salt, wait=self._saver is None)

    def save_prompt(self, seq: Sequence) -> None:
        """With ``kv_save="async"``: publish the full pages of ``seq``'s prompt once they are computed.

        A session's pages then reach the store while its answer is still being
        decoded, so a call that outlives this engine's process (resumed
        elsewhere, or the session's next call) finds its prompt there. The save
        at the finish sends only what the answer added.
        """
        if self._saver is None:
            return
        num_full = min(seq.num_computed_tokens, seq.num_prompt_tokens) // self.page_size
        hashes = self.kv_cache.hash_prefix(seq, num_full * self.page_size)[:num_full]
        self._publish(f"the prompt of request {seq.request_id}", hashes, seq.pages[:num_full], seq.cache_salt, False)

    def save_prompts(self, chunks: Iterable[ScheduledChunk]) -> None:
        """``save_prompt`` for the sequences whose prompt these sampled chunks completed."""
        for chunk in chunks:
            if chunk.seq.num_computed_tokens - chunk.num_tokens < chunk.seq.num_prompt_tokens:
                self.save_prompt(chunk.seq)

    def store_now(self, hashes: list[PageHash], pages: list[Page], tenant: str) -> tuple[int, int]:
        """Make sure the store holds these pages: (how many leading ones it holds afterwards, how many were written).

        Asks the store rather than trusting what this engine remembers giving
        it: the store evicts on its own, and a page it lacks must not leave the device.
        """
        self.flush()
        try:
            held = self.connector.longest_prefix(hashes, tenant)
        except Exception as err:  # the store is an optimisation: keep the pages instead
            logger.warning("KV store lookup failed, keeping the pages: %s", err)
            return 0, 0
        if held == len(hashes):
            return held, 0
        written = self._publish("an offload", hashes[held:], pages[held:], tenant, wait=True, resend=True)
        try:
            return self.connector.longest_prefix(hashes, tenant), written
        except Exception as err:
            logger.warning("KV store lookup failed, keeping the pages: %s", err)
            return held, written

    def pin_in_store(self, hashes: list[PageHash], ttl_s: float, tenant: str, wait: bool = False) -> None:
        """Soft-pin ``tenant``'s pages in the store for ``ttl_s`` seconds (a pin only ever extends).

        With ``kv_save="async"`` (unless ``wait``) the saver thread pins them after the saves queued before,
        so the pages a finished sequence just published are in the store by then.
        """
        if self._saver is not None and not wait:
            self._saver.submit(self._pin, hashes, ttl_s, tenant)
        else:
            self._pin(hashes, ttl_s, tenant)

    def _pin(self, hashes: list[PageHash], ttl_s: float, tenant: str) -> None:
        try:
            self.connector.pin(hashes, ttl_s, tenant)
        except Exception as err:  # the store is an optimisation: the device pin still holds
            logger.warning("KV store pin failed: %s", err)

    def release_saved(self) -> None:
        """Drop the references of background saves that have finished (on the engine thread)."""
        while True:
            try:
                pages = self._saved.get_nowait()
            except queue.Empty:
                return
            self.kv_cache.pool.free(reversed(pages))

    def flush(self) -> None:
        """Wait for background page saves to finish and release their pages."""
        if self._saver is not None:
            self._saver.submit(lambda: None).result()
        self.release_saved()

    def _publish(
        self, owner: str, hashes: list[PageHash], pages: list[Page], tenant: str, wait: bool, resend: bool = False
    ) -> int:
        """Send ``tenant``'s pages the store lacks to the connector, now or in the background; returns how many.

        ``resend``: also those this engine remembers giving the store already.
        """
        # Pages this engine loaded from or gave to the store are not sent again:
        # an agent's next call re-saves only the pages its turn added.
        # A page that gave its window slot back lacks its sliding layers: it cannot be sent.
        complete = self.page_views.complete
        fresh = [i for i, h in enumerate(hashes) if (resend or h not in self.stored) and complete(pages[i])]
        if not fresh:
            return 0
        keys = [hashes[i] for i in fresh]
        self._remember_stored(keys)
        fresh_pages = [pages[i] for i in fresh]
        views = self.page_views.for_save(fresh_pages)
        if wait:
            self._save(owner, keys, views, tenant)
            return len(keys)
        assert self._saver is not None
        self.kv_cache.pool.touch(fresh_pages)
        future = self._saver.submit(self._save, owner, keys, views, tenant)
        future.add_done_callback(lambda _: self._saved.put(fresh_pages))
        return len(keys)

    def _remember_stored(self, hashes: Iterable[PageHash]) -> None:
        for page_hash in hashes:
            self.stored[page_hash] = None
            self.stored.move_to_end(page_hash)
        while len(self.stored) > _STORED_MEMORY_PER_PAGE * self.kv_cache.pool.num_pages:
            self.stored.popitem(last=False)

    def _save(self, owner: str, keys: list[PageHash], views: list[torch.Tensor], tenant: str) -> None:
        """Write pages (on the saver thread, or inline); keys that did not make it are forgotten as stored."""
        try:
            landed = self.connector.save(keys, views, tenant)
        except Exception as err:  # the store is an optimisation: never fail a request over it
            logger.warning("KV store save failed for %s: %s", owner, err)
            landed = [False] * len(keys)
        for key, ok in zip(keys, landed):
            if not ok:
                # dict.pop is atomic under the GIL, so the saver thread may do this beside the engine thread.
                self.stored.pop(key, None)


# -- a session's pages through the store (the moves themselves live in session_holds.py)


def offload_session(holds: SessionHolds, transfer: KVTransfer | None, session_id: str) -> SessionMove:
    """Make sure the store has a session's cached pages, then evict those nobody else references."""
    return holds.offload(session_id, _require(transfer, "offload_session").store_now)


def prewarm_session(
    holds: SessionHolds, transfer: KVTransfer | None, session_id: str, ttl_s: float, announced: bool
) -> SessionMove:
    """Load a session's pages missing here from the store, then hold its cached prefix for ``ttl_s``.

    ``announced``: the client said the session's call is coming, so the
    pages load as for an arrived call (idle sessions' holds give way) and
    are held as for a tool wait.
    """
    load = functools.partial(_require(transfer, "prewarm_session").load_for_prewarm, announced=announced)
    return holds.prewarm(session_id, ttl_s, load, kind="tool" if announced else "prewarm")


def hand_off_sessions(holds: SessionHolds, transfer: KVTransfer | None, timeout_s: float) -> int:
    """Make sure the store holds every recorded session's cached pages, the most recently used first, for up
    to ``timeout_s``; returns the pages written (none without a store)."""
    if transfer is None:
        return 0
    return holds.hand_off(transfer.store_now, holds.clock() + timeout_s)


def _require(transfer: KVTransfer | None, method: str) -> KVTransfer:
    if transfer is None:
        raise ValueError(f"{method} needs a kv_connector (and prefix caching on)")
    return transfer

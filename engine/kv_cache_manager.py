"""Maps sequences to pages: prefix-cache lookup, page allocation, forks.

Pages become cached as soon as the step that fills them is scheduled: their
tokens are known, and within one forward pass every layer writes all new
keys/values before any attention reads them, so a sequence admitted in the
same step may already share them.

Forks (parallel sampling) share every page. Full pages are immutable; the
partial last page is copied on the first write by a sibling that does not
own it alone (copy-on-write), and the copy is queued for the model runner.

A sequence's page hashes are computed once and kept on it
(``Sequence.page_hashes``): only pages past those it already has are hashed
here, so a prompt whose hashes arrived with the request is never hashed again.

Draft tokens (speculative decoding) get pages past the sequence's tokens
(``allocate_draft``) that are never cached as they are scheduled: a draft
token that the model confirms counts as computed one at a time
(``cache_computed`` caches a page it fills), and ``trim`` frees the pages
past the sequence's end once the rejected ones are known.

With sliding-window layers (``window_slots.py``) every page comes with a
window slot, and a sequence parks a slot once its next query is past the
page's window, where it holds the page alone and nothing else needs the slot
(``may_release``: with a store, the store must have the whole page first).
Pages it shared or the store lacked when it passed them are tried again when
slots run short, and then one the store lacks parks too.
A prefix hit ends where its last window of pages still has slots.

Pages held for idle sessions (``session_holds.py``) are not free. When an
allocation falls short, the ``reclaim`` hook releases holds and the
allocation is tried once more, before the scheduler resorts to preemption.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

from .page_hash import PageHash, hash_pages
from .page_pool import Page, PagePool
from .sequence import Sequence
from .window_slots import WindowSlots


def pages_for(num_tokens: int, page_size: int) -> int:
    return (num_tokens + page_size - 1) // page_size


def check_known_hashes(known: Seq[PageHash], num_tokens: int, page_size: int) -> None:
    """Raise ``ValueError`` when precomputed page hashes name more pages than the prompt fills."""
    if len(known) > num_tokens // page_size:
        raise ValueError(
            f"page_hashes has {len(known)} entries; the prompt of {num_tokens} tokens fills "
            f"{num_tokens // page_size} pages of {page_size}"
        )


class KVCacheManager:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        model_id: str,
        enable_prefix_caching: bool = True,
        window_slots: WindowSlots | None = None,
    ) -> None:
        self.page_size = page_size
        self.model_id = model_id
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = PagePool(num_pages, enable_caching=enable_prefix_caching, window=window_slots)
        self.window = window_slots
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) page ids, drained by the runner
        self.pending_window_copies: list[tuple[int, int]] = []  # (src, dst) window slots, likewise
        # Asked to free at least the given number of pages; returns how many it freed.
        self.reclaim: Callable[[int], int] | None = None
        # Whether a page's window slot may go back (a store that lacks the page vetoes it).
        self.may_release: Callable[[Page], bool] = lambda page: True
        self._keeping: dict[Sequence, None] = {}  # sequences with pages that kept their slot when passed

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The page copies (page ids) and window-slot copies queued since the last call, for the runner."""
        copies, window_copies = self.pending_copies, self.pending_window_copies
        self.pending_copies, self.pending_window_copies = [], []
        return copies, window_copies

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free_pages

    def hash_prefix(self, seq: Sequence, num_tokens: int) -> list[PageHash]:
        """``seq``'s page hashes, extended to cover the full pages among its first ``num_tokens`` tokens."""
        self._hash_full_pages(seq, num_tokens)
        return seq.page_hashes

    def computed_hashes(self, seq: Sequence) -> list[PageHash]:
        """The hashes of the full pages among ``seq``'s computed tokens."""
        num_full = seq.num_computed_tokens // self.page_size
        return self.hash_prefix(seq, num_full * self.page_size)[:num_full]

    def prompt_hashes(self, token_ids: Seq[int], cache_salt: str = "", known: Seq[PageHash] = ()) -> list[PageHash]:
        """The hashes of a prompt's pages that a prefix match may serve (all but the always-computed last token).

        ``known``: hashes of the prompt's first pages, already computed
        (trusted as they are); only the pages beyond them are hashed here.
        """
        check_known_hashes(known, len(token_ids), self.page_size)
        usable = (len(token_ids) - 1) // self.page_size
        hashes = list(known[:usable])
        if len(hashes) < usable:
            parent = hashes[-1] if hashes else None
            rest = list(token_ids[len(hashes) * self.page_size : usable * self.page_size])
            hashes.extend(hash_pages(rest, self.page_size, self.model_id, cache_salt, parent))
        return hashes

    def prefix_residency(
        self, token_ids: Seq[int], cache_salt: str = "", known: Seq[PageHash] = ()
    ) -> tuple[list[PageHash], int]:
        """A prompt's page hashes (as ``prompt_hashes``) and how many lead pages a match would serve here: the
        cached ones, cut where sliding layers lack a page's window slot (as ``match_prefix``).

        Only reads the prefix cache, so a server may call it beside the thread
        that steps the engine; the count is then an estimate.
        """
        hashes = self.prompt_hashes(token_ids, cache_salt, known)
        hits = self.pool.cached_prefix(hashes)
        return hashes, len(hits) if self.window is None else self.window.usable_hit(hits)

    def _hash_full_pages(self, seq: Sequence, num_tokens: int) -> None:
        """Extend ``seq.page_hashes`` to cover the full pages among its first ``num_tokens`` tokens."""
        have = len(seq.page_hashes)
        want = num_tokens // self.page_size
        if want <= have:
            return
        parent = seq.page_hashes[-1] if have else None
        start = have * self.page_size
        new_tokens = seq.token_ids[start : want * self.page_size]
        seq.page_hashes.extend(hash_pages(new_tokens, self.page_size, self.model_id, seq.cache_salt, parent))

    def match_prefix(self, seq: Sequence) -> list[Page]:
        """Cached pages holding the longest known prefix of a sequence with nothing computed.

        At least the last token is always left to compute, so the step that
        finishes the prompt has logits to sample from. A sequence that still
        scores its prompt (prompt logprobs) computes every position: no hits.
        """
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return []
        max_pages = (seq.num_tokens - 1) // self.page_size
        self._hash_full_pages(seq, max_pages * self.page_size)
        hits = self.pool.cached_prefix(seq.page_hashes[:max_pages])
        return hits if self.window is None else hits[: self.window.usable_hit(hits)]

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[Page] | None = None) -> bool:
        """Give ``seq`` room for ``num_new_tokens`` more tokens after ``cached`` hit pages.

        Returns False, leaving ``seq`` unchanged, when the pool cannot cover
        it even after the ``reclaim`` hook released held pages.
        """
        cached = cached or []
        self.release_behind_window(seq)
        num_computed = seq.num_computed_tokens + len(cached) * self.page_size
        needs_copy = self._shared_partial_tail(seq, num_computed)
        num_new_pages = pages_for(num_computed + num_new_tokens, self.page_size) - len(seq.pages) - len(cached)
        num_new_pages = max(num_new_pages, 0) + int(needs_copy)
        num_short = self._num_pages_short(num_new_pages, cached)
        if num_short > 0:
            if self.reclaim is None:
                return False
            # Referenced meanwhile, this request's own hits cannot pass for pages the release freed.
            self.pool.touch(cached)
            self.reclaim(num_short)
            self.pool.free(reversed(cached))
            if self._num_pages_short(num_new_pages, cached) > 0:
                return False
        self.pool.touch(cached)
        if self.window is not None:
            for page in cached:  # a hit's slots are this request's now, even where others parked them
                self.window.taken(page)
        seq.pages.extend(cached)
        if needs_copy:
            shared = seq.pages[-1]
            (private,) = self.pool.allocate(1)
            self.pending_copies.append((shared.page_id, private.page_id))
            if shared.window_slot >= 0:
                self.pending_window_copies.append((shared.window_slot, private.window_slot))
            self.pool.free([shared])
            seq.pages[-1] = private
            num_new_pages -= 1
        seq.pages.extend(self.pool.allocate(num_new_pages))
        self._hash_full_pages(seq, num_computed + num_new_tokens)
        first_uncached = num_computed // self.page_size
        full = (num_computed + num_new_tokens) // self.page_size
        for index in range(first_uncached, full):
            self.pool.cache(seq.pages[index], seq.page_hashes[index])
        return True

    def allocate_draft(self, seq: Sequence, num_draft_tokens: int, num_pages_spare: int) -> bool:
        """Pages for ``num_draft_tokens`` positions past ``seq``'s tokens, when ``num_pages_spare`` stay free after.

        Never reclaims or preempts for a draft; the pages are not cached.
        """
        num_new_pages = pages_for(seq.num_tokens + num_draft_tokens, self.page_size) - len(seq.pages)
        if num_new_pages > self.pool.num_allocatable - num_pages_spare:
            return False
        seq.pages.extend(self.pool.allocate(max(num_new_pages, 0)))
        return True

    def cache_computed(self, seq: Sequence) -> None:
        """Cache the page that ``seq``'s last computed token filled, if it filled one."""
        if seq.num_computed_tokens % self.page_size == 0:
            self._hash_full_pages(seq, seq.num_computed_tokens)
            index = seq.num_computed_tokens // self.page_size - 1
            self.pool.cache(seq.pages[index], seq.page_hashes[index])

    def trim(self, seq: Sequence) -> None:
        """Free ``seq``'s pages past those its tokens need (a rejected draft's)."""
        num_needed = pages_for(seq.num_tokens, self.page_size)
        excess = seq.pages[num_needed:]
        if excess:
            del seq.pages[num_needed:]
            self.pool.free(reversed(excess))

    def _num_pages_short(self, num_new_pages: int, cached: list[Page]) -> int:
        # Cache hits that sit in the free queue are not free for this request.
        num_hits_free = sum(1 for page in cached if page.ref_count == 0)
        short = num_new_pages - (self.pool.num_free_pages - num_hits_free)
        if self.window is None:
            return short
        # Nor are the slots parked on them; slots that running sequences passed by may come back.
        num_hits_parked = sum(1 for page in cached if self.window.is_parked(page))
        short_slots = num_new_pages - (self.window.num_available - num_hits_parked)
        if short_slots > 0:
            self._release_kept()
            short_slots = num_new_pages - (self.window.num_available - num_hits_parked)
        return max(short, short_slots)

    def release_behind_window(self, seq: Sequence) -> None:
        """Park the slots of ``seq``'s pages that its next query is past, where it holds them alone (and the
        store, if any, has them); note the others, to try again when slots run short."""
        window = self.window
        if window is None:
            return
        limit = min(window.first_visible(seq.num_computed_tokens) // self.page_size, len(seq.pages))
        for index in range(seq.window_released, limit):
            page = seq.pages[index]
            if page.window_slot < 0:
                continue
            if page.ref_count == 1 and self.may_release(page):
                window.park(page)
            else:
                seq.window_kept.append(index)
                self._keeping[seq] = None
        seq.window_released = max(seq.window_released, limit)

    def _release_kept(self) -> None:
        """Try again the pages running sequences passed by while they were shared or unsaved. Slots are short:
        a page the store lacks parks too (the store then misses it, rather than a sequence never fitting)."""
        assert self.window is not None
        for seq in list(self._keeping):
            still = []
            for index in seq.window_kept:
                page = seq.pages[index]
                if page.window_slot < 0:
                    continue
                if page.ref_count == 1:
                    self.window.park(page)
                else:
                    still.append(index)
            seq.window_kept = still
            if not still:
                del self._keeping[seq]

    def _shared_partial_tail(self, seq: Sequence, num_computed: int) -> bool:
        return num_computed % self.page_size != 0 and bool(seq.pages) and seq.pages[-1].ref_count > 1

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share every page of ``parent``."""
        self.pool.touch(parent.pages)
        child.pages = list(parent.pages)
        child.page_hashes = list(parent.page_hashes)
        child.window_released = parent.window_released
        child.window_kept = list(parent.window_kept)
        if child.window_kept:
            self._keeping[child] = None

    def free(self, seq: Sequence) -> None:
        self.pool.free(reversed(seq.pages))
        seq.pages = []
        seq.window_released = 0
        seq.window_kept = []
        self._keeping.pop(seq, None)

"""The page pool: which KV pages exist, who holds them, which can be reused.

Every page is in one of three states::

    in use (ref_count > 0) --free, last holder--> free & cached (hash kept)
          ^                                         |          |
          |  touch (prefix-cache hit) <-------------+          | allocate (evicts: hash dropped),
          |                                                    v  evict (hash dropped, to the head)
          +------------------- allocate <------------- free & uncached

Free pages sit in one queue in eviction order (head = evicted first). The
queue is a doubly linked list threaded through the pages themselves, so a
cache hit takes a page out of the middle in O(1). Holders free their pages
tail-first, which puts the end of a sequence ahead of its (more shareable)
beginning in the eviction order. Pages evicted on purpose (their contents
offloaded) go to the head, so they are reused before any cached page.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from .page_hash import PageHash

if TYPE_CHECKING:
    from .window_slots import WindowSlots


class Page:
    __slots__ = ("next_free", "page_hash", "page_id", "prev_free", "ref_count", "window_slot")

    def __init__(self, page_id: int) -> None:
        self.page_id = page_id
        self.ref_count = 0
        self.window_slot = -1  # its sliding layers' slot, for a model that has them (``window_slots.py``)
        self.page_hash: PageHash | None = None
        self.prev_free: Page | None = None
        self.next_free: Page | None = None

    def __repr__(self) -> str:
        return f"Page({self.page_id}, ref_count={self.ref_count}, cached={self.page_hash is not None})"


class FreePageQueue:
    """Doubly linked list of free pages; O(1) popleft, append and remove."""

    def __init__(self, pages: Iterable[Page]) -> None:
        self._head = Page(-1)  # sentinels: never handed out
        self._tail = Page(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for page in pages:
            self.append(page)

    def popleft(self) -> Page:
        page = self._head.next_free
        if page is None or page is self._tail:
            raise IndexError("no free pages")
        self.remove(page)
        return page

    def remove(self, page: Page) -> None:
        prev_page, next_page = page.prev_free, page.next_free
        if prev_page is None or next_page is None:
            raise ValueError(f"{page!r} is not in the free queue")
        prev_page.next_free = next_page
        next_page.prev_free = prev_page
        page.prev_free = page.next_free = None
        self.num_free -= 1

    def appendleft(self, page: Page) -> None:
        first = self._head.next_free
        assert first is not None
        first.prev_free = page
        page.next_free = first
        page.prev_free = self._head
        self._head.next_free = page
        self.num_free += 1

    def append(self, page: Page) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = page
        page.prev_free = last
        page.next_free = self._tail
        self._tail.prev_free = page
        self.num_free += 1

    def __iter__(self) -> Iterator[Page]:
        page = self._head.next_free
        while page is not None and page is not self._tail:
            yield page
            page = page.next_free

    def page_ids(self) -> list[int]:
        return [page.page_id for page in self]


class PagePool:
    """Owns page ids, reference counts and the hash -> page prefix cache.

    ``window``: the sliding layers' slots, for a model that has such layers: every page allocated gets one.
    """

    def __init__(self, num_pages: int, enable_caching: bool = True, window: WindowSlots | None = None) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.pages = [Page(i) for i in range(num_pages)]
        self.free_queue = FreePageQueue(self.pages)
        self.enable_caching = enable_caching
        self.window = window
        self._cached: dict[PageHash, Page] = {}

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    @property
    def num_free_pages(self) -> int:
        return self.free_queue.num_free

    @property
    def num_allocatable(self) -> int:
        """How many pages one allocation may take: free pages, as far as window slots go round."""
        if self.window is None:
            return self.free_queue.num_free
        return min(self.free_queue.num_free, self.window.num_available)

    @property
    def num_cached_pages(self) -> int:
        return len(self._cached)

    def lookup(self, page_hash: PageHash) -> Page | None:
        return self._cached.get(page_hash) if self.enable_caching else None

    def cached_prefix(self, hashes: Iterable[PageHash]) -> list[Page]:
        """The cached pages of the longest leading run of ``hashes`` (stops at the first miss)."""
        hits: list[Page] = []
        for page_hash in hashes:
            page = self.lookup(page_hash)
            if page is None:
                break
            hits.append(page)
        return hits

    def allocate(self, num_pages: int) -> list[Page]:
        """Take ``num_pages`` from the head of the free queue, evicting their cached contents."""
        if num_pages > self.free_queue.num_free:
            raise ValueError(f"asked for {num_pages} pages, {self.free_queue.num_free} free")
        window = self.window
        if window is not None and num_pages > window.num_available:
            raise ValueError(f"asked for {num_pages} pages, {window.num_available} window slots free")
        pages = []
        for _ in range(num_pages):
            page = self.free_queue.popleft()
            if page.page_hash is not None:
                del self._cached[page.page_hash]
                page.page_hash = None
            if window is not None:
                window.give(page)
            page.ref_count = 1
            pages.append(page)
        return pages

    def touch(self, pages: Iterable[Page]) -> None:
        """Take a reference to pages found in the cache (they may be free); their hashes become the most
        recently used, the first page last (``recent_hashes`` cuts a prefix's tail before its head)."""
        touched = list(pages)
        for page in touched:
            if page.ref_count == 0:
                self.free_queue.remove(page)
                if self.window is not None:
                    self.window.taken(page)
            page.ref_count += 1
        cached = self._cached
        for page in reversed(touched):
            if page.page_hash is not None:
                cached[page.page_hash] = cached.pop(page.page_hash)

    def free(self, pages: Iterable[Page]) -> None:
        """Drop a reference to each page, in the order given (pass the tail first)."""
        for page in pages:
            if page.ref_count <= 0:
                raise ValueError(f"{page!r} freed more often than taken")
            page.ref_count -= 1
            if page.ref_count == 0:
                self.free_queue.append(page)
                if self.window is not None:
                    self.window.went_free(page)

    def evict(self, pages: Sequence[Page]) -> None:
        """Drop free pages from the cache and move them to the head of the free queue, in the order given."""
        held = [page for page in pages if page.ref_count > 0]
        if held:
            raise ValueError(f"cannot evict pages in use: {held}")
        for page in reversed(pages):
            if page.page_hash is not None:
                del self._cached[page.page_hash]
                page.page_hash = None
            if self.window is not None:
                self.window.release(page)
            self.free_queue.remove(page)
            self.free_queue.appendleft(page)

    def recent_hashes(self, limit: int) -> list[PageHash]:
        """Up to ``limit`` cached hashes, the most recently cached or touched last: a prefix every call
        shares (a system prompt) stays among them however many pages were cached after it."""
        if limit <= 0:
            return []
        hashes = list(self._cached)  # cached or last touched: least recent first
        return hashes[-limit:]

    def cache(self, page: Page, page_hash: PageHash) -> None:
        """Publish a full page under its hash; a hash cached already keeps its first page."""
        if not self.enable_caching or page.page_hash is not None or page_hash in self._cached:
            return
        page.page_hash = page_hash
        self._cached[page_hash] = page

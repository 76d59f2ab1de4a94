"""Where sliding-window layers keep their keys and values: slots that only pages inside a window hold.

A model that mixes full-attention layers with sliding-window ones (GPT-OSS:
every other layer sees only the last W tokens) keeps two caches. A page's
full-attention layers live in the page pool's cache as for any model; its
sliding layers live in a window slot of a second, smaller cache. A page
holds a slot (``Page.window_slot``, -1 for none) from its allocation until
no query needs it any more: once a sequence's next query is W tokens past a
page that it alone holds, the slot is parked (``park``): up for grabs by
any allocation short of slots, which takes it and leaves the page only its
full-attention part. So a long sequence needs slots for about W tokens,
whatever its length.

A page without a slot still serves prefix-cache hits, for the positions a
query at the hit's end cannot see: a hit that ends at position L needs slots
on the pages holding positions L - W + 1 .. L - 1 (``usable_hit``).

Parked slots stay with their cached pages (a later hit may need them) until
an allocation runs out of unattached slots: then it takes the slot parked
first. A page that was never cached has nothing to offer a hit: its slot is
given back at once (``release``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from .page_pool import Page


class WindowSlots:
    """The slots of the sliding layers' cache, for one page pool."""

    def __init__(self, num_slots: int, window: int, page_size: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_window_slots must be >= 1, got {num_slots}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.num_slots = num_slots
        self.window = window
        self.page_size = page_size
        self._unattached = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        # Cached pages whose slot no holder needs (free ones, or held for their other layers only), the first
        # to give it up first.
        self._parked: OrderedDict[Page, None] = OrderedDict()

    @property
    def num_available(self) -> int:
        """Slots an allocation may take: unattached ones and parked ones."""
        return len(self._unattached) + len(self._parked)

    @property
    def num_unattached(self) -> int:
        return len(self._unattached)

    def give(self, page: Page) -> None:
        """Give a page being allocated a slot (it keeps the one it had)."""
        if page.window_slot >= 0:
            self._parked.pop(page, None)
            return
        if not self._unattached:
            if not self._parked:
                raise ValueError("no window slot left")
            donor, _ = self._parked.popitem(last=False)
            self._unattached.append(donor.window_slot)
            donor.window_slot = -1
        page.window_slot = self._unattached.pop()

    def release(self, page: Page) -> None:
        """Take a page's slot back (its sliding layers' keys and values are no longer needed)."""
        if page.window_slot >= 0:
            self._parked.pop(page, None)
            self._unattached.append(page.window_slot)
            page.window_slot = -1

    def park(self, page: Page) -> None:
        """No holder needs a page's slot any more: a cached page keeps it for later hits until an allocation
        runs short (the page may still be in use, for its other layers); an uncached one gives it back."""
        if page.window_slot < 0:
            return
        if page.page_hash is None:
            self.release(page)
        else:
            self._parked[page] = None

    def went_free(self, page: Page) -> None:
        """A page's last holder let it go: a cached one parks its slot, an uncached one gives it back."""
        self.park(page)

    def taken(self, page: Page) -> None:
        """A page got a new holder (a prefix-cache hit): its slot is no longer up for grabs."""
        self._parked.pop(page, None)

    def is_parked(self, page: Page) -> bool:
        return page in self._parked

    def first_visible(self, position: int) -> int:
        """The first key position a query at ``position`` sees."""
        return max(0, position - self.window + 1)

    def usable_hit(self, hits: Sequence[Page]) -> int:
        """How many of ``hits`` (a cached prefix's pages, in order) a new query after them may use: the most
        whose last W - 1 positions all sit on pages that kept their slot."""
        num = len(hits)
        while num > 0:
            first_page = self.first_visible(num * self.page_size) // self.page_size
            missing = next((i for i in range(num - 1, first_page - 1, -1) if hits[i].window_slot < 0), None)
            if missing is None:
                return num
            num = missing  # a hit may end no later than the slotless page
        return 0

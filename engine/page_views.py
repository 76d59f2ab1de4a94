"""The blocks the KV store reads pages from and writes pages into.

The store's page is the same for every model: one contiguous block of
``[num_layers, 2, page_size, num_kv_heads, head_dim]``, every layer in order,
so a page hash names the same bytes everywhere. Where the engine keeps all
layers in one cache, that block is the cache's own page. A model with
sliding-window layers keeps them apart, in window slots (``window_slots.py``):
its pages are put together for a save and taken apart after a load, and a page
that gave its slot back (its sliding layers' keys are gone) cannot be saved.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .page_pool import Page


class PageViews:
    """``cache``: [num_pages, layers, 2, ...] of the full-attention layers (all layers without a window cache);
    ``window_cache``: [num_slots, sliding layers, 2, ...]; ``sliding``: each layer's place in the two caches."""

    def __init__(
        self, cache: torch.Tensor, window_cache: torch.Tensor | None = None, sliding: Sequence[bool] = ()
    ) -> None:
        self.cache = cache
        self.window_cache = window_cache
        self._full = torch.tensor([i for i, s in enumerate(sliding) if not s], dtype=torch.long)
        self._sliding = torch.tensor([i for i, s in enumerate(sliding) if s], dtype=torch.long)
        self._num_layers = len(sliding)

    def complete(self, page: Page) -> bool:
        """Whether the engine still has every layer of the page."""
        return self.window_cache is None or page.window_slot >= 0

    def for_save(self, pages: Sequence[Page]) -> list[torch.Tensor]:
        """A block per page to hand the store (complete pages only); copies where the layers live apart."""
        if self.window_cache is None:
            return [self.cache[page.page_id] for page in pages]
        blocks = []
        for page in pages:
            if page.window_slot < 0:
                raise ValueError(f"{page!r} gave its window slot back: its sliding layers cannot be saved")
            block = self._empty()
            block[self._full] = self.cache[page.page_id]
            block[self._sliding] = self.window_cache[page.window_slot]
            blocks.append(block)
        return blocks

    def for_load(self, pages: Sequence[Page]) -> list[torch.Tensor]:
        """A block per (freshly allocated) page for the store to write into; ``landed`` puts them in place."""
        if self.window_cache is None:
            return [self.cache[page.page_id] for page in pages]
        return [self._empty() for _ in pages]

    def landed(self, pages: Sequence[Page], blocks: Sequence[torch.Tensor]) -> None:
        """Move loaded blocks into the caches (nothing to do where the blocks are the cache's own pages)."""
        if self.window_cache is None:
            return
        for page, block in zip(pages, blocks):
            self.cache[page.page_id] = block[self._full]
            self.window_cache[page.window_slot] = block[self._sliding]

    def _empty(self) -> torch.Tensor:
        shape = (self._num_layers, *self.cache.shape[2:])
        return torch.empty(shape, dtype=self.cache.dtype, device=self.cache.device)

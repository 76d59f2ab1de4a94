"""Page pool: exact page ids, exact free-queue order, reference counts, cache eviction."""

from __future__ import annotations

import pytest

from rayturn.engine.page_hash import PageHash, hash_page, hash_pages
from rayturn.engine.page_pool import FreePageQueue, Page, PagePool


def h(i: int) -> PageHash:
    return hash_page(None, [i], "m")


def test_free_queue_order_and_o1_removal() -> None:
    pages = [Page(i) for i in range(5)]
    queue = FreePageQueue(pages)
    assert queue.page_ids() == [0, 1, 2, 3, 4]
    queue.remove(pages[2])
    assert queue.page_ids() == [0, 1, 3, 4] and queue.num_free == 4
    assert queue.popleft().page_id == 0
    queue.append(pages[2])
    assert queue.page_ids() == [1, 3, 4, 2]
    with pytest.raises(ValueError):
        queue.remove(pages[0])  # not in the queue


def test_allocate_takes_from_the_head() -> None:
    pool = PagePool(6)
    first = pool.allocate(2)
    second = pool.allocate(3)
    assert [p.page_id for p in first] == [0, 1]
    assert [p.page_id for p in second] == [2, 3, 4]
    assert pool.free_queue.page_ids() == [5]
    assert all(p.ref_count == 1 for p in first + second)
    with pytest.raises(ValueError, match="asked for 2 pages, 1 free"):
        pool.allocate(2)


def test_free_tail_first_sets_eviction_order() -> None:
    pool = PagePool(6)
    seq_a = pool.allocate(3)  # 0 1 2
    seq_b = pool.allocate(2)  # 3 4
    pool.free(reversed(seq_a))
    assert pool.free_queue.page_ids() == [5, 2, 1, 0]
    pool.free(reversed(seq_b))
    assert pool.free_queue.page_ids() == [5, 2, 1, 0, 4, 3]


def test_cache_hit_revives_a_free_page_and_eviction_drops_its_hash() -> None:
    pool = PagePool(4)
    pages = pool.allocate(2)  # 0 1
    pool.cache(pages[0], h(0))
    pool.cache(pages[1], h(1))
    pool.free(reversed(pages))
    assert pool.free_queue.page_ids() == [2, 3, 1, 0]
    hit = pool.lookup(h(0))
    assert hit is pages[0]
    pool.touch([hit])
    assert hit.ref_count == 1 and pool.free_queue.page_ids() == [2, 3, 1]
    # Allocating three pages reaches page 1 and evicts its cached contents.
    got = pool.allocate(3)
    assert [p.page_id for p in got] == [2, 3, 1]
    assert pool.lookup(h(1)) is None and pool.lookup(h(0)) is hit
    assert pool.num_cached_pages == 1


def test_recent_hashes_keep_a_prefix_every_call_touches_head_first() -> None:
    pool = PagePool(10)
    pages = pool.allocate(10)
    for i, page in enumerate(pages):
        pool.cache(page, h(i))
    pool.free(reversed(pages))
    assert pool.recent_hashes(2) == [h(8), h(9)]
    # A later call hits the first three pages (a shared system prompt): they are the most recently used now,
    # the first one last, so a report cut to fewer still starts the prefix.
    pool.touch(pool.cached_prefix([h(0), h(1), h(2)]))
    assert pool.recent_hashes(3) == [h(2), h(1), h(0)]
    assert pool.recent_hashes(1) == [h(0)]
    assert pool.recent_hashes(10)[:7] == [h(i) for i in range(3, 10)]
    assert pool.recent_hashes(0) == []


def test_shared_page_returns_to_queue_only_when_last_holder_frees() -> None:
    pool = PagePool(3)
    (page,) = pool.allocate(1)
    pool.touch([page])
    assert page.ref_count == 2
    pool.free([page])
    assert pool.free_queue.page_ids() == [1, 2]
    pool.free([page])
    assert pool.free_queue.page_ids() == [1, 2, 0]
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([page])


def test_duplicate_hash_keeps_first_page_and_caching_off_caches_nothing() -> None:
    pool = PagePool(3)
    a, b = pool.allocate(2)
    pool.cache(a, h(7))
    pool.cache(b, h(7))
    assert pool.lookup(h(7)) is a and b.page_hash is None
    off = PagePool(2, enable_caching=False)
    (c,) = off.allocate(1)
    off.cache(c, h(7))
    assert off.lookup(h(7)) is None and off.num_cached_pages == 0


def test_page_hashes_chain_and_separate_models_and_tenants() -> None:
    tokens = list(range(40))
    hashes = hash_pages(tokens, 16, "model-a")
    assert len(hashes) == 2  # the partial third page has no hash
    assert hashes[1] == hash_page(hashes[0], tokens[16:32], "model-a")
    assert hash_pages(tokens, 16, "model-b")[0] != hashes[0]
    assert hash_pages(tokens, 16, "model-a", salt="tenant-2")[0] != hashes[0]
    # Same second page after a different first page: different name.
    other = hash_pages([99] + tokens[1:], 16, "model-a")
    assert other[1] != hashes[1]
    # Continuing a chain equals hashing all at once.
    assert hash_pages(tokens[16:], 16, "model-a", parent=hashes[0]) == hashes[1:]
    assert all(len(x) == 32 for x in hashes)

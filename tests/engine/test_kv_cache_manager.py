"""KV cache manager: prefix hits, page accounting, copy-on-write forks — exact ids."""

from __future__ import annotations

from rayturn.engine.kv_cache_manager import KVCacheManager
from rayturn.engine.sampling_params import SamplingParams
from rayturn.engine.sequence import Sequence

PAGE = 4


def seq(seq_id: int, tokens: list[int], salt: str = "") -> Sequence:
    return Sequence(seq_id, str(seq_id), list(tokens), len(tokens), SamplingParams(), cache_salt=salt)


def run(manager: KVCacheManager, s: Sequence) -> None:
    """Admit and fully compute ``s`` as the scheduler would."""
    hits = manager.match_prefix(s)
    s.num_computed_tokens = 0
    assert manager.allocate(s, s.num_tokens - len(hits) * PAGE, hits)
    s.num_computed_tokens = s.num_tokens


def test_allocate_pages_and_cache_full_ones() -> None:
    manager = KVCacheManager(8, PAGE, "m")
    a = seq(0, list(range(10)))  # 2 full pages + 2 tokens
    run(manager, a)
    assert [p.page_id for p in a.pages] == [0, 1, 2]
    assert [p.page_hash is not None for p in a.pages] == [True, True, False]
    assert manager.pool.free_queue.page_ids() == [3, 4, 5, 6, 7]


def test_prefix_hit_reuses_pages_and_leaves_last_token() -> None:
    manager = KVCacheManager(8, PAGE, "m")
    a = seq(0, list(range(12)))  # exactly 3 pages
    run(manager, a)
    b = seq(1, list(range(12)))
    hits = manager.match_prefix(b)
    # The last token must be computed, so the third page is not a hit.
    assert [p.page_id for p in hits] == [0, 1]
    c = seq(2, list(range(8)) + [50, 51, 52, 53, 54])
    assert [p.page_id for p in manager.match_prefix(c)] == [0, 1]
    d = seq(3, [99] + list(range(1, 12)))
    assert manager.match_prefix(d) == []
    e = seq(4, list(range(12)), salt="other-tenant")
    assert manager.match_prefix(e) == []


def test_hits_on_free_pages_count_against_free_space() -> None:
    manager = KVCacheManager(4, PAGE, "m")
    a = seq(0, list(range(9)))  # pages 0 1 2
    run(manager, a)
    manager.free(a)
    assert manager.pool.free_queue.page_ids() == [3, 2, 1, 0]
    b = seq(1, list(range(8)) + [7] * 9)  # 17 tokens: hits 0,1; needs 3 more pages
    hits = manager.match_prefix(b)
    assert [p.page_id for p in hits] == [0, 1]
    # 4 free pages, but 2 of them are the hits themselves: only 2 usable.
    assert not manager.allocate(b, 9, hits)
    assert manager.pool.free_queue.page_ids() == [3, 2, 1, 0]  # unchanged on failure
    assert manager.allocate(b, 5, hits)
    assert [p.page_id for p in b.pages] == [0, 1, 3, 2]


def test_fork_shares_pages_and_copies_partial_tail_on_write() -> None:
    manager = KVCacheManager(8, PAGE, "m")
    parent = seq(0, list(range(6)))  # page 0 full, page 1 has 2 tokens
    run(manager, parent)
    child = seq(1, list(range(6)))
    child.num_computed_tokens = parent.num_computed_tokens
    manager.fork(parent, child)
    assert [p.page_id for p in child.pages] == [0, 1]
    assert [p.ref_count for p in parent.pages] == [2, 2]
    parent.token_ids.append(100)
    child.token_ids.append(200)
    # Parent writes its 7th token into shared page 1 -> gets a private copy.
    assert manager.allocate(parent, 1)
    assert [p.page_id for p in parent.pages] == [0, 2]
    assert manager.pending_copies == [(1, 2)]
    parent.num_computed_tokens += 1
    # Child now owns page 1 alone: no copy.
    assert manager.allocate(child, 1)
    assert [p.page_id for p in child.pages] == [0, 1]
    assert manager.pending_copies == [(1, 2)]
    assert [p.ref_count for p in manager.pool.pages[:3]] == [2, 1, 1]
    manager.free(parent)
    manager.free(child)
    assert manager.pool.free_queue.page_ids() == [3, 4, 5, 6, 7, 2, 1, 0]

"""Sliding-window layers keep only their window: window slots, their release, and what still matches.

A GPT-OSS model whose sliding layers see 32 tokens keeps those layers' keys
and values in window slots, which pages give back once no query can see them.
Greedy outputs stay equal to transformers' whether slots are plentiful or so
few that parked ones are taken; a prefix hit ends where its window still has
slots; and the store gets every layer of a page, in layer order, the same
bytes as an engine that keeps all layers in its pages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hf_models import parity_prompts, transformers_reference
from moe_models import make_moe_checkpoint
from test_session_holds import DictConnector

from rayturn.engine import LLMEngine, SamplingParams
from rayturn.engine.page_pool import Page, PagePool
from rayturn.engine.window_slots import WindowSlots

pytest.importorskip("transformers")

ARCH = "gptoss-e8-top3-window32-gqa4"  # layers: sliding, full, sliding; window 32
WINDOW = 32
PAGE = 16
MAX_NEW_TOKENS = 40
PARAMS = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    return make_moe_checkpoint(ARCH, tmp_path_factory.mktemp(ARCH))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return parity_prompts(3)


@pytest.fixture(scope="module")
def expected(checkpoint: tuple[Any, Path], prompts: list[list[int]]) -> list[list[int]]:
    model, _ = checkpoint
    tokens, _ = transformers_reference(model, prompts, MAX_NEW_TOKENS)
    return tokens


def engine(path: Path, **options: Any) -> LLMEngine:
    options = {"backend": "torch", "dtype": "float32", "page_size": PAGE, "max_num_batched_tokens": 64, **options}
    return LLMEngine.from_pretrained(str(path), **options)


def run(engine_: LLMEngine, prompts: list[list[int]], max_steps: int = 3000) -> list[Any]:
    """``generate``, with a bound on steps: an engine that can no longer admit a request fails, not hangs."""
    ids = [engine_.add_request(prompt, PARAMS) for prompt in prompts]
    finished = {}
    for _ in range(max_steps):
        finished.update((out.request_id, out) for out in engine_.step() if out.finished)
        if len(finished) == len(ids):
            return [finished[request_id] for request_id in ids]
    raise AssertionError(f"{len(ids) - len(finished)} requests unfinished after {max_steps} steps")


def slots_in_use(engine_: LLMEngine) -> int:
    window = engine_.kv_cache.window
    assert window is not None
    return window.num_slots - window.num_available


# ---------------------------------------------------------------------------------------------- unit


def paged(pool: PagePool, count: int) -> list[Page]:
    pages = pool.allocate(count)
    for index, page in enumerate(pages):
        pool.cache(page, bytes([index]))
    return pages


def test_allocation_takes_unattached_slots_then_the_first_parked() -> None:
    window = WindowSlots(3, window=WINDOW, page_size=PAGE)
    pool = PagePool(8, window=window)
    first = paged(pool, 3)
    assert sorted(page.window_slot for page in first) == [0, 1, 2] and window.num_available == 0
    with pytest.raises(ValueError, match="window slots"):
        pool.allocate(1)
    window.park(first[1])  # still held, for its other layers
    window.park(first[0])
    assert window.num_available == 2
    (fourth,) = pool.allocate(1)
    assert fourth.window_slot == 1 and first[1].window_slot == -1 and first[0].window_slot == 0
    pool.free([fourth])  # uncached: nothing to keep it for
    assert fourth.window_slot == -1 and window.num_unattached == 1


def test_a_hit_on_a_parked_slot_takes_it_back() -> None:
    window = WindowSlots(2, window=WINDOW, page_size=PAGE)
    pool = PagePool(4, window=window)
    pages = paged(pool, 2)
    pool.free(reversed(pages))  # free and cached: slots parked
    assert window.num_available == 2 and all(window.is_parked(page) for page in pages)
    pool.touch(pages)
    assert window.num_available == 0 and all(page.window_slot >= 0 for page in pages)


def test_a_hit_ends_before_a_slotless_page_its_queries_would_see() -> None:
    window = WindowSlots(8, window=WINDOW, page_size=PAGE)
    pages = [Page(i) for i in range(6)]
    for page in pages:
        page.window_slot = page.page_id
    assert window.usable_hit(pages) == 6
    pages[1].window_slot = -1  # a query at 96 sees 65..96: page 1 (16..31) is not among them
    assert window.usable_hit(pages) == 6
    pages[4].window_slot = -1  # pages 4-5 hold 64..95: a hit may end at 64 only if 33..63 have slots
    assert window.usable_hit(pages) == 4
    pages[3].window_slot = -1
    assert window.usable_hit(pages) == 1  # a query at 16 sees from 0: page 0 only
    pages[0].window_slot = -1
    assert window.usable_hit(pages) == 0


# ------------------------------------------------------------------------------------- the engine


def test_sliding_layers_live_in_window_slots_and_pages_hold_the_rest(checkpoint: tuple[Any, Path]) -> None:
    _, path = checkpoint
    windowed = engine(path, num_pages=64, num_window_slots=24)
    assert windowed.runner.kv_cache.shape[:2] == (64, 1) and windowed.runner.window_cache is not None
    assert windowed.runner.window_cache.shape[:2] == (24, 2)
    whole = engine(path, num_pages=64, num_window_slots=0)
    assert whole.runner.kv_cache.shape[:2] == (64, 3) and whole.runner.window_cache is None
    assert windowed.bytes_per_page == whole.bytes_per_page  # a store page: every layer


def test_a_long_sequence_holds_slots_for_its_window_only(
    checkpoint: tuple[Any, Path], prompts: list[list[int]], expected: list[list[int]]
) -> None:
    _, path = checkpoint
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    windowed = engine(path, num_pages=64, num_window_slots=64)
    windowed.add_request(prompts[longest], PARAMS)
    most = 0
    outputs = []
    for _ in range(1000):
        outputs += [out for out in windowed.step() if out.finished]
        most = max(most, slots_in_use(windowed))
        if outputs:
            break
    (output,) = outputs
    assert list(output.token_ids) == expected[longest]
    num_pages = -(-(len(prompts[longest]) + MAX_NEW_TOKENS) // PAGE)
    # A 64-token chunk and the window before it, each on partial pages at both ends.
    assert most <= (64 + WINDOW) // PAGE + 2 < num_pages


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_equals_transformers_when_parked_slots_are_taken(
    checkpoint: tuple[Any, Path], prompts: list[list[int]], expected: list[list[int]], backend: str
) -> None:
    _, path = checkpoint
    scarce = engine(path, num_pages=128, num_window_slots=16, backend=backend)
    assert [list(o.token_ids) for o in run(scarce, prompts)] == expected
    cached = [page for page in scarce.kv_cache.pool.pages if page.page_hash is not None]
    assert any(page.window_slot < 0 for page in cached), "no parked slot was ever taken"
    # Again, from the prefix cache as far as windows with slots reach: outputs unchanged.
    again = run(scarce, prompts)
    assert [list(o.token_ids) for o in again] == expected
    full_hits = [(len(p) - 1) // PAGE * PAGE for p in prompts]
    hits = [o.num_cached_prompt_tokens for o in again]
    assert all(hit <= full for hit, full in zip(hits, full_hits)) and hits != full_hits


def test_prefix_residency_counts_only_the_pages_a_hit_may_use(
    checkpoint: tuple[Any, Path], prompts: list[list[int]]
) -> None:
    """What the router is told a replica holds is what the replica's next match serves: with parked slots taken,
    fewer pages than the cache holds."""
    _, path = checkpoint
    scarce = engine(path, num_pages=128, num_window_slots=16)
    run(scarce, prompts)
    told, served, cached = [], [], []
    for prompt in sorted(prompts, key=len, reverse=True):
        hashes, resident = scarce.prefix_residency(prompt)
        told.append(resident)
        cached.append(len(scarce.kv_cache.pool.cached_prefix(hashes)))
        (out,) = run(scarce, [prompt])
        served.append(out.num_cached_prompt_tokens // PAGE)
    assert told == served
    assert any(resident < held for resident, held in zip(told, cached)), "no cached page lacked its slot"


def test_plentiful_slots_serve_the_whole_prefix_again(
    checkpoint: tuple[Any, Path], prompts: list[list[int]], expected: list[list[int]]
) -> None:
    _, path = checkpoint
    plenty = engine(path, num_pages=256, num_window_slots=256)
    assert [list(o.token_ids) for o in run(plenty, prompts)] == expected
    again = run(plenty, prompts)
    assert [list(o.token_ids) for o in again] == expected
    assert [o.num_cached_prompt_tokens for o in again] == [(len(p) - 1) // PAGE * PAGE for p in prompts]


def test_the_store_gets_every_layer_in_order_and_serves_a_windowed_engine(
    checkpoint: tuple[Any, Path], prompts: list[list[int]], expected: list[list[int]]
) -> None:
    _, path = checkpoint
    stores = [DictConnector(), DictConnector()]
    windowed = engine(path, num_pages=128, num_window_slots=128, kv_connector=stores[0])
    whole = engine(path, num_pages=128, num_window_slots=0, kv_connector=stores[1])
    for producer in (windowed, whole):
        assert [list(o.token_ids) for o in run(producer, prompts)] == expected
    assert stores[0].pages.keys() == stores[1].pages.keys() and stores[0].pages
    for key, block in stores[0].pages.items():
        assert torch.equal(block, stores[1].pages[key]), "a page's layers differ from the whole-page engine's"
    # A fresh windowed engine loads the whole-page engine's pages and answers the same.
    fresh = engine(path, num_pages=128, num_window_slots=64, kv_connector=stores[1])
    outputs = run(fresh, prompts)
    assert [list(o.token_ids) for o in outputs] == expected
    assert sum(o.num_cached_prompt_tokens for o in outputs) > 0


def test_with_a_store_a_page_keeps_its_slot_until_the_store_has_it(
    checkpoint: tuple[Any, Path], prompts: list[list[int]]
) -> None:
    _, path = checkpoint
    store = DictConnector()
    windowed = engine(path, num_pages=64, num_window_slots=64, kv_connector=store)
    windowed.add_request(max(prompts, key=len), PARAMS)
    for _ in range(6):  # prompt chunks, nothing saved yet (saves come at the finish)
        windowed.step()
    assert not store.saved
    (seq,) = windowed.scheduler.running
    assert all(page.window_slot >= 0 and not windowed.kv_cache.window.is_parked(page) for page in seq.pages)
    for _ in range(1000):
        if not windowed.has_unfinished_requests():
            break
        windowed.step()
    assert not windowed.has_unfinished_requests() and store.saved  # every page went to the store whole
    assert all(torch.isfinite(block).all() for block in store.pages.values())


def test_too_few_window_slots_for_one_step_are_refused_by_name(checkpoint: tuple[Any, Path]) -> None:
    _, path = checkpoint
    with pytest.raises(ValueError, match=r"num_window_slots must be 0 .* or at least 8 .*got 7"):
        engine(path, num_pages=64, num_window_slots=7)


def test_with_a_store_and_few_slots_a_long_prompt_still_runs(
    checkpoint: tuple[Any, Path], prompts: list[list[int]], expected: list[list[int]]
) -> None:
    """Slots short: pages the store lacks give theirs up too, so a prompt longer than the slots go round
    still fits; the store then gets only the pages that kept every layer."""
    _, path = checkpoint
    store = DictConnector()
    scarce = engine(path, num_pages=64, num_window_slots=10, kv_connector=store)
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    assert -(-len(prompts[longest]) // PAGE) > 10
    (output,) = run(scarce, [prompts[longest]])
    assert list(output.token_ids) == expected[longest]
    num_full = (len(prompts[longest]) + MAX_NEW_TOKENS - 1) // PAGE
    assert len(store.pages) < num_full  # the pages that lost their slot were not sent

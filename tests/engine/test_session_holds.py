"""Session page holds: TTLs, release order under memory pressure, offload and prewarm, exact pages.

Pages are 4 tokens, so a session's 10-token prompt plus 3 output tokens
computes 12 tokens: exactly 3 full pages, ids 0, 1, 2 on a fresh engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import pytest
import torch

from rayturn.engine import LLMEngine, RequestOutput, SamplingParams, SessionMove
from rayturn.engine.async_engine import AsyncEngine
from rayturn.engine.page_hash import PageHash, hash_page
from rayturn.engine.page_pool import Page, PagePool
from rayturn.engine.reservations import PrefixReservations
from rayturn.engine.session_holds import SessionHolds

PAGE = 4
THREE_OUT = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
ONE_OUT = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def tokens(start: int, count: int) -> list[int]:
    return [(start + 7 * i) % 250 + 5 for i in range(count)]


class DictConnector:
    """A KVConnector over one dictionary of page copies; remembers every key it was asked to save."""

    def __init__(self) -> None:
        self.pages: dict[bytes, torch.Tensor] = {}
        self.saved: list[bytes] = []
        self.tenants: dict[bytes, str] = {}  # the tenant each page was saved for

    def longest_prefix(self, keys: Sequence[bytes], tenant: str = "") -> int:
        count = 0
        while count < len(keys) and keys[count] in self.pages and self.tenants[keys[count]] == tenant:
            count += 1
        return count

    def load(self, keys: Sequence[bytes], pages: Sequence[torch.Tensor], tenant: str = "") -> list[bool]:
        for key, page in zip(keys, pages):
            assert self.tenants[key] == tenant
            page.copy_(self.pages[key])
        return [True] * len(keys)

    def save(self, keys: Sequence[bytes], pages: Sequence[torch.Tensor], tenant: str = "") -> list[bool]:
        for key, page in zip(keys, pages):
            self.saved.append(key)
            self.pages.setdefault(key, page.clone())
            self.tenants.setdefault(key, tenant)
        return [True] * len(keys)


def make_engine(num_pages: int = 16, connector: DictConnector | None = None, **kwargs: object) -> LLMEngine:
    return LLMEngine.from_pretrained(
        "tiny", backend="torch", dtype="float32", page_size=PAGE, num_pages=num_pages, kv_connector=connector, **kwargs
    )


def run(engine: LLMEngine, prompt: list[int], params: SamplingParams, session_id: str | None = None) -> RequestOutput:
    request_id = engine.add_request(prompt, params, session_id=session_id)
    while True:
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output


def page_ids(pages: Sequence[Page]) -> list[int]:
    return [page.page_id for page in pages]


# -- the page pool and the holds object alone -----------------------------------


def h(i: int) -> PageHash:
    return hash_page(None, [i], "m")


def cached_pool(num_pages: int, num_cached: int) -> PagePool:
    """A pool whose pages 0 .. num_cached-1 are free and cached under h(0), h(1), ..."""
    pool = PagePool(num_pages)
    pages = pool.allocate(num_cached)
    for i, page in enumerate(pages):
        pool.cache(page, h(i))
    pool.free(pages)
    return pool


def test_evict_drops_free_pages_from_the_cache_to_the_head_of_the_queue() -> None:
    pool = cached_pool(6, 4)
    assert pool.free_queue.page_ids() == [4, 5, 0, 1, 2, 3]
    pool.evict([pool.pages[2], pool.pages[0]])
    assert pool.free_queue.page_ids() == [2, 0, 4, 5, 1, 3]
    assert pool.lookup(h(0)) is None and pool.lookup(h(2)) is None and pool.num_cached_pages == 2
    pool.touch([pool.pages[1]])
    with pytest.raises(ValueError, match="cannot evict pages in use"):
        pool.evict([pool.pages[3], pool.pages[1]])
    assert pool.lookup(h(3)) is pool.pages[3]  # nothing changed


def test_holds_take_the_cached_prefix_and_lapse_on_their_clock() -> None:
    now_s = [100.0]
    pool = cached_pool(8, 5)
    holds = SessionHolds(pool, bytes_per_page=10, clock=lambda: now_s[0])
    assert holds.record("a", [h(0), h(1), h(9), h(2)], ttl_s=10.0) == 2  # stops at the first miss
    assert holds.record("b", [h(3), h(4)], ttl_s=30.0) == 2
    assert pool.free_queue.page_ids() == [5, 6, 7, 2]
    assert holds.residency("a") == (2, 4) and holds.residency("unknown") == (0, 0)
    assert holds.hold("b", ttl_s=5.0, kind="tool") == 2  # replaces the turn hold: now lapses at 105
    assert [page.ref_count for page in pool.pages[:5]] == [1, 1, 0, 1, 1]
    assert holds.hold("unknown", ttl_s=5.0) == 0

    now_s[0] = 104.9
    assert holds.expire() == 0
    now_s[0] = 105.0
    assert holds.expire() == 1
    assert pool.free_queue.page_ids() == [5, 6, 7, 2, 4, 3]  # freed tail-first
    now_s[0] = 110.0
    assert holds.expire() == 1
    assert holds.stats() == {
        "held_sessions": 0,
        "held_pages": 0,
        "expired_holds": 2,
        "pressure_releases": 0,
        "offloaded_pages": 0,
        "prewarmed_pages": 0,
    }
    assert holds.residency("a") == (2, 4)  # released pages stay cached


def test_reclaim_releases_turn_and_prewarm_holds_before_tool_holds_oldest_first() -> None:
    pool = cached_pool(8, 8)
    holds = SessionHolds(pool, bytes_per_page=10)
    holds.record("tool-old", [h(0), h(1)], ttl_s=60.0)
    holds.hold("tool-old", ttl_s=60.0, kind="tool")
    holds.record("turn-old", [h(2), h(3)], ttl_s=60.0)
    holds.record("prewarmed", [h(4), h(5)], ttl_s=60.0)
    holds.hold("prewarmed", ttl_s=60.0, kind="prewarm")
    holds.record("turn-new", [h(6), h(7)], ttl_s=60.0)
    assert pool.num_free_pages == 0
    pool.touch([pool.pages[2], pool.pages[3]])  # a running sequence shares turn-old's pages

    # Releasing turn-old frees nothing; prewarmed then frees two pages, which suffices.
    assert holds.reclaim(2) == 2
    assert pool.free_queue.page_ids() == [5, 4]
    assert holds.stats()["held_sessions"] == 2 and holds.stats()["pressure_releases"] == 2
    assert holds.reclaim(3) == 4  # turn-new, then tool-old
    assert pool.free_queue.page_ids() == [5, 4, 7, 6, 1, 0]
    assert holds.reclaim(1) == 0  # nothing left to release
    assert holds.stats()["pressure_releases"] == 4


def test_recorded_sessions_are_a_bounded_lru() -> None:
    pool = cached_pool(4, 3)
    holds = SessionHolds(pool, bytes_per_page=10, max_sessions=2)
    holds.record("a", [h(0)], ttl_s=60.0)
    holds.record("b", [h(1)], ttl_s=60.0)
    holds.hold("a", ttl_s=60.0)  # a is now the most recently used
    holds.record("c", [h(2)], ttl_s=60.0)
    assert holds.residency("b") == (0, 0) and pool.pages[1].ref_count == 0  # forgotten, hold released
    assert holds.residency("a") == (1, 1) and holds.stats()["held_sessions"] == 2


def test_bad_hold_arguments() -> None:
    holds = SessionHolds(cached_pool(2, 1), bytes_per_page=10)
    with pytest.raises(ValueError, match="hold kind must be one of tool, turn, prewarm; got 'nap'"):
        holds.hold("a", ttl_s=1.0, kind="nap")
    with pytest.raises(ValueError, match="ttl_s must be >= 0"):
        holds.hold("a", ttl_s=-1.0)
    with pytest.raises(ValueError, match="max_sessions"):
        SessionHolds(cached_pool(2, 1), bytes_per_page=10, max_sessions=0)


# -- the engine --------------------------------------------------------------------


def test_finished_session_stays_held_while_cold_pages_make_room() -> None:
    engine = make_engine(num_pages=16)
    run(engine, tokens(0, 10), THREE_OUT, session_id="s")
    pool = engine.kv_cache.pool
    assert [page.ref_count for page in pool.pages[:4]] == [1, 1, 1, 0]  # the hold's references only
    assert engine.session_residency("s") == (3, 3)
    cold = tokens(100, 20)
    run(engine, cold, ONE_OUT)  # pages 3-7, left cached but unheld
    assert engine.prefix_residency(cold)[1] == 4
    # 13 pages: every free page, so the cold ones are evicted and the held ones are not.
    out = run(engine, tokens(200, 49), THREE_OUT)
    assert len(out.token_ids) == 3
    assert engine.prefix_residency(cold)[1] == 0
    assert engine.session_residency("s") == (3, 3)
    assert engine.session_stats() == {
        "held_sessions": 1,
        "held_pages": 3,
        "expired_holds": 0,
        "pressure_releases": 0,
        "offloaded_pages": 0,
        "prewarmed_pages": 0,
        "reserved_requests": 0,
        "reserved_pages_total": 0,
        "reservations_dropped": 0,
    }
    assert engine.release_session("s") == 3 and engine.release_session("s") == 0
    assert engine.kv_cache.num_free_pages == 16


def test_pressure_releases_turn_holds_before_tool_holds_and_never_starves_a_request() -> None:
    engine = make_engine(num_pages=12)
    run(engine, tokens(0, 10), THREE_OUT, session_id="tool")
    assert engine.hold_session("tool", ttl_s=60.0, kind="tool") == 3  # the oldest hold
    run(engine, tokens(50, 10), THREE_OUT, session_id="turn-old")
    run(engine, tokens(100, 10), THREE_OUT, session_id="turn-new")
    assert engine.kv_cache.num_free_pages == 3

    run(engine, tokens(150, 20), ONE_OUT)  # 5 pages: short by 2, turn-old goes
    assert engine.session_residency("turn-old") == (1, 3)  # its first page survived at the queue's tail
    assert engine.session_residency("turn-new") == (3, 3) and engine.session_residency("tool") == (3, 3)
    assert engine.session_stats()["pressure_releases"] == 1

    out = run(engine, tokens(200, 45), THREE_OUT)  # 47 computed tokens: all 12 pages
    assert len(out.token_ids) == 3
    stats = engine.session_stats()
    assert stats["pressure_releases"] == 3 and stats["held_sessions"] == 0
    assert engine.kv_cache.num_free_pages == 12


def test_holds_lapse_at_the_next_step_or_expire_call() -> None:
    engine = make_engine(num_pages=16, session_hold_s=0.0)
    run(engine, tokens(0, 10), THREE_OUT, session_id="s")
    assert engine.expire_holds() == 1 and engine.kv_cache.num_free_pages == 16
    assert engine.hold_session("s", ttl_s=0.0, kind="turn") == 3
    engine.step()  # no request: the step only lets lapsed holds go
    assert engine.session_stats()["expired_holds"] == 2 and engine.kv_cache.num_free_pages == 16
    assert engine.session_residency("s") == (3, 3)
    with pytest.raises(ValueError, match="hold kind"):
        engine.hold_session("s", ttl_s=1.0, kind="sleep")
    with pytest.raises(ValueError, match="offload_session needs a kv_connector"):
        engine.offload_session("s")
    with pytest.raises(ValueError, match="prewarm_session needs a kv_connector"):
        engine.prewarm_session("s", ttl_s=1.0)
    with pytest.raises(ValueError, match="session_hold_s"):
        make_engine(session_hold_s=-1.0)


def test_offload_saves_what_the_store_lacks_and_keeps_pages_another_session_holds() -> None:
    connector = DictConnector()
    engine = make_engine(num_pages=16, connector=connector)
    prompt_a = tokens(0, 10)
    run(engine, prompt_a, THREE_OUT, session_id="a")  # pages 0 1 2
    run(engine, prompt_a[:8] + tokens(90, 4), ONE_OUT, session_id="b")  # shares pages 0 1, adds page 3
    hashes_a = [engine.kv_cache.pool.pages[i].page_hash for i in range(3)]
    assert connector.saved == [*hashes_a, engine.kv_cache.pool.pages[3].page_hash]  # saved as each finished
    connector.pages.clear()  # the store evicted them: the engine still remembers giving them
    connector.saved.clear()

    move = engine.offload_session("a")
    bytes_per_page = engine.session_holds.bytes_per_page
    # All three written again, and only page 2 evicted: pages 0 and 1 are "b"'s too.
    assert move == SessionMove(pages=1, resident_pages=2, bytes_moved=3 * bytes_per_page, seconds=move.seconds)
    assert connector.saved == hashes_a
    assert engine.kv_cache.pool.free_queue.page_ids()[:2] == [2, 4]  # evicted to the head, reused first
    assert engine.session_residency("a") == (2, 3) and engine.session_residency("b") == (3, 3)
    assert engine.session_stats()["offloaded_pages"] == 1 and engine.session_stats()["held_sessions"] == 1

    move = engine.prewarm_session("a", ttl_s=60.0)
    assert move == SessionMove(pages=1, resident_pages=3, bytes_moved=bytes_per_page, seconds=move.seconds)
    assert engine.kv_cache.pool.pages[2].page_hash == hashes_a[2]  # landed in the page at the head
    assert engine.session_stats()["prewarmed_pages"] == 1 and engine.session_stats()["held_sessions"] == 2


def test_an_engine_about_to_stop_hands_every_session_to_the_store_most_recent_first() -> None:
    connector = DictConnector()
    engine = make_engine(num_pages=16, connector=connector)
    run(engine, tokens(0, 10), THREE_OUT, session_id="a")  # pages 0 1 2
    run(engine, tokens(100, 10), THREE_OUT, session_id="b")  # pages 3 4 5
    hashes = [engine.kv_cache.pool.pages[i].page_hash for i in range(6)]
    connector.pages.clear()  # the segment that held them is gone
    connector.saved.clear()

    server = AsyncEngine(engine)
    assert server.hand_off_sessions(timeout_s=10.0) == 0  # the engine thread still owns the engine
    server.shutdown()
    assert server.hand_off_sessions(timeout_s=10.0) == 6
    assert connector.saved == hashes[3:] + hashes[:3]  # "b", the most recently used, first
    assert engine.session_residency("a") == (3, 3) and engine.session_residency("b") == (3, 3)  # nothing evicted

    connector.pages.clear()
    connector.saved.clear()
    assert engine.hand_off_sessions(timeout_s=0.0) == 0 and connector.saved == []  # no time left: nothing


def test_offload_keeps_what_the_store_cannot_take_and_pages_other_sessions_share() -> None:
    connector = DictConnector()
    engine = make_engine(num_pages=16, connector=connector)
    prompt = tokens(0, 10)
    run(engine, prompt, THREE_OUT, session_id="a")  # pages 0 1 2
    run(engine, prompt[:8] + tokens(90, 4), ONE_OUT, session_id="b")  # records pages 0 1 3
    engine.release_session("b")  # "b" holds nothing now, but still shares pages 0 and 1 with "a"
    refused: list[bytes] = []

    def refuse(keys: Sequence[bytes], pages: Sequence[torch.Tensor], tenant: str = "") -> list[bool]:
        refused.extend(keys)
        return [False] * len(keys)

    connector.pages.clear()
    connector.save = refuse  # type: ignore[method-assign]
    move = engine.offload_session("a")
    # The store took nothing: every page stays on the device, and the engine forgets it ever stored them.
    assert (move.pages, move.resident_pages) == (0, 3)
    assert len(refused) == 3 and not any(key in engine.kv_transfer.stored for key in refused)

    del connector.save  # the store works again
    move = engine.offload_session("a")
    assert (move.pages, move.resident_pages) == (1, 2)  # page 2 went; 0 and 1 stay for "b"
    assert engine.session_residency("b") == (3, 3)


def test_prewarmed_session_finds_its_pages_cached_not_loaded() -> None:
    connector = DictConnector()
    engine = make_engine(num_pages=16, connector=connector, kv_save="async")
    first = run(engine, tokens(0, 10), THREE_OUT, session_id="s")
    # The offload waits for the background save, whose page references would otherwise keep the pages.
    move = engine.offload_session("s")
    assert (move.pages, move.resident_pages, move.bytes_moved) == (3, 0, 0)
    assert engine.kv_cache.num_free_pages == 16 and engine.kv_cache.pool.num_cached_pages == 0
    assert engine.session_residency("s") == (0, 3)

    move = engine.prewarm_session("s", ttl_s=60.0)
    assert (move.pages, move.resident_pages) == (3, 3)
    follow_up = [*first.prompt_token_ids, *first.token_ids, *tokens(300, 3)]
    reference = run(make_engine(), follow_up, THREE_OUT)
    again = run(engine, follow_up, THREE_OUT, session_id="s")
    assert (again.num_cached_prompt_tokens, again.num_loaded_prompt_tokens) == (12, 0)
    assert again.token_ids == reference.token_ids


def offloaded_beside_two_held_sessions() -> LLMEngine:
    """8 pages: session "s" offloaded (3 pages in the store), "a" and "b" holding 3 each, 2 free."""
    engine = make_engine(num_pages=8, connector=DictConnector())
    run(engine, tokens(0, 10), THREE_OUT, session_id="s")
    engine.offload_session("s")
    run(engine, tokens(100, 10), THREE_OUT, session_id="a")
    run(engine, tokens(200, 10), THREE_OUT, session_id="b")
    assert engine.kv_cache.num_free_pages == 2
    return engine


def test_a_prewarm_leaves_a_quarter_of_the_pool_for_arrivals() -> None:
    engine = offloaded_beside_two_held_sessions()
    move = engine.prewarm_session("s", ttl_s=60.0)
    assert (move.pages, move.resident_pages) == (0, 0)  # 2 of 8 pages must stay free: nothing to spare
    engine.release_session("b")  # 5 free now
    move = engine.prewarm_session("s", ttl_s=60.0)
    assert (move.pages, move.resident_pages) == (3, 3)
    assert engine.kv_cache.num_free_pages == 2


def test_an_announced_prewarm_loads_as_for_an_arrived_call() -> None:
    engine = offloaded_beside_two_held_sessions()  # "a" and "b" hold their pages as idle turn ends
    # The call is on its way: idle sessions' holds give way, and nothing is kept back.
    move = engine.prewarm_session("s", ttl_s=60.0, announced=True)
    assert (move.pages, move.resident_pages) == (3, 3)
    assert engine.session_holds._holds["s"].kind == "tool"  # held as surely as a tool wait
    # The third page came from an idle session whose hold gave way.
    assert engine.session_residency("a")[0] + engine.session_residency("b")[0] == 5
    assert engine.session_stats()["pressure_releases"] >= 1


def test_early_return_after_offload_loads_on_demand() -> None:
    connector = DictConnector()
    engine = make_engine(num_pages=16, connector=connector, kv_load_min_tokens=0)
    first = run(engine, tokens(0, 10), THREE_OUT, session_id="s")
    engine.offload_session("s")
    follow_up = [*first.prompt_token_ids, *first.token_ids, *tokens(300, 3)]
    again = run(engine, follow_up, THREE_OUT, session_id="s")
    assert (again.num_cached_prompt_tokens, again.num_loaded_prompt_tokens) == (12, 12)
    assert again.token_ids == run(make_engine(), follow_up, THREE_OUT).token_ids
    assert engine.session_residency("s") == (4, 4)  # the new turn's hold: 18 computed tokens


def test_an_early_return_under_pressure_loads_all_its_pages_as_idle_holds_give_way() -> None:
    connector = DictConnector()
    engine = make_engine(num_pages=8, connector=connector, kv_load_min_tokens=0)
    first = run(engine, tokens(0, 10), THREE_OUT, session_id="s")
    engine.offload_session("s")
    run(engine, tokens(100, 10), THREE_OUT, session_id="a")  # 3 pages held for "a"
    run(engine, tokens(200, 10), THREE_OUT, session_id="b")  # and 3 for "b": 2 pages free
    assert engine.kv_cache.num_free_pages == 2
    follow_up = [*first.prompt_token_ids, *first.token_ids, *tokens(300, 3)]
    again = run(engine, follow_up, THREE_OUT, session_id="s")
    # All 3 of its pages came back from the store: the oldest idle hold ("a") gave way for them.
    assert (again.num_cached_prompt_tokens, again.num_loaded_prompt_tokens) == (12, 12)
    assert engine.session_stats()["pressure_releases"] == 1
    assert engine.session_residency("a")[0] < 3 and engine.session_residency("b") == (3, 3)
    assert again.token_ids == run(make_engine(), follow_up, THREE_OUT).token_ids


def test_async_engine_passes_sessions_through_and_lets_holds_lapse_when_idle() -> None:
    async def main() -> dict[str, object]:
        server = AsyncEngine(make_engine(num_pages=16, session_hold_s=0.2))
        try:
            async for _ in server.generate(tokens(0, 10), THREE_OUT, request_id="r", session_id="s"):
                pass
            deadline_s = time.monotonic() + 5.0
            while server.stats()["expired_holds"] == 0 and time.monotonic() < deadline_s:
                await asyncio.sleep(0.05)
            return server.stats()
        finally:
            server.shutdown()

    stats = asyncio.run(main())
    assert stats["expired_holds"] == 1 and stats["held_sessions"] == 0 and stats["free_pages"] == 16


# -- queued requests' prefixes ---------------------------------------------------


def start_long_request(engine: LLMEngine, max_tokens: int) -> str:
    """A 33-token request that runs (9 pages) and then grows by decoding; the engine admits only one at a time."""
    request_id = engine.add_request(
        tokens(200, 33), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    )
    engine.step()
    assert [seq.request_id for seq in engine.scheduler.running] == [request_id]
    return request_id


def finish_all(engine: LLMEngine) -> dict[str, RequestOutput]:
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


def test_a_queued_request_keeps_its_cached_prefix_and_idle_holds_give_way_first() -> None:
    engine = make_engine(num_pages=16, max_num_seqs=1)
    run(engine, tokens(0, 10), THREE_OUT, session_id="s")  # pages 0-2 held for session s
    shared = tokens(100, 13)
    run(engine, shared, ONE_OUT)  # 3 full pages cached, unheld
    start_long_request(engine, max_tokens=16)  # 9 pages now, 12 by its end: 3 more than the 1 free
    queued = engine.add_request(shared + tokens(300, 4), ONE_OUT)  # waits: one sequence at a time
    assert engine.session_stats()["reserved_requests"] == 1
    outputs = finish_all(engine)
    # The long request's growth took the session's held pages (released under pressure), not the
    # queued request's cached prefix: all 3 of its pages were still there at its admission.
    assert outputs[queued].num_cached_prompt_tokens == 12
    assert engine.session_residency("s")[0] < 3
    stats = engine.session_stats()
    assert stats["pressure_releases"] == 1 and stats["reservations_dropped"] == 0
    assert stats["reserved_requests"] == 0 and stats["reserved_pages_total"] == 3


def test_a_running_sequence_outranks_queued_reservations_youngest_dropped_first() -> None:
    engine = make_engine(num_pages=16, max_num_seqs=1)
    older, younger = tokens(100, 9), tokens(400, 9)
    run(engine, older, ONE_OUT)  # 2 full pages cached
    run(engine, younger, ONE_OUT)  # 2 more
    start_long_request(engine, max_tokens=24)  # grows to 14 pages: needs every page but the older's two
    first = engine.add_request(older + [7], ONE_OUT)
    second = engine.add_request(younger + [7], ONE_OUT)
    outputs = finish_all(engine)  # no deadlock: the reservations gave way to the running sequence
    assert engine.session_stats()["reservations_dropped"] == 1
    assert outputs[first].num_cached_prompt_tokens == 8  # the oldest queued request kept its prefix
    assert outputs[second].num_cached_prompt_tokens == 0  # the youngest's was taken back and evicted


def test_an_aborted_queued_request_gives_its_reservation_back() -> None:
    engine = make_engine(num_pages=16, max_num_seqs=1)
    shared = tokens(100, 13)
    run(engine, shared, ONE_OUT)
    start_long_request(engine, max_tokens=4)
    queued = engine.add_request(shared + [7], ONE_OUT)
    pages = engine.kv_cache.pool.cached_prefix(engine.prefix_residency(shared)[0])
    assert [page.ref_count for page in pages] == [1, 1, 1]  # the reservation's references
    engine.abort(queued)
    assert [page.ref_count for page in pages] == [0, 0, 0]
    assert engine.session_stats()["reserved_requests"] == 0


def test_reservations_that_would_free_nothing_are_kept() -> None:
    pool = PagePool(6)
    shared, own = pool.allocate(2), pool.allocate(1)
    for page, n in zip([*shared, *own], range(3)):
        pool.cache(page, hash_page(None, [n], "m"))
    pool.free([*shared, *own])
    reservations = PrefixReservations(pool)
    reservations.reserve("a", list(shared))  # two queued requests with one system prompt
    reservations.reserve("b", list(shared))
    reservations.reserve("c", list(own))
    # Dropping "c" (youngest) frees its page; "b" alone would free nothing ("a" still holds the pages).
    assert reservations.reclaim(2) == 1
    assert reservations.stats()["reserved_requests"] == 2 and reservations.dropped == 1
    assert [page.ref_count for page in shared] == [2, 2]


def test_aborting_a_request_that_finished_on_arrival_leaves_the_engine_working() -> None:
    engine = make_engine(num_pages=16)
    done = engine.add_request(tokens(0, 5), ONE_OUT, output_prefix=[9])  # max_tokens 1: finished on arrival
    engine.abort(done)
    assert engine.step() == []
    assert run(engine, tokens(0, 5), ONE_OUT).finished


def test_a_tenants_session_goes_to_the_store_and_comes_back_as_that_tenants() -> None:
    connector = DictConnector()
    engine = make_engine(num_pages=16, connector=connector)
    request_id = engine.add_request(tokens(0, 10), THREE_OUT, session_id="alice/s", cache_salt="alice")
    while engine.has_unfinished_requests():
        engine.step()
    move = engine.offload_session("alice/s")
    assert move.pages == 3 and request_id
    assert set(connector.tenants.values()) == {"alice"}  # offloaded as alice's pages
    move = engine.prewarm_session("alice/s", ttl_s=60.0)
    assert (move.pages, move.resident_pages) == (3, 3)  # loaded back as alice's (the double checks the tenant)

"""Prefix pins: retention contracts survive eviction, give way to pressure last, move to the store, lapse, cap.

Pages are 4 tokens. A 10-token prompt with 3 output tokens computes 12
tokens (3 full pages); its retained prefix is the 2 full pages of the prompt
(8 tokens), which a re-run of the prompt reports as cached. With 16 pages in
the cache, pins may take 8.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from rayturn.engine import LLMEngine, RequestOutput, SamplingParams
from rayturn.engine.kv_connector import StoreConnector
from rayturn.engine.page_hash import PageHash, hash_page, salted
from rayturn.engine.page_pool import PagePool
from rayturn.engine.prefix_pins import PrefixPins, Retention, reclaim_in_order

PAGE = 4
THREE_OUT = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
ONE_OUT = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
FOUR_OUT = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
HOUR = Retention(num_tokens=10, ttl_s=3600.0)


def tokens(start: int, count: int) -> list[int]:
    return [(start + 7 * i) % 250 + 5 for i in range(count)]


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


class PinningConnector:
    """A KVConnector over one dictionary of page copies; logs every save and pin, in order."""

    def __init__(self) -> None:
        self.pages: dict[bytes, torch.Tensor] = {}
        self.tenants: dict[bytes, str] = {}
        self.log: list[tuple[str, tuple[bytes, ...]]] = []
        self.pins: list[tuple[tuple[bytes, ...], float, str]] = []
        self.refuse = False  # a full or failing store: saves land nowhere

    def longest_prefix(self, keys: Sequence[bytes], tenant: str = "") -> int:
        count = 0
        while count < len(keys) and self.tenants.get(keys[count]) == tenant and keys[count] in self.pages:
            count += 1
        return count

    def load(self, keys: Sequence[bytes], pages: Sequence[torch.Tensor], tenant: str = "") -> list[bool]:
        for key, page in zip(keys, pages):
            assert self.tenants[key] == tenant
            page.copy_(self.pages[key])
        return [True] * len(keys)

    def save(self, keys: Sequence[bytes], pages: Sequence[torch.Tensor], tenant: str = "") -> list[bool]:
        self.log.append(("save", tuple(keys)))
        if self.refuse:
            return [False] * len(keys)
        for key, page in zip(keys, pages):
            self.pages.setdefault(key, page.clone())
            self.tenants.setdefault(key, tenant)
        return [True] * len(keys)

    def pin(self, keys: Sequence[bytes], ttl_s: float, tenant: str = "") -> None:
        self.log.append(("pin", tuple(keys)))
        self.pins.append((tuple(keys), ttl_s, tenant))


def make_engine(
    num_pages: int = 16, connector: PinningConnector | None = None, clock: Clock | None = None, **kwargs: object
) -> LLMEngine:
    engine = LLMEngine.from_pretrained(
        "tiny", backend="torch", dtype="float32", page_size=PAGE, num_pages=num_pages, kv_connector=connector, **kwargs
    )
    if clock is not None:
        engine.prefix_pins.clock = clock
    return engine


def run(
    engine: LLMEngine,
    prompt: list[int],
    params: SamplingParams = THREE_OUT,
    retention: Retention | None = None,
    cache_salt: str = "",
    session_id: str | None = None,
) -> RequestOutput:
    request_id = engine.add_request(prompt, params, cache_salt=cache_salt, session_id=session_id, retention=retention)
    while True:
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output


def prefix_hashes(engine: LLMEngine, prompt: list[int], num_pages: int, cache_salt: str = "") -> tuple[bytes, ...]:
    return tuple(engine.kv_cache.prompt_hashes(prompt, cache_salt)[:num_pages])


def pin_stats(engine: LLMEngine) -> dict[str, int]:
    return engine.prefix_pins.stats()


# -- the contract ---------------------------------------------------------------


def test_retention_is_checked_once_where_it_is_made() -> None:
    assert Retention(1, 0.5) == Retention(num_tokens=1, ttl_s=0.5)
    for num_tokens, ttl_s in [
        (0, 60.0),
        (True, 60.0),
        (10, 0.0),
        (10, -1.0),
        (10, float("inf")),
        (10, float("nan")),
        (10, "60"),
    ]:
        with pytest.raises(ValueError, match="Retention"):
            Retention(num_tokens, ttl_s)  # type: ignore[arg-type]


def test_a_pinned_prefix_survives_eviction_that_takes_an_unpinned_one() -> None:
    engine = make_engine()
    prompt_a, prompt_b = tokens(0, 10), tokens(50, 10)
    assert run(engine, prompt_a, retention=HOUR).num_cached_prompt_tokens == 0
    run(engine, prompt_b)
    assert pin_stats(engine)["pinned_prefixes"] == 1 and pin_stats(engine)["pinned_pages"] == 2
    assert [page.ref_count for page in engine.kv_cache.pool.pages[:3]] == [1, 1, 0]  # the pin's references only
    # 56 computed tokens: all 14 pages the pin leaves free, so every unpinned cached page is evicted.
    run(engine, tokens(200, 53), FOUR_OUT)
    assert engine.prefix_residency(prompt_b)[1] == 0
    assert run(engine, prompt_b).num_cached_prompt_tokens == 0
    assert run(engine, prompt_a).num_cached_prompt_tokens == 2 * PAGE  # exactly the pinned full pages
    assert pin_stats(engine)["pins_released_by_pressure"] == 0


def test_the_prefix_is_the_prompts_full_pages_within_num_tokens() -> None:
    engine = make_engine()
    run(engine, tokens(0, 14), retention=Retention(num_tokens=9, ttl_s=60.0))  # 9 tokens: 2 full pages
    assert pin_stats(engine)["pinned_pages"] == 2
    # Asking for more than the prompt keeps only the prompt's full pages, never output pages.
    run(engine, tokens(100, 10), FOUR_OUT, retention=Retention(num_tokens=500, ttl_s=60.0))
    assert pin_stats(engine)["pinned_pages"] == 4
    run(engine, tokens(150, 3), retention=Retention(num_tokens=3, ttl_s=60.0))  # no full page: nothing pinned
    assert pin_stats(engine)["pinned_prefixes"] == 2


# -- memory pressure ------------------------------------------------------------------


def test_pressure_releases_session_holds_before_pins_and_pins_last() -> None:
    engine = make_engine()
    prompt_a = tokens(0, 10)
    run(engine, prompt_a, retention=HOUR)  # pages 0 1 pinned
    run(engine, tokens(50, 10), session_id="s")  # pages 3 4 5 held
    assert engine.kv_cache.num_free_pages == 11
    run(engine, tokens(100, 45), ONE_OUT)  # 12 pages: short by one, and the session hold gives way
    assert engine.session_stats()["pressure_releases"] == 1
    assert pin_stats(engine)["pinned_pages"] == 2 and engine.prefix_residency(prompt_a)[1] == 2
    # 63 computed tokens: all 16 pages. Without a store, only the pin is left to give way.
    run(engine, tokens(150, 60), FOUR_OUT)
    assert pin_stats(engine) == {
        "pinned_prefixes": 0,
        "pinned_pages": 0,
        "pins_expired": 0,
        "pins_moved_to_store": 0,
        "pins_released_by_pressure": 1,
        "pins_released_over_cap": 0,
    }
    assert run(engine, prompt_a).num_cached_prompt_tokens == 0


def test_pressure_moves_a_pin_to_the_store_with_its_remaining_ttl_and_the_next_call_loads_it() -> None:
    connector, clock = PinningConnector(), Clock()
    engine = make_engine(connector=connector, clock=clock)
    prompt_a = tokens(0, 10)
    run(engine, prompt_a, retention=HOUR)
    hashes_a = prefix_hashes(engine, prompt_a, 2)
    assert connector.pins == [(hashes_a, 3600.0, "")]  # pinned in the store as the call finished
    connector.pages.clear()  # the store lost them: the move must write them again

    clock.now_s += 600.0
    run(engine, tokens(150, 60), FOUR_OUT)  # all 16 pages
    # Written again, then pinned for what is left of the hour; then the big request saved its own pages.
    assert connector.log[2:4] == [("save", hashes_a), ("pin", hashes_a)] and len(connector.log) == 5
    assert connector.pins[-1] == (hashes_a, 3000.0, "")
    assert pin_stats(engine)["pins_moved_to_store"] == 1 and pin_stats(engine)["pinned_prefixes"] == 0
    assert engine.prefix_residency(prompt_a)[1] == 0  # evicted here by the allocation

    again = run(engine, prompt_a, retention=HOUR)
    assert (again.num_cached_prompt_tokens, again.num_loaded_prompt_tokens) == (2 * PAGE, 2 * PAGE)
    assert pin_stats(engine)["pinned_prefixes"] == 1  # pinned here again


def test_a_pin_the_store_refuses_stays_until_the_last_resort() -> None:
    connector = PinningConnector()
    engine = make_engine(connector=connector)
    prompt_a = tokens(0, 10)
    run(engine, prompt_a, retention=HOUR)
    connector.pages.clear()
    connector.refuse = True
    # Short by a page: the store will not take the pin, and a queued request's reservation is not there
    # to give way, so the pin goes, counted as dropped rather than moved.
    run(engine, tokens(150, 60), FOUR_OUT)
    assert pin_stats(engine)["pins_moved_to_store"] == 0 and pin_stats(engine)["pins_released_by_pressure"] == 1
    # Tried, refused, never pinned again; then the big request tried to save its own pages.
    assert connector.log[2] == ("save", prefix_hashes(engine, prompt_a, 2)) and len(connector.log) == 4


@pytest.mark.parametrize("with_store", [False, True], ids=["no-store", "store"])
def test_a_queued_requests_reservation_gives_way_after_pins_the_store_takes_before_any_other(
    with_store: bool,
) -> None:
    engine = make_engine(connector=PinningConnector() if with_store else None, max_num_seqs=1)
    run(engine, tokens(0, 10), retention=HOUR)  # 2 pages pinned
    shared = tokens(100, 13)
    run(engine, shared, ONE_OUT)  # 3 full pages cached, unheld
    long_request = engine.add_request(tokens(200, 33), SamplingParams(max_tokens=16, ignore_eos=True))
    engine.step()  # running: 9 pages now, 12 by its end
    queued = engine.add_request(shared + tokens(300, 4), ONE_OUT)  # waits, its 3 cached pages reserved
    assert engine.kv_cache.num_free_pages == 2
    outputs: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        outputs.update((output.request_id, output) for output in engine.step() if output.finished)
    assert len(outputs[long_request].token_ids) == 16
    stats = {**engine.session_stats(), **pin_stats(engine)}
    if with_store:  # the pin went to the store, and the queued request found all its pages
        assert (stats["pins_moved_to_store"], stats["reservations_dropped"]) == (1, 0)
        assert outputs[queued].num_cached_prompt_tokens == 12
    else:  # without a store the reservation gives way and the pin stays
        assert (stats["pins_released_by_pressure"], stats["reservations_dropped"]) == (0, 1)
        assert stats["pinned_pages"] == 2


def test_reclaim_asks_each_in_turn_for_what_is_still_short() -> None:
    asked: list[tuple[str, int]] = []

    def reclaimer(name: str, frees: int) -> Callable[[int], int]:
        def reclaim(num_pages: int) -> int:
            asked.append((name, num_pages))
            return frees

        return reclaim

    order = [reclaimer("holds", 2), reclaimer("to store", 0), reclaimer("reservations", 3), reclaimer("pins", 5)]
    assert reclaim_in_order(order, 5) == 5
    assert asked == [("holds", 5), ("to store", 3), ("reservations", 3)]


def test_the_store_connector_pins_for_the_calls_tenant() -> None:
    pinned: list[tuple[list[bytes], float | None, str | None]] = []

    class Client:
        def pin(self, keys: Sequence[bytes], ttl_s: float | None, tenant: str | None = None) -> None:
            pinned.append((list(keys), ttl_s, tenant))

    connector = StoreConnector(Client())  # type: ignore[arg-type]
    connector.pin([b"k0", b"k1"], 90.0, "alice")
    connector.pin([], 90.0, "alice")  # nothing to pin: no call
    assert pinned == [([b"k0", b"k1"], 90.0, "alice")]


def test_an_async_engine_pins_in_the_store_after_the_pages_are_saved() -> None:
    connector = PinningConnector()
    engine = make_engine(connector=connector, kv_save="async")
    prompt_a = tokens(0, 10)
    run(engine, prompt_a, retention=HOUR)
    engine.flush_saves()
    hashes_a = prefix_hashes(engine, prompt_a, 2)
    # The prompt's pages are saved once computed, the answer's at the finish; the pin follows both.
    assert [kind for kind, _ in connector.log] == ["save", "save", "pin"]
    assert connector.log[0][1] == hashes_a and connector.log[2] == ("pin", hashes_a)


# -- time, repeats, caps, tenants ---------------------------------------------------------


def test_a_pin_lapses_with_its_ttl_at_the_next_step_or_expire_call() -> None:
    clock = Clock()
    engine = make_engine(clock=clock)
    run(engine, tokens(0, 10), retention=Retention(10, 60.0))
    clock.now_s += 59.0
    assert engine.expire_holds() == 0 and pin_stats(engine)["pinned_pages"] == 2
    clock.now_s += 2.0
    assert engine.expire_holds() == 1 and engine.kv_cache.num_free_pages == 16
    run(engine, tokens(50, 10), retention=Retention(10, 5.0))
    clock.now_s += 5.0
    engine.step()  # no request: the step only lets lapsed pins go
    assert pin_stats(engine)["pins_expired"] == 2 and pin_stats(engine)["pinned_prefixes"] == 0
    assert engine.prefix_residency(tokens(50, 10))[1] == 2  # still cached, just evictable


def test_asking_again_extends_and_a_longer_prefix_takes_the_place_of_a_shorter_one() -> None:
    connector, clock = PinningConnector(), Clock()
    engine = make_engine(connector=connector, clock=clock)
    first = run(engine, tokens(0, 10), retention=Retention(10, 60.0))
    clock.now_s += 30.0
    run(engine, tokens(0, 10), retention=Retention(10, 3600.0))
    run(engine, tokens(0, 10), retention=Retention(10, 10.0))  # shorter: the later expiry stands
    assert pin_stats(engine)["pinned_prefixes"] == 1
    assert [ttl_s for _, ttl_s, _ in connector.pins] == [60.0, 3600.0, 10.0]  # the store keeps the max itself
    clock.now_s += 3000.0
    assert engine.expire_holds() == 0 and pin_stats(engine)["pinned_pages"] == 2

    # The session's next call: the old prompt and answer, then more. Its longer pin replaces the old one.
    follow_up = [*first.prompt_token_ids, *first.token_ids, *tokens(300, 3)]
    run(engine, follow_up, retention=Retention(len(follow_up), 3600.0))
    assert pin_stats(engine)["pinned_prefixes"] == 1 and pin_stats(engine)["pinned_pages"] == 4
    assert [page.ref_count for page in engine.kv_cache.pool.pages[:2]] == [1, 1]  # one pin's reference


def test_pins_over_the_cap_release_the_soonest_expiring_first() -> None:
    engine = make_engine()  # 16 pages: 8 may be pinned
    assert engine.prefix_pins.max_pages == 8
    for start, ttl_s in [(0, 100.0), (100, 300.0), (200, 200.0)]:
        run(engine, tokens(start, 13), retention=Retention(13, ttl_s))  # 3 full pages each
    assert pin_stats(engine)["pinned_prefixes"] == 2 and pin_stats(engine)["pinned_pages"] == 6
    assert pin_stats(engine)["pins_released_over_cap"] == 1
    assert run(engine, tokens(0, 13)).num_cached_prompt_tokens == 12  # released, yet still cached
    # A prefix longer than the cap is pinned up to it, and the others make room.
    run(engine, tokens(300, 41), ONE_OUT, retention=Retention(41, 1000.0))
    assert pin_stats(engine)["pinned_prefixes"] == 1 and pin_stats(engine)["pinned_pages"] == 8


def test_the_number_of_pinned_prefixes_is_capped_too() -> None:
    pool = PagePool(8)
    pages = pool.allocate(3)
    hashes = [hash_page(None, [i], "m") for i in range(3)]
    for page, page_hash in zip(pages, hashes):
        pool.cache(page, page_hash)
    pool.free(pages)
    clock = Clock()
    pins = PrefixPins(pool, PAGE, max_prefixes=2, clock=clock)
    chains: list[list[PageHash]] = [[hashes[0]], [hashes[1]], [hashes[2]]]
    assert [pins.pin(chain, ttl_s) for chain, ttl_s in zip(chains, [30.0, 10.0, 20.0])] == [1, 1, 1]
    assert pins.stats()["pinned_prefixes"] == 2 and pins.stats()["pins_released_over_cap"] == 1
    assert [page.ref_count for page in pool.pages[:3]] == [1, 0, 1]  # the 10 s pin went
    assert pins.pin([hashes[1]], 5.0) == 0  # expiring soonest of all, a new pin is the one released
    with pytest.raises(ValueError, match="max_prefixes"):
        PrefixPins(pool, PAGE, max_prefixes=0)


def test_a_tenants_pin_never_makes_another_tenants_prompt_hit() -> None:
    connector = PinningConnector()
    engine = make_engine(connector=connector)
    prompt = tokens(0, 10)
    run(engine, prompt, retention=HOUR, cache_salt="alice")
    assert connector.pins == [(prefix_hashes(engine, prompt, 2, "alice"), 3600.0, "alice")]
    bob = run(engine, prompt, cache_salt="bob")
    assert (bob.num_cached_prompt_tokens, bob.num_loaded_prompt_tokens) == (0, 0)
    assert run(engine, prompt, cache_salt="alice").num_cached_prompt_tokens == 2 * PAGE


def test_an_aborted_request_pins_nothing() -> None:
    engine = make_engine()
    engine.add_request(tokens(0, 10), THREE_OUT, request_id="r", retention=HOUR)
    engine.abort("r")
    assert engine.prefix_pins._wanted == {}
    while engine.has_unfinished_requests():
        engine.step()
    assert pin_stats(engine)["pinned_prefixes"] == 0 and engine.kv_cache.num_free_pages == 16


@pytest.mark.parametrize("salt_each_call", [False, True], ids=["tenant", "salted-calls"])
def test_over_the_cap_the_tenant_holding_most_gives_way(salt_each_call: bool) -> None:
    """A tenant flooding the pins releases its own: another tenant's pin outlives pins that expire later. Pins
    made under call salts of its own (``page_hash.salted``) are still the tenant's: salting does not dodge this."""
    pool = PagePool(8)
    pages = pool.allocate(5)
    hashes = [hash_page(None, [i], "m") for i in range(5)]
    for page, page_hash in zip(pages, hashes):
        pool.cache(page, page_hash)
    pool.free(pages)
    pins = PrefixPins(pool, PAGE, max_prefixes=3, clock=Clock())
    assert pins.pin([hashes[0]], 10.0, "alice") == 1  # expires first of all
    for i, ttl_s in zip(range(1, 5), (100.0, 200.0, 300.0, 400.0)):
        pins.pin([hashes[i]], ttl_s, salted("mallory", f"salt-{i}" if salt_each_call else None))
    assert pins.stats()["pinned_prefixes"] == 3 and pins.stats()["pins_released_over_cap"] == 2
    assert pool.pages[0].ref_count == 1  # alice's pin stays
    assert [page.ref_count for page in pool.pages[1:5]] == [0, 0, 1, 1]  # mallory's soonest went


def test_the_store_connector_pins_a_salted_calls_pages_as_its_tenants() -> None:
    pinned: list[str | None] = []

    class Client:
        def pin(self, keys: Sequence[bytes], ttl_s: float | None, tenant: str | None = None) -> None:
            pinned.append(tenant)

    connector = StoreConnector(Client())  # type: ignore[arg-type]
    connector.pin([b"k0"], 90.0, salted("alice", "s1"))
    connector.pin([b"k0"], 90.0, salted("", "s1"))  # a server without tenants: the client's own
    assert pinned == ["alice", ""]

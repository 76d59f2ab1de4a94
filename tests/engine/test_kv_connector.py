"""The engine with an external page store: loads at arrival, saves at finish, output prefixes.

A dictionary stands in for the KV store here (the real store is exercised
through the same connector in tests/cluster); what matters is that pages
moved between two engines give exactly the tokens one engine computes alone.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from rayturn.engine import LLMEngine, RequestOutput, SamplingParams
from rayturn.engine.kv_connector import StoreConnector
from rayturn.engine.kv_transfer import PREWARM_FREE_FRACTION
from rayturn.engine.page_hash import salt_owner, salted
from rayturn.engine.sequence import TokenLogprob

PAGE = 16


OWN_TENANT = "default"


class DictStore:
    """The slice of KVStoreClient a StoreConnector uses, in one dictionary; each object belongs to a tenant, and
    a call sees only its tenant's (``tenant=None``: the client's own, ``OWN_TENANT``)."""

    def __init__(self) -> None:
        self.objects: dict[bytes, bytes] = {}
        self.tenants: dict[bytes, str] = {}
        self.fail = False
        self.calls: Counter[str] = Counter()  # lookups and gets, by method
        self.located: list[int] = []  # how many keys each locate_prefix asked about

    def _has(self, key: bytes, tenant: str | None) -> bool:
        return key in self.objects and self.tenants[key] == (tenant or OWN_TENANT)

    def longest_prefix(self, keys: Sequence[bytes], tenant: str | None = None) -> int:
        self.calls["longest_prefix"] += 1
        return self._held(keys, tenant)

    def locate_prefix(self, keys: Sequence[bytes], tenant: str | None = None) -> DictPrefix:
        self.calls["locate_prefix"] += 1
        self.located.append(len(keys))
        return DictPrefix(list(keys[: self._held(keys, tenant)]), tenant)

    def _held(self, keys: Sequence[bytes], tenant: str | None) -> int:
        if self.fail:
            raise ConnectionError("store unreachable")
        count = 0
        for key in keys:
            if not self._has(key, tenant):
                break
            count += 1
        return count

    def get_prefix_into(self, prefix: DictPrefix, buffers: Sequence[object]) -> list[bool]:
        assert len(buffers) <= prefix.num_keys
        self.calls["get_prefix_into"] += 1
        return self._land(prefix.keys[: len(buffers)], buffers, prefix.tenant)

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[object], tenant: str | None = None) -> list[bool]:
        self.calls["get_into"] += 1
        return self._land(keys, buffers, tenant)

    def _land(self, keys: Sequence[bytes], buffers: Sequence[object], tenant: str | None) -> list[bool]:
        landed = []
        for key, buffer in zip(keys, buffers):
            assert isinstance(buffer, torch.Tensor)
            found = self._has(key, tenant)
            if found:
                data = bytearray(self.objects[key])
                buffer.view(torch.uint8).reshape(-1).copy_(torch.frombuffer(data, dtype=torch.uint8))
            landed.append(found)
        return landed

    def put_batch(
        self,
        keys: Sequence[bytes],
        values: Sequence[object],
        replicas: int = 1,
        pin_ttl_s: float | None = None,
        tenant: str | None = None,
    ) -> list[bool]:
        for key, value in zip(keys, values):
            assert isinstance(value, torch.Tensor)
            self.objects.setdefault(key, value.contiguous().view(torch.uint8).numpy().tobytes())
            self.tenants.setdefault(key, tenant or OWN_TENANT)
        return [True] * len(keys)


@dataclass
class DictPrefix:
    keys: list[bytes]
    tenant: str | None

    @property
    def num_keys(self) -> int:
        return len(self.keys)


def make_engine(store: DictStore | None, kv_save: str = "sync") -> LLMEngine:
    connector = StoreConnector(store) if store is not None else None
    return LLMEngine.from_pretrained(
        "tiny", backend="torch", dtype="float32", page_size=PAGE, kv_connector=connector, kv_save=kv_save
    )


GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPT = [(7 * i + 3) % 200 + 3 for i in range(70)]  # 4 full pages + 6 tokens


@pytest.fixture(scope="module")
def reference() -> list[int]:
    return make_engine(None).generate([PROMPT], GREEDY)[0].token_ids


def test_pages_saved_by_one_engine_serve_another(reference: list[int]) -> None:
    store = DictStore()
    first = make_engine(store).generate([PROMPT], GREEDY)[0]
    assert first.token_ids == reference
    # Prompt and output pages that were computed are published: 79 computed tokens -> 4 full pages.
    assert len(store.objects) == (len(PROMPT) + len(reference) - 1) // PAGE
    second = make_engine(store).generate([PROMPT], GREEDY)[0]
    assert second.token_ids == reference
    assert second.num_cached_prompt_tokens == 64
    assert second.num_loaded_prompt_tokens == 64


def test_disaggregated_prefill_then_decode_matches_one_engine(reference: list[int]) -> None:
    store = DictStore()
    prefill = make_engine(store)
    first = prefill.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))[0]
    assert first.token_ids == reference[:1]
    assert len(store.objects) == 4  # the prompt's full pages

    decode = make_engine(store)
    decode.add_request(PROMPT, GREEDY, request_id="r", output_prefix=first.token_ids)
    outputs = []
    while decode.has_unfinished_requests():
        outputs.extend(decode.step())
    final = outputs[-1]
    assert final.finished and final.token_ids == reference
    assert final.num_loaded_prompt_tokens == 64
    assert final.text == decode.tokenizer.decode(reference)


def test_a_load_asks_the_store_once_where_the_prefix_is_and_lands_it_without_asking_again(
    reference: list[int],
) -> None:
    store = DictStore()
    make_engine(store).generate([PROMPT], GREEDY)
    store.calls.clear()
    engine = make_engine(store)
    output = engine.generate([PROMPT], GREEDY)[0]
    assert output.token_ids == reference and output.num_loaded_prompt_tokens == len(PROMPT) // PAGE * PAGE
    # One lookup answered how much is there and where; the load used it: no longest_prefix, no get_into.
    assert store.calls == {"locate_prefix": 1, "get_prefix_into": 1}


def test_a_load_looks_up_no_more_pages_than_the_cache_could_take() -> None:
    store = DictStore()
    engine = make_engine(store)
    assert engine.kv_transfer is not None
    pool = engine.kv_cache.pool
    hashes = [i.to_bytes(8, "big") for i in range(pool.num_pages + 40)]
    # An unannounced prewarm leaves a quarter of the pool free and reclaims nothing: it asks for what fits.
    assert engine.kv_transfer.load_for_prewarm(hashes, "", announced=False) == 0
    assert store.located == [pool.num_allocatable - int(pool.num_pages * PREWARM_FREE_FRACTION)]
    # A call's arrival (or an announced prewarm) may reclaim idle holds: at most the whole pool.
    assert engine.kv_transfer.load_for_prewarm(hashes, "", announced=True) == 0
    assert store.located[1] == pool.num_pages


def test_a_partial_or_failing_store_only_costs_compute(reference: list[int]) -> None:
    store = DictStore()
    make_engine(store).generate([PROMPT], GREEDY)
    keys = list(store.objects)
    for key in keys[2:]:  # keep the first two pages only
        del store.objects[key]
    partial = make_engine(store).generate([PROMPT], GREEDY)[0]
    assert partial.token_ids == reference and partial.num_loaded_prompt_tokens == 32

    store.fail = True
    failing = make_engine(store).generate([PROMPT], GREEDY)[0]
    assert failing.token_ids == reference and failing.num_loaded_prompt_tokens == 0


def test_output_prefix_that_already_finishes_the_request() -> None:
    engine = make_engine(None)
    engine.add_request(PROMPT, SamplingParams(max_tokens=1, temperature=0.0), request_id="done", output_prefix=[42])
    (output,) = engine.step()
    assert output.finished and output.token_ids == [42] and output.finish_reason == "length"
    assert not engine.has_unfinished_requests()


def test_output_prefix_that_fills_the_context_finishes_on_arrival() -> None:
    """A prompt one token short of max_model_len, with the prefill replica's first token: the answer is that
    token, cut at the context ("length"); a prefix past the context is refused."""
    engine = LLMEngine.from_pretrained("tiny", backend="torch", dtype="float32", page_size=PAGE, max_model_len=128)
    prompt = [(5 * i + 1) % 200 + 3 for i in range(127)]
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), request_id="full", output_prefix=[42])
    (output,) = engine.step()
    assert output.finished and output.token_ids == [42] and output.finish_reason == "length"
    engine.add_request(prompt, GREEDY, request_id="longer", output_prefix=[42])  # max_tokens 10: the context cuts it
    (output,) = engine.step()
    assert output.finished and output.token_ids == [42] and output.finish_reason == "length"
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="prompt plus output_prefix is 129 tokens; max_model_len is 128"):
        engine.add_request(prompt, GREEDY, output_prefix=[42, 43])


def test_output_prefix_bad_input() -> None:
    engine = make_engine(None)
    with pytest.raises(ValueError, match="output_prefix token ids out of vocabulary"):
        engine.add_request(PROMPT, GREEDY, output_prefix=[10**6])
    with pytest.raises(ValueError, match="n > 1"):
        engine.add_request(PROMPT, SamplingParams(max_tokens=4, n=2), output_prefix=[5])
    with pytest.raises(ValueError, match="output_prefix_logprobs"):
        engine.add_request(PROMPT, GREEDY, output_prefix=[5], output_prefix_logprobs=[])


def test_load_stats_and_cached_hashes() -> None:
    engine = make_engine(None)
    engine.add_request(PROMPT, GREEDY, request_id="a")
    stats = engine.load_stats()
    assert stats["queued_prompt_tokens"] == len(PROMPT) and stats["waiting_seqs"] == 1
    assert stats["total_pages"] == engine.num_pages and stats["max_num_seqs"] == 64
    while engine.has_unfinished_requests():
        engine.step()
    hashes = engine.cached_page_hashes(3)
    assert len(hashes) == 3 and all(len(h) == 32 for h in hashes)
    assert engine.load_stats()["running_seqs"] == 0


def test_background_saves_publish_pages_and_release_them(reference: list[int]) -> None:
    store = DictStore()
    engine = make_engine(store, kv_save="async")
    assert engine.generate([PROMPT], GREEDY)[0].token_ids == reference
    engine.flush_saves()
    assert len(store.objects) == (len(PROMPT) + len(reference) - 1) // PAGE
    assert engine.kv_cache.num_free_pages == engine.num_pages  # the save's page references are gone
    second = make_engine(store).generate([PROMPT], GREEDY)[0]
    assert second.token_ids == reference and second.num_loaded_prompt_tokens == 64
    with pytest.raises(ValueError, match="kv_save"):
        make_engine(store, kv_save="later")


def test_short_misses_are_computed_unless_a_remote_prefill_made_them(reference: list[int]) -> None:
    store = DictStore()
    make_engine(store).generate([PROMPT], GREEDY)
    connector = StoreConnector(store)
    engine = LLMEngine.from_pretrained("tiny", page_size=PAGE, kv_connector=connector, kv_load_min_tokens=128)
    # 64 missing tokens < 128: computed here, the store is not asked.
    assert engine.generate([PROMPT], GREEDY)[0].num_loaded_prompt_tokens == 0
    fresh = LLMEngine.from_pretrained("tiny", page_size=PAGE, kv_connector=connector, kv_load_min_tokens=128)
    fresh.add_request(PROMPT, GREEDY, request_id="p", output_prefix=reference[:1])
    outputs = []
    while fresh.has_unfinished_requests():
        outputs.extend(fresh.step())
    assert outputs[-1].num_loaded_prompt_tokens == 64 and outputs[-1].token_ids == reference


def run_salted(engine: LLMEngine, params: SamplingParams, request_id: str, salt: str) -> RequestOutput:
    """``PROMPT`` run to its end under ``salt``; its final output."""
    engine.add_request(PROMPT, params, request_id, cache_salt=salt)
    outputs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (final,) = [output for output in outputs if output.finished]
    return final


def test_a_tenants_pages_are_stored_as_its_own_and_never_load_for_another() -> None:
    store = DictStore()
    writer, reader = make_engine(store), make_engine(store)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    expected = writer.generate([PROMPT], params)[0].token_ids  # no tenant: the client's own
    run_salted(writer, params, "alice-1", "alice")
    alice_keys = {key for key, tenant in store.tenants.items() if tenant == "alice"}
    assert len(alice_keys) == len(PROMPT) // PAGE and set(store.tenants.values()) == {OWN_TENANT, "alice"}
    for salt in ("bob", "alice"):
        final = run_salted(reader, params, f"{salt}-read", salt)
        assert final.completions[0].token_ids == expected
        # bob's salt names other pages, and the store would not hand alice's to bob anyway.
        assert final.num_loaded_prompt_tokens == (0 if salt == "bob" else len(alice_keys) * PAGE)


def test_a_calls_own_salt_keeps_its_pages_apart_within_its_tenant_yet_stores_them_as_the_tenants() -> None:
    store = DictStore()
    writer, reader = make_engine(store), make_engine(store)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    expected = writer.generate([PROMPT], params)[0].token_ids
    for salt in ("alice", salted("alice", "s1")):
        run_salted(writer, params, f"write-{salt}", salt)
    # Both sets of pages are alice's in the store (her quota, her lookups), under different keys.
    assert Counter(store.tenants.values()) == {OWN_TENANT: 4, "alice": 8}
    for salt, loaded in [
        (salted("alice", "s2"), 0),  # another salt of the same tenant
        (salted("bob", "s1"), 0),  # the same salt of another tenant
        (salted("", "s1"), 0),  # the same salt with no tenant (the client's own)
        (salted("alice", "s1"), len(PROMPT) // PAGE * PAGE),
    ]:
        final = run_salted(reader, params, f"read-{salt}", salt)
        assert final.completions[0].token_ids == expected
        assert (final.num_loaded_prompt_tokens, final.num_cached_prompt_tokens) == (loaded, loaded), salt


def test_a_salt_names_its_tenant_and_no_two_tenant_and_salt_pairs_share_one() -> None:
    call_salts = [None, "s", "s\nwith a line break", "alice", "alice\nx"]
    pairs = {
        (tenant, call_salt): salted(tenant, call_salt)
        for tenant in ("", "alice", "team.a-1")
        for call_salt in call_salts
    }
    assert len(set(pairs.values())) == len(pairs)
    for (tenant, call_salt), salt in pairs.items():
        assert salt_owner(salt) == tenant
        assert (salt == tenant) is (call_salt is None)  # no salt of its own: the tenant's pages
    assert salted("alice", "") == "alice"


def test_a_request_scoring_its_prompt_loads_nothing_but_still_publishes(reference: list[int]) -> None:
    store = DictStore()
    make_engine(store).generate([PROMPT], GREEDY)
    scoring = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    expected = make_engine(None).generate([PROMPT], scoring)[0].prompt_logprobs
    assert expected is not None and len(expected) == len(PROMPT)

    engine = make_engine(store)
    out = engine.generate([PROMPT], scoring)[0]
    assert out.token_ids == reference and same_scores(out.prompt_logprobs, expected)
    assert (out.num_cached_prompt_tokens, out.num_loaded_prompt_tokens) == (0, 0)
    again = engine.generate([PROMPT], GREEDY)[0]  # the pages it computed are cached here now
    assert (again.num_cached_prompt_tokens, again.num_loaded_prompt_tokens) == (64, 0)

    # A remote prefill's decode half that wants prompt logprobs computes the prompt itself too.
    decode = make_engine(store)
    decode.add_request(PROMPT, scoring, request_id="r", output_prefix=reference[:1])
    outputs = []
    while decode.has_unfinished_requests():
        outputs.extend(decode.step())
    final = outputs[-1]
    assert final.token_ids == reference and same_scores(final.prompt_logprobs, expected)
    assert final.num_loaded_prompt_tokens == 0


def same_scores(got: tuple[TokenLogprob | None, ...] | None, expected: tuple[TokenLogprob | None, ...]) -> bool:
    """The same tokens and alternatives, with log probabilities equal up to float noise."""
    assert got is not None and len(got) == len(expected) and got[0] is expected[0] is None
    for ours, theirs in zip(got[1:], expected[1:]):
        assert ours is not None and theirs is not None
        assert (ours.token_id, [t for t, _ in ours.top]) == (theirs.token_id, [t for t, _ in theirs.top])
        assert [ours.logprob, *(v for _, v in ours.top)] == pytest.approx(
            [theirs.logprob, *(v for _, v in theirs.top)], abs=1e-5
        )
    return True


def test_async_saves_publish_the_prompt_before_the_answer_ends_and_another_engine_resumes_it(
    reference: list[int],
) -> None:
    store = DictStore()
    engine = make_engine(store, kv_save="async")
    engine.add_request(PROMPT, GREEDY, request_id="r")
    streamed: list[int] = []
    while len(streamed) < 3:
        (output,) = engine.step()
        streamed = output.token_ids
    engine.flush_saves()
    assert not output.finished and streamed == reference[:3]
    # The prompt's 4 full pages are in the store while the answer is still being decoded.
    assert len(store.objects) == len(PROMPT) // PAGE

    # The engine is lost; another continues after the streamed tokens from the stored prompt pages.
    other = make_engine(store)
    other.add_request(PROMPT, GREEDY, request_id="r-resumed", output_prefix=streamed)
    outputs = []
    while other.has_unfinished_requests():
        outputs.extend(other.step())
    final = outputs[-1]
    assert final.finished and final.token_ids == reference
    assert final.num_loaded_prompt_tokens == 64

"""A prompt's page hashes computed by the serving layer are trusted: the engine never hashes those pages again.

Every page hash the engine makes goes through ``page_hash.hash_page`` (via
``hash_pages``, which looks it up in its module at call time), so a recorder
patched in there sees each one. Pages are 16 tokens; the 70-token prompt has
4 full pages, all of them matchable (the last token is always computed).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch

from rayturn.engine import LLMEngine, RequestOutput, SamplingParams
from rayturn.engine import page_hash as page_hash_module
from rayturn.engine.page_hash import PageHash, hash_pages

PAGE = 16
PROMPT = [(7 * i + 3) % 200 + 3 for i in range(70)]
# 70 + 30 tokens, 99 computed: 6 full pages, the last two grown by decoding.
GREEDY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


class DictConnector:
    """A KVConnector over one dictionary of page copies; records the keys of every load and save."""

    def __init__(self) -> None:
        self.pages: dict[bytes, torch.Tensor] = {}
        self.loaded: list[bytes] = []
        self.saved: list[bytes] = []

    def longest_prefix(self, keys: Sequence[bytes], tenant: str = "") -> int:
        count = 0
        while count < len(keys) and keys[count] in self.pages:
            count += 1
        return count

    def load(self, keys: Sequence[bytes], pages: Sequence[torch.Tensor], tenant: str = "") -> list[bool]:
        for key, page in zip(keys, pages):
            self.loaded.append(key)
            page.copy_(self.pages[key])
        return [True] * len(keys)

    def save(self, keys: Sequence[bytes], pages: Sequence[torch.Tensor], tenant: str = "") -> list[bool]:
        for key, page in zip(keys, pages):
            self.saved.append(key)
            self.pages.setdefault(key, page.clone())
        return [True] * len(keys)


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[PageHash]]:
    """Every page hash computed while the test runs, in order."""
    made: list[PageHash] = []
    original = page_hash_module.hash_page

    def recording(parent: PageHash | None, token_ids: Sequence[int], model_id: str, salt: str = "") -> PageHash:
        made.append(original(parent, token_ids, model_id, salt))
        return made[-1]

    monkeypatch.setattr(page_hash_module, "hash_page", recording)
    yield made


def make_engine(connector: DictConnector | None = None) -> LLMEngine:
    return LLMEngine.from_pretrained("tiny", backend="torch", dtype="float32", page_size=PAGE, kv_connector=connector)


def prompt_hashes(engine: LLMEngine, salt: str = "", num_pages: int = 4) -> list[PageHash]:
    """What the ingress computes: ``hash_pages`` over the prompt's usable pages."""
    usable = (len(PROMPT) - 1) // PAGE
    return hash_pages(PROMPT[: usable * PAGE], PAGE, engine.model_id, salt)[:num_pages]


def run(engine: LLMEngine, page_hashes: list[PageHash] | None, **kwargs: object) -> RequestOutput:
    request_id = engine.add_request(PROMPT, GREEDY, page_hashes=page_hashes, **kwargs)  # type: ignore[arg-type]
    while True:
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output


def test_given_hashes_are_not_recomputed_in_admission_or_generation(hashed: list[PageHash]) -> None:
    reference_engine = make_engine()
    given = prompt_hashes(reference_engine)
    hashed.clear()
    reference = run(reference_engine, None, session_id="s")
    # Without hashes, the engine hashes each prompt page once, then the two decode-grown pages.
    assert hashed[:4] == given and len(hashed) == 6

    engine = make_engine()
    hashed.clear()
    output = run(engine, given, session_id="s")
    assert output.token_ids == reference.token_ids and output.text == reference.text
    assert len(hashed) == 2 and not set(hashed) & set(given)  # only the grown pages
    assert [engine.kv_cache.pool.pages[i].page_hash for i in range(4)] == given
    assert engine.session_residency("s") == (6, 6)


def test_a_partial_list_hashes_only_the_pages_after_it(hashed: list[PageHash]) -> None:
    reference = run(make_engine(), None)
    engine = make_engine()
    given = prompt_hashes(engine, num_pages=2)
    full = prompt_hashes(engine)
    hashed.clear()
    output = run(engine, given)
    assert output.token_ids == reference.token_ids
    assert hashed[:2] == full[2:] and len(hashed) == 4


def test_store_load_and_save_use_the_given_hashes(hashed: list[PageHash]) -> None:
    connector = DictConnector()
    writer = make_engine(connector)
    given = prompt_hashes(writer, salt="alice")
    reference = run(make_engine(), None, cache_salt="alice")
    hashed.clear()
    written = run(writer, given, cache_salt="alice")
    assert written.token_ids == reference.token_ids
    assert connector.saved[:4] == given and len(connector.saved) == 6  # the prompt's pages and the grown ones
    assert len(hashed) == 2 and not set(hashed) & set(given)

    reader = make_engine(connector)
    hashed.clear()
    loaded = run(reader, given, cache_salt="alice")
    assert loaded.token_ids == reference.token_ids
    assert loaded.num_loaded_prompt_tokens == 4 * PAGE and connector.loaded == given
    # Only the grown pages are hashed; they are all the reader sends (the loaded ones came from the store).
    assert len(hashed) == 2 and not set(hashed) & set(given) and connector.saved[6:] == hashed


def test_prefix_residency_trusts_the_given_hashes(hashed: list[PageHash]) -> None:
    engine = make_engine()
    run(engine, None)
    given = prompt_hashes(engine)
    hashed.clear()
    assert engine.prefix_residency(PROMPT, page_hashes=given) == (given, 4)
    assert hashed == []
    assert engine.prefix_residency(PROMPT, page_hashes=given[:1]) == (given, 4)
    assert hashed == given[1:]
    hashed.clear()
    assert engine.prefix_residency(PROMPT) == (given, 4) and hashed == given


def test_prefix_residency_takes_hashes_of_every_full_page() -> None:
    engine = make_engine()
    prompt = PROMPT[:64]  # 4 full pages, of which 3 are matchable (the last token is always computed)
    every_page = hash_pages(prompt, PAGE, engine.model_id)
    assert engine.prefix_residency(prompt, page_hashes=every_page) == (every_page[:3], 0)


def test_more_hashes_than_full_pages_is_an_error() -> None:
    engine = make_engine()
    too_many = hash_pages(PROMPT + [5] * 10, PAGE, engine.model_id)  # 5 pages for a prompt that fills 4
    with pytest.raises(ValueError, match="page_hashes has 5 entries"):
        engine.add_request(PROMPT, GREEDY, page_hashes=too_many)
    with pytest.raises(ValueError, match="page_hashes has 5 entries"):
        engine.prefix_residency(PROMPT, page_hashes=too_many)
    assert not engine.has_unfinished_requests()

"""Speculative decoding changes nothing in the output: greedy equals transformers and the unspeculated engine,
with drafts really accepted, across batch compositions, chunked prefill, prefix caching, stops, logprobs,
seeds and streaming."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hf_models import VOCAB_SIZE, make_hf_checkpoint

from rayturn.engine import LLMEngine, RequestOutput, SamplingParams
from rayturn.engine.scheduler import SchedulerOutput
from rayturn.engine.speculative import SpeculativeConfig

transformers = pytest.importorskip("transformers")

MAX_NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)


def make_prompts() -> list[list[int]]:
    """Short looping prompts, random ones, and two long ones for chunked prefill."""
    rng = random.Random(5)
    loop = [rng.randrange(VOCAB_SIZE) for _ in range(9)]
    return [
        loop * 4,
        [rng.randrange(VOCAB_SIZE) for _ in range(7)],
        (loop[3:] + [11, 12]) * 3,
        [rng.randrange(VOCAB_SIZE) for _ in range(40)],
        [rng.randrange(VOCAB_SIZE) for _ in range(300)],
        [rng.randrange(VOCAB_SIZE) for _ in range(260)],
    ]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> list[list[int]]:
    """transformers' greedy continuations of the prompts, then of prompt 0 followed by its continuation."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32).eval()
    prompts = make_prompts()
    outputs: list[list[int]] = []
    with torch.no_grad():
        for prompt in [*prompts, []]:
            prompt = prompt or prompts[0] + outputs[0] + [1, 2]  # the session's next call holds the last output
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[RequestOutput], list[bool]]:
    """Step the prompts to completion; the outputs, and per step whether it verified a draft beside a prompt chunk."""
    ids = [engine.add_request(prompt, params, session_id="s") for prompt in prompts]
    finished: dict[str, RequestOutput] = {}
    mixed: list[bool] = []
    schedule = engine.scheduler.schedule

    def watched() -> SchedulerOutput:
        out = schedule()
        assert out.num_tokens <= engine.scheduler.config.max_num_batched_tokens
        drafts = any(chunk.draft for chunk in out.chunks)
        mixed.append(drafts and any(chunk.num_tokens > 1 for chunk in out.chunks))
        return out

    engine.scheduler.schedule = watched  # type: ignore[method-assign]
    try:
        while len(finished) < len(ids):
            finished.update((out.request_id, out) for out in engine.step() if out.finished)
    finally:
        del engine.scheduler.schedule
    return [finished[request_id] for request_id in ids], mixed


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["cache-on", "cache-off"])
def test_greedy_equals_transformers_with_drafts_accepted(
    checkpoint: Path, reference: list[list[int]], prefix_caching: bool
) -> None:
    engine = LLMEngine.from_pretrained(
        str(checkpoint),
        backend="torch",
        page_size=16,
        max_num_batched_tokens=64,
        enable_prefix_caching=prefix_caching,
        speculative=SpeculativeConfig(enabled=True, num_speculative_tokens=6),
    )
    *prompts, new_long = make_prompts()
    outs, mixed = run(engine, prompts, GREEDY)  # little to draft from: the model does not copy its prompt
    assert [out.token_ids for out in outs] == reference[:5]
    # The session's history holds the answers now; a new long prompt is prefilled meanwhile, chunk by chunk.
    again, mixed_again = run(engine, [*prompts[:4], new_long], GREEDY)
    assert [out.token_ids for out in again] == reference[:4] + [reference[5]]
    assert any(mixed + mixed_again), "no step verified a draft beside a chunk of the long prompt"
    stats = engine.drafter.stats
    assert stats.num_accepted_tokens >= 3 * MAX_NEW_TOKENS and stats.num_emitted_tokens > stats.num_drafts
    # The next call of the session: its prompt holds an output, whose pages the drafts' steps cached.
    (follow_up,), _ = run(engine, [prompts[0] + reference[0] + [1, 2]], GREEDY)
    assert follow_up.token_ids == reference[-1]
    if prefix_caching:
        assert follow_up.num_cached_prompt_tokens == 48  # the prompt's 2 pages, then 1 holding output tokens
    unspeculated, _ = run(engine, prompts, replace(GREEDY, speculative=False))
    assert [out.token_ids for out in unspeculated] == reference[:5]


@pytest.fixture(scope="module")
def tiny() -> LLMEngine:
    return LLMEngine.from_pretrained("tiny", backend="torch", page_size=16, speculative=SpeculativeConfig())


LOOPING = "the cat sat on the mat; " * 4


def step_texts(engine: LLMEngine, prompt: str, params: SamplingParams) -> tuple[RequestOutput, list[int]]:
    """The final output, and how many tokens each step added to it."""
    request_id = engine.add_request(prompt, params)
    growth: list[int] = []
    last = 0
    while True:
        (out,) = [out for out in engine.step() if out.request_id == request_id]
        growth.append(len(out.token_ids) - last)
        last = len(out.token_ids)
        if out.finished:
            return out, growth


def test_stop_strings_and_max_tokens_inside_accepted_drafts(tiny: LLMEngine) -> None:
    base = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    free, _ = step_texts(tiny, LOOPING, base)
    landed_inside = False
    for max_tokens in range(2, 40, 3):
        params = replace(base, max_tokens=max_tokens)
        on, growth = step_texts(tiny, LOOPING, replace(params, speculative=True))
        assert on.token_ids == free.token_ids[:max_tokens] and on.finish_reason == "length"
        landed_inside |= growth[-1] > 1
    text = free.text
    for start in range(2, len(text) - 3, 5):
        stop = text[start : start + 3]
        params = replace(base, stop=[stop])
        off, _ = step_texts(tiny, LOOPING, replace(params, speculative=False))
        on, growth = step_texts(tiny, LOOPING, replace(params, speculative=True))
        assert (on.token_ids, on.text, on.finish_reason) == (off.token_ids, off.text, "stop")
        landed_inside |= growth[-1] > 1
    assert landed_inside, "no stop came in a step that emitted several tokens"


def test_logprobs_match_the_unspeculated_ones(tiny: LLMEngine) -> None:
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=3)
    before = tiny.drafter.stats.num_accepted_tokens
    (off,) = tiny.generate([LOOPING], replace(params, speculative=False))
    (on,) = tiny.generate([LOOPING], replace(params, speculative=True))
    assert tiny.drafter.stats.num_accepted_tokens > before
    assert on.token_ids == off.token_ids
    assert on.completions[0].logprobs is not None and off.completions[0].logprobs is not None
    for got, want in zip(on.completions[0].logprobs, off.completions[0].logprobs, strict=True):
        assert got.token_id == want.token_id
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [token for token, _ in got.top] == [token for token, _ in want.top]
        assert [value for _, value in got.top] == pytest.approx([value for _, value in want.top], abs=1e-4)


def test_seeded_sampling_is_the_same_with_drafts(tiny: LLMEngine) -> None:
    before = tiny.drafter.stats.num_drafts
    for temperature in (0.3, 1.0):
        params = SamplingParams(max_tokens=40, temperature=temperature, seed=11, ignore_eos=True)
        (off,) = tiny.generate([LOOPING], replace(params, speculative=False))
        (on,) = tiny.generate([LOOPING], replace(params, speculative=True))
        assert on.token_ids == off.token_ids
    assert tiny.drafter.stats.num_drafts > before


def test_streamed_text_is_the_unspeculated_text(tiny: LLMEngine) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    (off,) = tiny.generate([LOOPING], replace(params, speculative=False))
    request_id = tiny.add_request(LOOPING, replace(params, speculative=True))
    pieces: list[str] = []
    growth: list[int] = []
    seen = ""
    done = False
    while not done:
        for out in tiny.step():
            if out.request_id == request_id:
                assert out.text.startswith(seen)
                pieces.append(out.text[len(seen) :])
                growth.append(len(out.token_ids))
                seen, done = out.text, out.finished
    assert "".join(pieces) == off.text
    assert len(growth) < len(off.token_ids)  # some steps emitted several tokens


def test_rejected_drafts_leave_no_pages_behind(tiny: LLMEngine) -> None:
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True, speculative=True)
    request_id = tiny.add_request(LOOPING, params)
    seq = tiny.requests._requests[request_id].seqs[0]
    while not seq.is_finished:
        tiny.step()
        if not seq.is_finished:
            assert (seq.num_computed_tokens + 15) // 16 <= len(seq.pages) <= (seq.num_tokens + 15) // 16
            assert seq.num_computed_tokens == seq.num_tokens - 1
            num_full = seq.num_computed_tokens // 16
            assert len(seq.page_hashes) == num_full  # hashed as they fill with confirmed tokens, never beyond
            assert all(tiny.kv_cache.pool.lookup(page_hash) is not None for page_hash in seq.page_hashes)
    assert tiny.drafter.stats.num_draft_tokens > tiny.drafter.stats.num_accepted_tokens  # some were rejected
    assert tiny.kv_cache.num_free_pages == tiny.num_pages - sum(len(s.pages) for s in tiny.scheduler.running)

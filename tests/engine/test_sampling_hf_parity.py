"""Repetition penalty, min_tokens and min_p equal Hugging Face transformers' on the same weights."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hf_models import VOCAB_SIZE, make_hf_checkpoint

from rayturn.engine import LLMEngine, SamplingParams
from rayturn.engine.logits_processors import apply_repetition_penalty
from rayturn.engine.sampler import apply_min_p

transformers = pytest.importorskip("transformers")

MAX_NEW_TOKENS = 12


def make_prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(VOCAB_SIZE) for _ in range(n)] for n in (1, 5, 17, 40)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def hf_model(checkpoint: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> LLMEngine:
    return LLMEngine.from_pretrained(str(checkpoint), backend="torch", dtype="float32", page_size=16)


def hf_greedy(model: transformers.PreTrainedModel, prompt: list[int], **generate_kwargs: object) -> list[int]:
    """transformers' greedy continuation of one prompt (no padding); no EOS unless given."""
    ids = torch.tensor([prompt])
    settings: dict[str, object] = {"max_new_tokens": MAX_NEW_TOKENS, "eos_token_id": None, **generate_kwargs}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, **settings)
    return list(out[0, len(prompt) :].tolist())


def greedy(**kwargs: object) -> SamplingParams:
    settings: dict[str, object] = {"max_tokens": MAX_NEW_TOKENS, "temperature": 0.0, "ignore_eos": True, **kwargs}
    return SamplingParams(**settings)  # type: ignore[arg-type]


# -- repetition penalty ------------------------------------------------------


@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_greedy_repetition_penalty_matches_transformers(
    engine: LLMEngine, hf_model: transformers.PreTrainedModel, penalty: float
) -> None:
    prompts = make_prompts()
    expected = [hf_greedy(hf_model, prompt, repetition_penalty=penalty) for prompt in prompts]
    outs = engine.generate(prompts, greedy(repetition_penalty=penalty))
    assert [out.token_ids for out in outs] == expected
    plain = engine.generate(prompts, greedy())
    assert [out.token_ids for out in plain] != expected  # the penalty changed something


def test_repetition_penalty_matches_transformers_processor() -> None:
    torch.manual_seed(2)
    logits = torch.randn(4, VOCAB_SIZE) * 3
    histories = [[5, 5, 9], [0, 299, 17, 17, 42, 8], [3]]
    rows, penalties = [0, 2, 3], [1.3, 0.8, 2.0]
    ours = apply_repetition_penalty(logits, rows, histories, penalties)
    for row, history, penalty in zip(rows, histories, penalties):
        processor = transformers.RepetitionPenaltyLogitsProcessor(penalty)
        theirs = processor(torch.tensor([history]), logits[row : row + 1].clone())
        assert torch.equal(ours[row : row + 1], theirs)
    assert torch.equal(ours[1], logits[1])  # a row without a penalty is left alone


def test_a_batch_mixing_penalised_and_plain_requests_matches_transformers(
    engine: LLMEngine, hf_model: transformers.PreTrainedModel
) -> None:
    prompts = make_prompts()
    penalties = [1.3, 1.0, 0.8, 1.0]
    expected = [hf_greedy(hf_model, prompt, repetition_penalty=p) for prompt, p in zip(prompts, penalties)]
    outs = engine.generate(prompts, [greedy(repetition_penalty=p) for p in penalties])
    assert [out.token_ids for out in outs] == expected


def test_penalised_logprobs_stay_raw(engine: LLMEngine) -> None:
    prompt = make_prompts()[2]
    (plain,) = engine.generate([prompt], greedy(max_tokens=1, logprobs=5))
    (penalised,) = engine.generate([prompt], greedy(max_tokens=1, logprobs=5, repetition_penalty=5.0))
    assert plain.completions[0].logprobs is not None and penalised.completions[0].logprobs is not None
    raw_top = plain.completions[0].logprobs[0].top
    top = penalised.completions[0].logprobs[0].top
    assert [token for token, _ in top] == [token for token, _ in raw_top]
    assert [value for _, value in top] == pytest.approx([value for _, value in raw_top], abs=1e-6)


# -- min_tokens --------------------------------------------------------------


def test_min_tokens_holds_back_stop_tokens_and_eos_as_transformers_min_new_tokens(
    engine: LLMEngine, hf_model: transformers.PreTrainedModel
) -> None:
    eos = sorted(engine.eos_token_ids)
    for prompt in make_prompts():
        free_run = hf_greedy(hf_model, prompt)
        stop_token = free_run[1]  # greedy hits it at step 2
        (early,) = engine.generate([prompt], greedy(ignore_eos=False, stop_token_ids=[stop_token]))
        assert early.token_ids == hf_greedy(hf_model, prompt, eos_token_id=[stop_token, *eos])
        assert early.finish_reason == "stop" and len(early.token_ids) <= 2

        min_tokens = 6
        params = greedy(ignore_eos=False, stop_token_ids=[stop_token], min_tokens=min_tokens)
        (out,) = engine.generate([prompt], params)
        assert len(out.token_ids) >= min_tokens
        assert not {stop_token, *eos} & set(out.token_ids[:min_tokens])
        expected = hf_greedy(hf_model, prompt, min_new_tokens=min_tokens, eos_token_id=[stop_token, *eos])
        assert out.token_ids == expected


def test_min_tokens_masks_eos_only_when_it_would_stop(engine: LLMEngine) -> None:
    prompt = make_prompts()[1]
    (plain,) = engine.generate([prompt], greedy())
    (held,) = engine.generate([prompt], greedy(min_tokens=MAX_NEW_TOKENS))  # ignore_eos: EOS is not masked
    assert held.token_ids == plain.token_ids


def test_stop_strings_wait_for_min_tokens(engine: LLMEngine) -> None:
    prompt = make_prompts()[3]
    (plain,) = engine.generate([prompt], greedy())
    stop_text = plain.text[:1]  # the stop string is the first character
    (early,) = engine.generate([prompt], greedy(stop=[stop_text]))
    assert early.finish_reason == "stop" and early.text == ""
    (late,) = engine.generate([prompt], greedy(stop=[stop_text], min_tokens=4))
    assert len(late.token_ids) >= 4 and late.token_ids == plain.token_ids[: len(late.token_ids)]
    # It stops where the stop string shows up again, past min_tokens.
    assert late.finish_reason == "stop" and late.text == plain.text[: plain.text.index(stop_text, 1)]


# -- min_p -------------------------------------------------------------------


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 0.9, 1.0])
def test_min_p_filter_matches_transformers_warper(min_p: float) -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB_SIZE) * 3
    ours = apply_min_p(logits, [min_p] * logits.shape[0])
    theirs = transformers.MinPLogitsWarper(min_p)(None, logits.clone())
    assert torch.equal(ours.isinf(), theirs.isinf())
    assert torch.equal(ours[~ours.isinf()], theirs[~theirs.isinf()])


def test_min_p_filter_takes_each_rows_own_value() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, VOCAB_SIZE) * 3
    min_ps = [0.0, 0.2, 0.7]
    ours = apply_min_p(logits, min_ps)
    for row, min_p in enumerate(min_ps):
        theirs = transformers.MinPLogitsWarper(min_p)(None, logits[row : row + 1].clone())
        assert torch.equal(ours[row : row + 1].isinf(), theirs.isinf())


def test_min_p_one_leaves_only_the_top_token(engine: LLMEngine) -> None:
    prompts = make_prompts()
    expected = [out.token_ids for out in engine.generate(prompts, greedy())]
    sampled = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=1.5, seed=7, ignore_eos=True)
    outs = engine.generate(prompts, sampled)
    assert [out.token_ids for out in outs] != expected  # plain sampling strays from greedy
    only_top = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=1.5, seed=7, ignore_eos=True, min_p=1.0)
    outs = engine.generate(prompts, only_top)
    assert [out.token_ids for out in outs] == expected

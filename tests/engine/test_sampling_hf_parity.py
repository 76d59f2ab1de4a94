"""Repetition penalty, logit bias, frequency and presence penalties, min_tokens, min_p, and vLLM's allowed token ids
and bad words equal Hugging Face transformers' on the same weights (for the frequency and presence penalties,
transformers' logits with OpenAI's published formula applied to them; for the bad words, transformers' processor
where it and vLLM agree: vLLM looks at the output only)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hf_models import VOCAB_SIZE, make_hf_checkpoint
from openai_penalties import OpenAIPenalties

from rayturn.engine import LLMEngine, SamplingParams
from rayturn.engine.logits_processors import (
    apply_logit_bias,
    apply_output_penalties,
    apply_repetition_penalty,
    banned_tokens,
)
from rayturn.engine.sampler import apply_min_p
from rayturn.engine.sequence import Sequence

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


# -- logit bias, frequency and presence penalties ------------------------------


def hf_penalised(
    model: transformers.PreTrainedModel, prompt: list[int], frequency: float, presence: float, **kwargs: object
) -> list[int]:
    processors = transformers.LogitsProcessorList([OpenAIPenalties(len(prompt), {}, frequency, presence)])
    return hf_greedy(model, prompt, logits_processor=processors, **kwargs)


BIASES = {3: 6.0, 17: -100.0, 42: 2.5, VOCAB_SIZE - 1: 100.0}


def test_logit_bias_matches_transformers_sequence_bias_processor() -> None:
    torch.manual_seed(3)
    logits = torch.randn(3, VOCAB_SIZE) * 3
    rows, biases = [0, 2], [{5: 1.5, 9: -3.0}, {0: 100.0, VOCAB_SIZE - 1: -100.0, 7: 0.25}]
    ours = apply_logit_bias(logits, rows, [tuple(b.items()) for b in biases])
    for row, bias in zip(rows, biases):
        processor = transformers.SequenceBiasLogitsProcessor({(token,): value for token, value in bias.items()})
        theirs = processor(torch.tensor([[1, 2]]), logits[row : row + 1].clone())
        assert torch.equal(ours[row : row + 1], theirs)
    assert torch.equal(ours[1], logits[1])  # a row without a bias is left alone


def test_greedy_logit_bias_matches_transformers(engine: LLMEngine, hf_model: transformers.PreTrainedModel) -> None:
    prompts = make_prompts()
    sequence_bias = {(token,): value for token, value in BIASES.items()}
    expected = [hf_greedy(hf_model, prompt, sequence_bias=sequence_bias) for prompt in prompts]
    outs = engine.generate(prompts, greedy(logit_bias=BIASES))
    assert [out.token_ids for out in outs] == expected
    assert all(out.token_ids == [VOCAB_SIZE - 1] * MAX_NEW_TOKENS for out in outs)  # +100 all but forces it
    banned = {token for token, value in BIASES.items() if value > 0}
    outs = engine.generate(prompts, greedy(logit_bias={token: -100.0 for token in banned}))
    expected = [hf_greedy(hf_model, prompt, sequence_bias={(t,): -100.0 for t in banned}) for prompt in prompts]
    assert [out.token_ids for out in outs] == expected
    assert not banned & {token for out in outs for token in out.token_ids}


def test_output_penalties_follow_openais_formula() -> None:
    torch.manual_seed(4)
    logits = torch.randn(3, VOCAB_SIZE) * 3
    rows, outputs = [0, 2], [[5, 5, 9, 5], [VOCAB_SIZE - 1]]
    frequencies, presences = [0.5, -1.0], [1.5, 2.0]
    ours = apply_output_penalties(logits, rows, outputs, frequencies, presences)
    expected = logits.clone()
    expected[0, 5] -= 3 * 0.5 + 1.5
    expected[0, 9] -= 0.5 + 1.5
    expected[2, VOCAB_SIZE - 1] -= -1.0 + 2.0
    assert torch.allclose(ours, expected, atol=0, rtol=1e-6)
    assert torch.equal(ours[1], logits[1])


@pytest.mark.parametrize(("frequency", "presence"), [(1.5, 0.0), (0.0, 2.0), (0.7, 0.4), (-2.0, 0.0)])
def test_greedy_frequency_and_presence_penalties_match_transformers_with_openais_formula(
    engine: LLMEngine, hf_model: transformers.PreTrainedModel, frequency: float, presence: float
) -> None:
    prompts = make_prompts()
    expected = [hf_penalised(hf_model, prompt, frequency, presence) for prompt in prompts]
    params = greedy(frequency_penalty=frequency, presence_penalty=presence)
    outs = engine.generate(prompts, params)
    assert [out.token_ids for out in outs] == expected
    plain = engine.generate(prompts, greedy())
    assert [out.token_ids for out in plain] != expected  # the penalty changed something


def test_all_logit_changes_together_apply_in_vllms_order(
    engine: LLMEngine, hf_model: transformers.PreTrainedModel
) -> None:
    """The bias first, then the repetition penalty (transformers' order too), then frequency and presence."""
    prompts = make_prompts()
    bias = {3: 4.0, 42: -2.0, 100: 3.0}
    sequence_bias = {(token,): value for token, value in bias.items()}
    expected = [
        hf_penalised(hf_model, prompt, 0.6, 0.3, repetition_penalty=1.4, sequence_bias=sequence_bias)
        for prompt in prompts
    ]
    params = [greedy(), greedy(logit_bias=bias, repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=0.3)]
    outs = engine.generate(prompts + prompts, [params[0]] * len(prompts) + [params[1]] * len(prompts))
    assert [out.token_ids for out in outs[len(prompts) :]] == expected
    assert [out.token_ids for out in outs[: len(prompts)]] == [hf_greedy(hf_model, prompt) for prompt in prompts]


def test_biased_and_penalised_logprobs_stay_raw(engine: LLMEngine) -> None:
    prompt = make_prompts()[2]
    (plain,) = engine.generate([prompt], greedy(max_tokens=1, logprobs=5))
    (changed,) = engine.generate(
        [prompt], greedy(max_tokens=2, logprobs=5, logit_bias={7: 100.0}, frequency_penalty=2.0, presence_penalty=2.0)
    )
    assert changed.token_ids == [7, 7]
    assert plain.completions[0].logprobs is not None and changed.completions[0].logprobs is not None
    raw, first = plain.completions[0].logprobs[0], changed.completions[0].logprobs[0]
    assert [token for token, _ in first.top] == [token for token, _ in raw.top]
    assert [value for _, value in first.top] == pytest.approx([value for _, value in raw.top], abs=1e-6)
    # The sampled token's own logprob is the model's, as the prompt's logprob of the same token after that prompt.
    (scored,) = engine.generate([[*prompt, 7]], greedy(max_tokens=1, prompt_logprobs=0))
    assert scored.prompt_logprobs is not None and scored.prompt_logprobs[-1] is not None
    assert first.logprob == pytest.approx(scored.prompt_logprobs[-1].logprob, abs=1e-5)


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


# -- allowed token ids and bad words (vLLM's) ----------------------------------


def test_greedy_allowed_token_ids_match_transformers_prefix_allowed_tokens(
    engine: LLMEngine, hf_model: transformers.PreTrainedModel
) -> None:
    prompts = make_prompts()
    free = [out.token_ids for out in engine.generate(prompts, greedy())]
    # Each prompt's allowed set leaves out its free run's first token, so the filter must change the answer.
    allowed = [sorted({3, 17, 42, 99, *run[2:6]} - {run[0]}) for run in free]
    expected = [
        hf_greedy(hf_model, prompt, prefix_allowed_tokens_fn=lambda _batch, _ids, ids=ids: ids)
        for prompt, ids in zip(prompts, allowed)
    ]
    # One batch: two rows filtered, two free (their own free runs).
    params = [greedy(allowed_token_ids=ids) if i % 2 == 0 else greedy() for i, ids in enumerate(allowed)]
    outs = [out.token_ids for out in engine.generate(prompts, params)]
    assert outs[0] == expected[0] and outs[2] == expected[2]
    assert outs[1] == free[1] and outs[3] == free[3]
    assert all(set(outs[i]) <= set(allowed[i]) and outs[i] != free[i] for i in (0, 2))


def test_sampled_and_forked_answers_keep_to_the_allowed_tokens(engine: LLMEngine) -> None:
    allowed = [5, 6, 7, 250]
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=1.5, seed=3, n=3, allowed_token_ids=allowed)
    (out,) = engine.generate([make_prompts()[3]], params)
    assert len(out.completions) == 3
    for completion in out.completions:
        assert len(completion.token_ids) == MAX_NEW_TOKENS and set(completion.token_ids) <= set(allowed)
    assert len({tuple(completion.token_ids) for completion in out.completions}) > 1  # still sampled


def bad_words_for(prompt: list[int], free_run: list[int]) -> list[list[int]]:
    """A one-token word (the free run's 5th token) and a two-token word (its 2nd and 3rd, whose first token is
    not the prompt's last: transformers also looks into the prompt, vLLM only into the output)."""
    start = next(i for i in range(1, MAX_NEW_TOKENS - 1) if free_run[i] != prompt[-1])
    return [[free_run[4]], free_run[start : start + 2]]


def test_greedy_bad_words_match_transformers_no_bad_words(
    engine: LLMEngine, hf_model: transformers.PreTrainedModel
) -> None:
    prompts = make_prompts()
    free = [out.token_ids for out in engine.generate(prompts, greedy())]
    words = [bad_words_for(prompt, run) for prompt, run in zip(prompts, free)]
    expected = [hf_greedy(hf_model, prompt, bad_words_ids=w) for prompt, w in zip(prompts, words)]
    outs = [out.token_ids for out in engine.generate(prompts, [greedy(bad_words=w) for w in words])]
    assert outs == expected
    for out, run, (single, pair) in zip(outs, free, words):
        assert out != run and single[0] not in out
        assert all(out[i : i + 2] != pair for i in range(len(out) - 1))


def test_bad_words_look_at_the_output_only_as_vllm() -> None:
    prompt = [11, 12, 13]
    seq = Sequence(0, "r", [*prompt], len(prompt), SamplingParams(bad_words=[[13, 14], [20], [12, 13, 15]]))
    assert banned_tokens(seq) == [20]  # the prompt's 13 does not start [13, 14]; nor its 12, 13 [12, 13, 15]
    seq.token_ids += [13]
    assert banned_tokens(seq) == [14, 20]
    seq.token_ids += [12, 13]
    assert banned_tokens(seq) == [14, 20, 15]


def test_masks_that_leave_nothing_give_way_to_the_allowed_tokens(engine: LLMEngine) -> None:
    """A row is never sampled from nothing: when the bad words (or min_tokens) ban every allowed token, the
    allowed tokens alone hold for that step."""
    prompt = make_prompts()[2]
    eos = min(engine.eos_token_ids)
    for temperature in (0.0, 1.0):
        params = SamplingParams(
            max_tokens=4, temperature=temperature, seed=1, ignore_eos=True, allowed_token_ids=[9], bad_words=[[9]]
        )
        (out,) = engine.generate([prompt], params)
        assert out.token_ids == [9] * 4
    (held,) = engine.generate([prompt], greedy(ignore_eos=False, allowed_token_ids=[eos], min_tokens=3))
    # EOS is sampled all the same, but it ends the answer only once min_tokens are out.
    assert held.token_ids == [eos] * 3 and held.finish_reason == "stop"


def test_filtered_requests_do_not_speculate_and_refuse_ids_beyond_the_vocabulary(engine: LLMEngine) -> None:
    drafter = engine.drafter
    assert not drafter.wants(SamplingParams(speculative=True, allowed_token_ids=[1]))
    assert not drafter.wants(SamplingParams(speculative=True, bad_words=[[1]]))
    assert drafter.wants(SamplingParams(speculative=True))
    for params in (greedy(allowed_token_ids=[1, VOCAB_SIZE]), greedy(bad_words=[[1, VOCAB_SIZE + 3]])):
        with pytest.raises(ValueError, match="out of vocabulary"):
            engine.generate([[1, 2]], params)
    for bad, field in [({"allowed_token_ids": []}, "allowed_token_ids"), ({"bad_words": [[]]}, "bad_words")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**bad)  # type: ignore[arg-type]

"""The offline engine on the ``tiny`` preset: API, sampling, stops, forks, bad input."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from rayturn.engine import LLMEngine, SamplingParams
from rayturn.engine.scheduler import SchedulerOutput, in_prompt, prefill_cap


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine.from_pretrained("tiny", backend="torch", dtype="float32", page_size=16)


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_generate_returns_one_output_per_prompt_in_order(engine: LLMEngine) -> None:
    prompts: list[str | list[int]] = ["hello world", [5, 6, 7, 8], "x" * 40]
    outs = engine.generate(prompts, GREEDY)
    assert len(outs) == 3
    for prompt, out in zip(prompts, outs):
        alone = engine.generate([prompt], GREEDY)[0]
        assert out.token_ids == alone.token_ids  # batching does not change greedy output
        assert len(out.token_ids) == 12 and out.finish_reason == "length"
        assert out.text == engine.tokenizer.decode(list(out.token_ids))


def test_num_cached_prompt_tokens_counts_prefix_hits(engine: LLMEngine) -> None:
    base = list(range(40, 40 + 50))  # 3 full pages + 2 tokens
    (first,) = engine.generate([base], GREEDY)
    (second,) = engine.generate([base + [1, 2, 3]], GREEDY)
    assert second.num_cached_prompt_tokens == 48
    assert first.num_cached_prompt_tokens in (0, 48)  # 0 unless an earlier test left it cached


def test_seed_makes_sampling_reproducible_regardless_of_batch(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234)
    (alone,) = engine.generate(["seeded prompt"], params)
    batch = engine.generate(["other", "seeded prompt", "more"], [SamplingParams(max_tokens=16), params, params])
    assert batch[1].token_ids == alone.token_ids
    (different,) = engine.generate(["seeded prompt"], SamplingParams(max_tokens=16, temperature=1.0, seed=99))
    assert different.token_ids != alone.token_ids


def test_top_k_one_and_tiny_top_p_are_greedy(engine: LLMEngine) -> None:
    (greedy,) = engine.generate(["abc"], GREEDY)
    (top_k,) = engine.generate(["abc"], SamplingParams(max_tokens=12, temperature=1.5, top_k=1, ignore_eos=True))
    (top_p,) = engine.generate(["abc"], SamplingParams(max_tokens=12, temperature=1.5, top_p=1e-6, ignore_eos=True))
    assert top_k.token_ids == greedy.token_ids == top_p.token_ids


def test_stop_token_ids_and_stop_strings(engine: LLMEngine) -> None:
    (free,) = engine.generate(["stop test"], GREEDY)
    stop_id = free.token_ids[3]
    (by_id,) = engine.generate(["stop test"], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_id]))
    first = free.token_ids.index(stop_id)
    assert by_id.token_ids == free.token_ids[: first + 1]
    assert by_id.finish_reason == "stop" and by_id.completions[0].stop_reason == stop_id

    text = free.text
    stop = text[4:6]
    (by_str,) = engine.generate(["stop test"], SamplingParams(max_tokens=12, temperature=0.0, stop=[stop]))
    assert by_str.finish_reason == "stop" and by_str.completions[0].stop_reason == stop
    assert by_str.text == text[: text.index(stop)]
    (kept,) = engine.generate(
        ["stop test"],
        SamplingParams(max_tokens=12, temperature=0.0, stop=[stop], include_stop_str_in_output=True),
    )
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_eos_stops_unless_ignored(engine: LLMEngine) -> None:
    eos = engine.tokenizer.eos_token_id
    assert eos is not None
    # Sample until some completion hits EOS; it must stop right there.
    params = SamplingParams(max_tokens=64, temperature=2.0, seed=0, n=8)
    (out,) = engine.generate(["eos"], params)
    for completion in out.completions:
        if eos in completion.token_ids:
            assert completion.token_ids[-1] == eos and completion.finish_reason == "stop"
        else:
            assert completion.finish_reason == "length"


def test_parallel_sampling_forks_share_the_prompt(engine: LLMEngine) -> None:
    prompt = list(range(10, 10 + 37))  # ends mid-page: forks copy-on-write the tail page
    params = SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    (out,) = engine.generate([prompt], params)
    assert [c.index for c in out.completions] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.completions}) > 1
    (again,) = engine.generate([prompt], params)
    assert [c.token_ids for c in again.completions] == [c.token_ids for c in out.completions]
    # Greedy forks all equal the single greedy completion.
    (single,) = engine.generate([prompt], GREEDY)
    (forked,) = engine.generate([prompt], SamplingParams(n=3, max_tokens=12, temperature=0.0, ignore_eos=True))
    assert all(c.token_ids == single.token_ids for c in forked.completions)
    assert engine.kv_cache.pool.num_free_pages == engine.num_pages  # every page released


def test_a_seeded_completion_equals_a_separate_request_with_its_seed(engine: LLMEngine) -> None:
    """Completion i of a request seeded s draws what a request seeded s + i draws alone, as with vLLM."""
    prompt = list(range(200, 200 + 21))
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=41, ignore_eos=True)
    (forked,) = engine.generate([prompt], params)
    alone = engine.generate([prompt] * 3, [dataclasses.replace(params, n=1, seed=41 + i) for i in range(3)])
    assert [c.token_ids for c in forked.completions] == [out.completions[0].token_ids for out in alone]
    assert len({tuple(c.token_ids) for c in forked.completions}) > 1


def test_logprobs_are_normalised_and_rank_the_greedy_token_first(engine: LLMEngine) -> None:
    (out,) = engine.generate(["logprobs"], SamplingParams(max_tokens=5, temperature=0.0, logprobs=3))
    logprobs = out.completions[0].logprobs
    assert logprobs is not None and len(logprobs) == 5
    for entry, token in zip(logprobs, out.token_ids):
        assert entry.token_id == token and len(entry.top) == 3
        assert entry.top[0][0] == token and entry.logprob == pytest.approx(entry.top[0][1])
        assert entry.top[0][1] >= entry.top[1][1] >= entry.top[2][1]
        assert entry.logprob <= 0 and math.exp(entry.top[0][1]) <= 1


def test_small_budget_and_few_pages_still_match(engine: LLMEngine) -> None:
    prompts = [list(range(1, 70)), list(range(100, 130)), [9] * 45, list(range(3, 20))]
    expected = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    squeezed = LLMEngine.from_pretrained(
        "tiny", backend="torch", num_pages=8, max_num_batched_tokens=24, max_num_seqs=3
    )
    assert [o.token_ids for o in squeezed.generate(prompts, GREEDY)] == expected
    assert squeezed.kv_cache.pool.num_free_pages == 8


@pytest.mark.parametrize(
    "prompt,params,field",
    [
        ("", GREEDY, "prompt is empty"),
        ([], GREEDY, "prompt is empty"),
        ([1, 2, 10**6], GREEDY, "out of vocabulary"),
        ([-1], GREEDY, "out of vocabulary"),
        ([1, True], GREEDY, r"out of vocabulary \[0, \d+\): \[True\]"),  # a bool is no token id
        ([1, 2.0], GREEDY, r"out of vocabulary \[0, \d+\): \[2\.0\]"),
        ([0, 263, 1, 300], GREEDY, r"out of vocabulary \[0, 263\): \[263, 300\]"),  # tiny: 263 ids
        ([1] * 5000, GREEDY, "max_model_len"),
        ([1, 2], SamplingParams(logit_bias={5: 1.0, 263: 2.0, 400: -1.0}), r"logit_bias .*\[0, 263\): \[263, 400\]"),
    ],
)
def test_bad_prompts_raise_value_error(engine: LLMEngine, prompt: object, params: SamplingParams, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        engine.generate([prompt], params)  # type: ignore[list-item]
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"logprobs": 50}, "logprobs"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.2}, "repetition_penalty"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 1.5}, "min_tokens"),
        ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": 2.0}, "prompt_logprobs"),
        ({"frequency_penalty": 2.01}, "frequency_penalty"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"presence_penalty": True}, "presence_penalty"),
        ({"logit_bias": {1: float("inf")}}, "logit_bias"),
        ({"logit_bias": {"1": 1.0}}, "logit_bias"),
    ],
)
def test_bad_sampling_params_raise_value_error(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{field} "):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_new_sampling_params_take_their_bounds() -> None:
    params = SamplingParams(repetition_penalty=0.5, min_p=1.0, min_tokens=16, max_tokens=16, prompt_logprobs=20)
    assert (params.repetition_penalty, params.min_p, params.min_tokens, params.prompt_logprobs) == (0.5, 1.0, 16, 20)
    off = SamplingParams()
    assert (off.repetition_penalty, off.min_p, off.min_tokens, off.prompt_logprobs) == (1.0, 0.0, 0, None)


def test_max_model_len_beyond_the_model_is_an_error() -> None:
    message = (
        "max_model_len 99999 is more than the model's context length 4096 (max_position_embeddings in config.json)"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        LLMEngine.from_pretrained("tiny", backend="torch", max_model_len=99999)
    with pytest.raises(ValueError, match="max_model_len must be >= 1"):
        LLMEngine.from_pretrained("tiny", backend="torch", max_model_len=0)
    shorter = LLMEngine.from_pretrained("tiny", backend="torch", max_model_len=4096 // 2, num_pages=64)
    assert shorter.max_model_len == 2048 and shorter.limits.max_model_len == 2048


def test_a_bad_prompt_in_a_batch_admits_nothing(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="out of vocabulary"):
        engine.generate([[1, 2], [10**6]], GREEDY)
    assert not engine.has_unfinished_requests()
    assert engine.generate([[1, 2]], GREEDY)[0].token_ids  # still serving


def test_chat_template_and_dtype(engine: LLMEngine) -> None:
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    (out,) = engine.generate([ids], GREEDY)
    assert len(out.token_ids) == 12
    bf16 = LLMEngine.from_pretrained("tiny", backend="torch", dtype="bfloat16")
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    (low,) = bf16.generate([ids], GREEDY)
    assert len(low.token_ids) == 12
    with pytest.raises(ValueError, match="dtype 'float64'"):
        LLMEngine.from_pretrained("tiny", dtype="float64")


def run_streams_and_a_long_prompt(cap: int) -> tuple[dict[str, list[int]], list[tuple[int, int]]]:
    """Three greedy streams decode while a 600-token prompt arrives; returns each request's tokens and each step's
    (decode tokens, prompt tokens)."""
    engine = LLMEngine.from_pretrained(
        "tiny", backend="torch", max_num_batched_tokens=256, max_prefill_tokens_while_decoding=cap
    )
    steps: list[tuple[int, int]] = []
    schedule = engine.scheduler.schedule

    def recorded() -> SchedulerOutput:
        out = schedule()
        prompt = sum(chunk.num_scheduled_tokens for chunk in out.chunks if in_prompt(chunk.seq))
        steps.append((out.num_tokens - prompt, prompt))
        return out

    engine.scheduler.schedule = recorded  # type: ignore[method-assign]
    for index in range(3):
        engine.add_request(list(range(10 + index, 40 + index)), GREEDY, request_id=f"stream-{index}")
    engine.step()
    long = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request([(7 * position) % 250 + 3 for position in range(600)], long, request_id="long")
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = output.completions[0].token_ids
    return tokens, steps


def test_a_cap_on_a_steps_prompt_tokens_while_streams_decode_bounds_each_step_and_keeps_the_answers() -> None:
    capped, capped_steps = run_streams_and_a_long_prompt(32)
    uncapped, uncapped_steps = run_streams_and_a_long_prompt(256)
    assert capped == uncapped and set(capped) == {"stream-0", "stream-1", "stream-2", "long"}
    assert max(prompt for decode, prompt in capped_steps if decode) == 32
    assert max(prompt for decode, prompt in uncapped_steps if decode) > 32


def test_on_a_cpu_the_prompt_tokens_of_a_step_where_streams_decode_default_to_512() -> None:
    assert LLMEngine.from_pretrained("tiny").scheduler.config.max_prefill_tokens_while_decoding == 512
    assert prefill_cap(None, "cuda") is None and prefill_cap(64, "cuda") == prefill_cap(64, "cpu") == 64
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding must be >= 1, got 0"):
        LLMEngine.from_pretrained("tiny", max_prefill_tokens_while_decoding=0)

"""A token budget on an answer's reasoning (``SamplingParams.thinking_budget``, vLLM's ``thinking_token_budget``)
on the ``tiny`` preset: the free model's tokens up to the budget, then the reasoning's end forced token by token,
then the free model again; an answer whose reasoning ends within its budget is untouched."""

from __future__ import annotations

import dataclasses
import pickle
import shutil

import pytest

from rayturn.engine import Guide, LLMEngine, RequestOutput, SamplingParams
from rayturn.engine.presets import preset_dir
from rayturn.engine.reasoning import reasoning_params
from rayturn.engine.thinking import ThinkingBudget, ThinkingState
from rayturn.engine.tool_calls import parse_tool_calls

END = "</think>"
PROMPT = "think about it"


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine.from_pretrained("tiny", backend="torch", dtype="float32", page_size=16)


def run(engine: LLMEngine) -> list[RequestOutput]:
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return outputs


def free(engine: LLMEngine, prompt: str | list[int], max_tokens: int) -> RequestOutput:
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return out


def budgeted(tokens: int, end: str = END, **fields: object) -> SamplingParams:
    fields = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True, **fields}
    return SamplingParams(thinking_budget=ThinkingBudget(tokens, end), **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("tokens", [0, 1, 5])
def test_past_the_budget_the_end_is_forced_then_the_model_goes_on(engine: LLMEngine, tokens: int) -> None:
    end_ids = engine.tokenizer.encode(END, add_special_tokens=False)
    assert len(end_ids) > 1  # the byte-level preset spells it out: forced token by token
    reference = free(engine, PROMPT, 24)
    assert END not in reference.text
    (out,) = engine.generate([PROMPT], budgeted(tokens))
    assert out.token_ids[:tokens] == reference.token_ids[:tokens]
    assert out.token_ids[tokens : tokens + len(end_ids)] == end_ids
    assert out.text.count(END) == 1
    # After the end the model is free again: the greedy continuation of everything before.
    forced = engine.tokenizer.encode(PROMPT) + out.token_ids[: tokens + len(end_ids)]
    rest = free(engine, forced, 24 - tokens - len(end_ids))
    assert out.token_ids[tokens + len(end_ids) :] == rest.token_ids


def test_reasoning_that_ends_within_its_budget_is_left_alone(engine: LLMEngine) -> None:
    reference = free(engine, PROMPT, 24)
    end = reference.text[2:5]  # text the free answer writes early: its reasoning "ends" there
    assert len(end) == 3 and reference.text.find(end) == 2
    (out,) = engine.generate([PROMPT], budgeted(12, end))
    assert out.token_ids == reference.token_ids


def test_forks_speculation_and_a_continuation_elsewhere_keep_the_count(engine: LLMEngine) -> None:
    params = budgeted(4)
    (alone,) = engine.generate([PROMPT], params)
    (pair,) = engine.generate([PROMPT], dataclasses.replace(params, n=2))
    assert [c.token_ids for c in pair.completions] == [alone.token_ids] * 2
    (drafting,) = engine.generate([PROMPT], dataclasses.replace(params, speculative=True))
    assert drafting.token_ids == alone.token_ids
    shipped: SamplingParams = pickle.loads(pickle.dumps(params))
    assert shipped == params
    decode = LLMEngine.from_pretrained("tiny", backend="torch")
    for prefix in (alone.token_ids[:1], alone.token_ids[:6]):  # before the budget ran out, and mid-end
        decode.add_request(PROMPT, shipped, request_id=f"r{len(prefix)}", output_prefix=prefix)
        (final,) = [out for out in run(decode) if out.finished]
        assert final.token_ids == alone.token_ids


def test_budgets_are_checked_when_made() -> None:
    with pytest.raises(ValueError, match=r"ThinkingBudget\.tokens must be an integer >= 0"):
        ThinkingBudget(-1, END)
    with pytest.raises(ValueError, match=r"ThinkingBudget\.end must be a non-empty string"):
        ThinkingBudget(3, "")
    with pytest.raises(ValueError, match=r"SamplingParams\.thinking_budget must be a ThinkingBudget"):
        SamplingParams(thinking_budget=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="encodes to no tokens"):
        ThinkingState(ThinkingBudget(3, END), [])


@pytest.fixture(scope="module")
def think_tokens(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    """``tiny`` whose tokenizer holds ``<think>`` and ``</think>`` as single added tokens that are not special, as
    Qwen3's and DeepSeek-R1's do (they take the ids of tiny's ``<tool_call>`` pair; the weights are tiny's)."""
    directory = tmp_path_factory.mktemp("think-tokens")
    tiny = preset_dir("tiny")
    for name in ("config.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny / name, directory / name)
    (directory / "model.safetensors").symlink_to(tiny / "model.safetensors")
    text = (tiny / "tokenizer.json").read_text().replace("</tool_call>", "</think>").replace("<tool_call>", "<think>")
    (directory / "tokenizer.json").write_text(text)
    return LLMEngine.from_pretrained(str(directory), backend="torch", dtype="float32", page_size=16)


def test_single_token_tags_are_forced_as_one_token_kept_in_the_text_and_split_off(think_tokens: LLMEngine) -> None:
    tokenizer = think_tokens.tokenizer
    (end_id,) = tokenizer.encode(END, add_special_tokens=False)
    reference = free(think_tokens, PROMPT, 24)
    params = reasoning_params(SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), "qwen3", 4)
    (out,) = think_tokens.generate([PROMPT], params)
    assert out.token_ids[:4] == reference.token_ids[:4] and out.token_ids[4] == end_id
    assert out.text.count(END) == 1  # not special: detokenizing keeps it, so the split sees it
    split = parse_tool_calls(out.text, reasoning="qwen3")
    assert split.reasoning == (tokenizer.decode(out.token_ids[:4]).replace("<think>", "").strip() or None)
    assert split.content == (tokenizer.decode(out.token_ids[5:]).strip() or None)
    # A guide waiting for the single-token end holds from the token after it.
    guided = reasoning_params(dataclasses.replace(params, guide=Guide.regex("[0-9]{3}")), "qwen3", 2)
    (answer,) = think_tokens.generate([PROMPT], guided)
    assert answer.token_ids[2] == end_id and answer.text.endswith(tokenizer.decode(answer.token_ids[3:]))
    assert parse_tool_calls(answer.text, reasoning="qwen3").content.isdigit()
    assert len(answer.token_ids) == 6 and answer.finish_reason == "stop"

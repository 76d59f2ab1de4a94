"""Guided decoding on the ``tiny`` preset: grammars obeyed, batch mates untouched, disaggregation, bad guides.

The preset's random weights would never close a free string, so the schemas
here keep every value bounded (enums, integers with limits, booleans).
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
from typing import Any

import numpy as np
import pytest
import torch

from rayturn.engine import Guide, LLMEngine, RequestOutput, SamplingParams, check_guide
from rayturn.engine.guided import GuideCompiler, mask_guided_logits, unpack_bits_numpy, unpack_bits_torch

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "count", "ok"],
    "additionalProperties": False,
}
GUIDE = Guide.json_schema(SCHEMA)
GREEDY_GUIDED = SamplingParams(max_tokens=64, temperature=0.0, guide=GUIDE)
TOOL_CALL_SCHEMA = {
    "type": "object",
    "properties": {"name": {"enum": ["get", "put"]}, "x": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["name", "x"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}
TOOL_CALL_GRAMMAR = f'start: "<tool_call>\\n" %json{json.dumps(TOOL_CALL_SCHEMA)} "\\n</tool_call>"'


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine.from_pretrained("tiny", backend="torch", dtype="float32", page_size=16)


def assert_matches_schema(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"color", "count", "ok"}
    assert value["color"] in ("red", "green", "blue")
    assert isinstance(value["count"], int) and 0 <= value["count"] <= 99
    assert isinstance(value["ok"], bool)


def run(engine: LLMEngine) -> list[RequestOutput]:
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return outputs


def test_greedy_json_schema_output_parses_and_ends_when_the_grammar_does(engine: LLMEngine) -> None:
    (out,) = engine.generate(["describe it"], GREEDY_GUIDED)
    assert_matches_schema(out.text)
    # Complete at the closing brace: nothing can follow, so no EOS is needed.
    assert out.finish_reason == "stop" and out.text.endswith("}") and out.token_ids[-1] == ord("}")
    assert out.text.startswith('{"color": ')  # compact separators, no free whitespace


def test_seeded_sampling_and_forks_obey_the_schema(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=64, temperature=1.0, top_p=0.95, top_k=50, seed=11, n=2, guide=GUIDE)
    (out,) = engine.generate(["sample"], params)
    assert len(out.completions) == 2
    for completion in out.completions:
        assert completion.finish_reason == "stop"
        assert_matches_schema(completion.text)
    (again,) = engine.generate(["sample"], params)
    assert [c.token_ids for c in again.completions] == [c.token_ids for c in out.completions]
    batch = engine.generate(["other", "sample"], [SamplingParams(max_tokens=8), params])
    assert [c.token_ids for c in batch[1].completions] == [c.token_ids for c in out.completions]


def test_hot_sampling_over_many_seeds_stays_in_the_schema(engine: LLMEngine) -> None:
    params = [SamplingParams(max_tokens=64, temperature=2.0, seed=seed, guide=GUIDE) for seed in range(6)]
    for out in engine.generate(["hot"] * 6, params):
        assert out.finish_reason == "stop"
        assert_matches_schema(out.text)


def test_json_object_guide_gives_an_object(engine: LLMEngine) -> None:
    # Random weights write keys forever; what is written must still be a JSON object's start.
    (out,) = engine.generate(["obj"], SamplingParams(max_tokens=24, temperature=0.0, guide=Guide.json_object()))
    assert out.text.startswith("{")
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == 24


def test_lark_tool_call_grammar_is_obeyed(engine: LLMEngine) -> None:
    guide = Guide.lark(TOOL_CALL_GRAMMAR)
    for params in (
        SamplingParams(max_tokens=64, temperature=0.0, guide=guide),
        SamplingParams(max_tokens=64, temperature=1.0, seed=3, guide=guide),
    ):
        (out,) = engine.generate(["call a tool"], params)
        assert out.finish_reason == "stop"
        assert out.text.startswith("<tool_call>\n") and out.text.endswith("\n</tool_call>")
        call = json.loads(out.text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
        assert call["name"] in ("get", "put") and 1 <= call["x"] <= 5
        # The tags are the vocabulary's own (non-special) tokens, as the model would write them.
        tool_call_start = engine.tokenizer.token_to_id("<tool_call>")
        assert out.token_ids[0] == tool_call_start


def test_regex_guide_allows_eos_exactly_when_it_accepts(engine: LLMEngine) -> None:
    state = engine.requests.guides.start(Guide.regex("ab+"))
    (eos,) = engine.eos_token_ids

    def allowed() -> set[int]:
        masked = mask_guided_logits(torch.zeros(1, engine.config.vocab_size), [state])
        return set(torch.nonzero(masked[0] > float("-inf")).flatten().tolist())

    assert allowed() == {ord("a")}
    state.advance(ord("a"))
    assert allowed() == {ord("b")}
    state.advance(ord("b"))
    assert allowed() == {ord("b"), eos} and not state.is_complete
    state.advance(eos)
    assert state.is_complete and state.error is None


def test_unguided_batch_mates_are_untouched(engine: LLMEngine) -> None:
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = ["first prompt", "second", "third one here"]
    alone = [engine.generate([prompt], free)[0].token_ids for prompt in prompts[1:]]
    mixed = engine.generate(prompts, [GREEDY_GUIDED, free, free])
    assert [out.token_ids for out in mixed[1:]] == alone
    assert_matches_schema(mixed[0].text)
    assert mixed[0].token_ids == engine.generate([prompts[0]], GREEDY_GUIDED)[0].token_ids


def test_logprobs_come_from_the_unguided_distribution(engine: LLMEngine) -> None:
    params = dataclasses.replace(GREEDY_GUIDED, logprobs=2)
    (guided,) = engine.generate(["lp"], params)
    (free,) = engine.generate(["lp"], SamplingParams(max_tokens=1, temperature=0.0, logprobs=2))
    first = guided.completions[0].logprobs
    assert first is not None and first[0].token_id == ord("{")
    assert first[0].top == free.completions[0].logprobs[0].top  # type: ignore[index]


def test_chunked_prefill_masks_only_the_last_prompt_token(engine: LLMEngine) -> None:
    prompt = list(range(30, 30 + 45))
    (expected,) = engine.generate([prompt], GREEDY_GUIDED)
    chunked = LLMEngine.from_pretrained("tiny", backend="torch", max_num_batched_tokens=16)
    (out,) = chunked.generate([prompt], GREEDY_GUIDED)
    assert out.token_ids == expected.token_ids and out.finish_reason == "stop"


def test_disaggregated_continuation_equals_the_local_run(engine: LLMEngine) -> None:
    prompt = "route me"
    for params in (GREEDY_GUIDED, SamplingParams(max_tokens=64, temperature=0.0, guide=Guide.lark(TOOL_CALL_GRAMMAR))):
        (local,) = engine.generate([prompt], params)
        # What crosses to the prefill replica and back: the params pickled inside a Call, one token sampled.
        shipped: SamplingParams = pickle.loads(pickle.dumps(params))
        assert shipped == params
        prefill_params = dataclasses.replace(shipped, max_tokens=1, n=1)
        (first,) = engine.generate([prompt], prefill_params)
        assert first.token_ids == local.token_ids[:1]
        decode = LLMEngine.from_pretrained("tiny", backend="torch")
        for forced in (first.token_ids, local.token_ids[:5]):
            decode.add_request(prompt, shipped, request_id=f"r{len(forced)}", output_prefix=forced)
            (final,) = [out for out in run(decode) if out.finished]
            assert final.token_ids == local.token_ids
            assert final.text == local.text and final.finish_reason == "stop"


def _gate(engine: LLMEngine, prompt: str) -> tuple[RequestOutput, str, int]:
    """The free greedy answer to ``prompt``, a piece of its text to wait for, and how many of its tokens it
    takes to show that piece (the guide holds from the token after)."""
    (free,) = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    after = free.text[4:7]
    assert len(after) == 3 and free.text.find(after) == 4
    shown = next(k for k in range(1, 25) if after in engine.tokenizer.decode(free.token_ids[:k]))
    return free, after, shown


def test_a_guide_waiting_for_the_reasoning_s_end_leaves_the_output_free_until_it_shows(engine: LLMEngine) -> None:
    """``Guide.after`` (a thinking model's ``</think>``): every token up to the one that shows the text is the
    free model's, the rest is the grammar's, whole; a fork, and a continuation on another engine (the
    disaggregated path, the prefill replica's first token forced) wait the same way."""
    prompt = "think first"
    free, after, shown = _gate(engine, prompt)
    guided = SamplingParams(
        max_tokens=24, temperature=0.0, guide=dataclasses.replace(Guide.regex("[a-z]{3}!"), after=after)
    )
    (out,) = engine.generate([prompt], guided)
    assert out.token_ids[:shown] == free.token_ids[:shown]
    rest = engine.tokenizer.decode(out.token_ids[shown:])
    assert re.fullmatch("[a-z]{3}!", rest) and out.finish_reason == "stop"
    assert out.text == engine.tokenizer.decode(free.token_ids[:shown]) + rest
    never = dataclasses.replace(guided, guide=dataclasses.replace(guided.guide, after="\x00never\x00"), ignore_eos=True)
    (unguided,) = engine.generate([prompt], never)
    assert unguided.token_ids == free.token_ids  # a guide that never opens never masks
    (pair,) = engine.generate([prompt], dataclasses.replace(guided, n=2))
    assert [(c.token_ids, c.text) for c in pair.completions] == [(out.token_ids, out.text)] * 2
    decode = LLMEngine.from_pretrained("tiny", backend="torch")
    shipped: SamplingParams = pickle.loads(pickle.dumps(guided))
    assert shipped.guide is not None and shipped.guide.after == after
    decode.add_request(prompt, shipped, request_id="continued", output_prefix=out.token_ids[:1])
    (final,) = [each for each in run(decode) if each.finished]
    assert final.token_ids == out.token_ids and final.text == out.text


def test_forced_tokens_the_grammar_rejects_abort_on_arrival(engine: LLMEngine) -> None:
    engine.add_request("x", GREEDY_GUIDED, request_id="rejected", output_prefix=[ord("[")])
    (out,) = run(engine)
    assert out.finished and out.finish_reason == "abort"


def test_a_grammar_broken_mid_generation_ends_only_its_sequence(engine: LLMEngine) -> None:
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    (alone,) = engine.generate(["mate"], free)
    engine.add_request("broken", GREEDY_GUIDED, request_id="broken")
    engine.add_request("mate", free, request_id="mate")
    outputs = engine.step()
    (broken,) = [seq for seq in engine.scheduler.running if seq.request_id == "broken"]
    assert broken.guide is not None
    broken.guide.matcher.consume_token(ord("]"))  # behind the state's back: the matcher errors
    outputs += run(engine)
    finals = {out.request_id: out for out in outputs if out.finished}
    assert finals["broken"].finish_reason == "abort"
    assert finals["mate"].token_ids == alone.token_ids and finals["mate"].finish_reason == "length"


def test_length_cuts_a_guided_output_short(engine: LLMEngine) -> None:
    (out,) = engine.generate(["short"], dataclasses.replace(GREEDY_GUIDED, max_tokens=5))
    assert out.finish_reason == "length" and len(out.token_ids) == 5 and out.text.startswith("{")


@pytest.mark.parametrize(
    "guide,message",
    [
        (Guide.json_schema({"type": "objekt"}), "bad json_schema guide: .*objekt"),
        (Guide("json_schema", "{not json"), "not valid JSON"),
        (Guide("json_schema", "[1, 2]"), "must be a JSON object"),
        (Guide.lark("start: undefined_rule"), "bad lark guide: .*undefined_rule"),
        (Guide.regex("a("), "bad regex guide: .*unclosed group"),
    ],
)
def test_bad_guides_raise_value_error_at_the_edge_and_at_add_request(
    engine: LLMEngine, guide: Guide, message: str
) -> None:
    with pytest.raises(ValueError, match=f"(?s){message}"):  # llguidance errors can span lines
        check_guide(guide)
    with pytest.raises(ValueError, match=f"(?s){message}"):
        engine.add_request("bad", SamplingParams(guide=guide))
    assert not engine.has_unfinished_requests()


def test_a_special_token_missing_from_the_vocabulary_is_refused_at_add_request(engine: LLMEngine) -> None:
    guide = Guide.lark('start: <|no_such_token|> "a"')
    check_guide(guide)  # syntax is fine; only the tokenizer knows
    with pytest.raises(ValueError, match=r"bad lark guide: .*no_such_token"):
        engine.add_request("bad", SamplingParams(guide=guide))


def test_good_guides_pass_the_edge_check() -> None:
    for guide in (GUIDE, Guide.json_object(), Guide.lark(TOOL_CALL_GRAMMAR), Guide.regex("[a-z]{3}")):
        check_guide(guide)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"kind": "yaml", "spec": "a: 1"}, "Guide.kind must be one of"),
        ({"kind": "regex", "spec": ""}, "Guide.spec must not be empty"),
        ({"kind": "json_object", "spec": "{}"}, "Guide.spec must be empty"),
        ({"kind": "lark", "spec": 5}, "Guide.spec must be a string"),
        ({"kind": "regex", "spec": "a", "after": None}, "Guide.after must be a string"),
    ],
)
def test_malformed_guides_are_refused_when_made(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Guide(**kwargs)


def test_sampling_params_checks_the_guide_type() -> None:
    with pytest.raises(ValueError, match=r"SamplingParams\.guide must be a Guide"):
        SamplingParams(guide="json")  # type: ignore[arg-type]


def test_compiler_keeps_the_most_recently_used_grammars(engine: LLMEngine) -> None:
    compiler = GuideCompiler(engine.tokenizer, engine.config.vocab_size, engine.eos_token_ids, max_grammars=2)
    a, b, c = Guide.regex("a+"), Guide.regex("b+"), Guide.regex("c+")
    compiler.start(a)
    compiler.start(b)
    compiler.start(a)
    assert compiler.cached == [b, a]
    compiler.start(c)
    assert compiler.cached == [a, c]
    with pytest.raises(ValueError):
        compiler.start(Guide.regex("("))
    assert compiler.cached == [a, c]


def test_a_model_vocabulary_wider_than_the_tokenizer_never_allows_the_padding(engine: LLMEngine) -> None:
    wide = 300
    compiler = GuideCompiler(engine.tokenizer, wide, engine.eos_token_ids)
    state = compiler.start(Guide.regex("(?s:.)+"))  # any text at all
    state.advance(ord("a"))
    masked = mask_guided_logits(torch.zeros(2, wide), [None, state])
    assert bool((masked[0] == 0).all())  # the unguided row as it was
    allowed = torch.nonzero(masked[1] > float("-inf")).flatten()
    assert int(allowed.max()) < engine.tokenizer.vocab_size and ord("a") in allowed.tolist()
    narrow = GuideCompiler(engine.tokenizer, engine.tokenizer.vocab_size - 1, engine.eos_token_ids)
    with pytest.raises(ValueError, match="more than the model's vocab_size"):
        narrow.start(GUIDE)


@pytest.mark.parametrize("vocab_size", [263, 300, 1000, 32])
def test_mask_words_unpack_to_the_same_bits_with_numpy_and_torch(vocab_size: int) -> None:
    words = np.random.default_rng(vocab_size).integers(-(2**31), 2**31, size=(3, (vocab_size + 31) // 32))
    bitmask = words.astype(np.int32)
    with_numpy = unpack_bits_numpy(bitmask, vocab_size)
    assert with_numpy.shape == (3, vocab_size) and with_numpy.dtype == torch.bool
    assert torch.equal(with_numpy, unpack_bits_torch(torch.from_numpy(bitmask), vocab_size))
    for row, token in ((0, 0), (1, vocab_size - 1), (2, vocab_size // 2)):
        assert bool(with_numpy[row, token]) == bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)

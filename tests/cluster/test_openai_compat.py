"""What a vLLM user's tools expect of the OpenAI API, against a real ``rayturn serve`` (the command, as a user
starts it) with the official ``openai`` client.

Scores and answers are checked against ``transformers`` on the same weights: an echoed prompt's logprobs equal
the log-softmax of the model's logits at each position, and greedy answers with a repetition penalty equal
``generate(repetition_penalty=...)`` token for token.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
from openai_penalties import OpenAIPenalties
from prometheus_client.parser import text_string_to_metric_families
from rayturn_cli import serve_process

openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
grpc = pytest.importorskip("grpc")

from rayturn.engine.presets import preset_dir  # noqa: E402
from rayturn.engine.tokenizer import Tokenizer  # noqa: E402
from rayturn.protos import rayturn_pb2 as pb  # noqa: E402
from rayturn.protos import rayturn_pb2_grpc as pb_grpc  # noqa: E402

HTTP_PORT, GRPC_PORT = 28581, 29581
BASE = f"http://127.0.0.1:{HTTP_PORT}"
THRESHOLD = 64  # prompts this long go to the prefill pool, unless they ask for prompt logprobs
CONFIG = f"""\
model:
  num_pages: 512
prefill:
  num_cpus: 0.25
decode:
  num_cpus: 0.25
kvstore:
  segment_bytes: 32MiB
router:
  disaggregation_threshold_tokens: {THRESHOLD}
"""
PROMPT = "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n"
LONG_PROMPT = "Refactor this module: " + "def f(x): return x + 1\n" * 6


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory = tmp_path_factory.mktemp("serve")
    config = directory / "rayturn.yaml"
    config.write_text(CONFIG)
    args = ["--model", "tiny", "--config", str(config), "--http-port", str(HTTP_PORT), "--grpc-port", str(GRPC_PORT)]
    with serve_process(args, directory, BASE) as base:
        yield base


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(preset_dir("tiny"))


@pytest.fixture(scope="module")
def hf_model() -> Any:
    model = transformers.AutoModelForCausalLM.from_pretrained(preset_dir("tiny"), torch_dtype=torch.float32)
    return model.eval()


def _hf_prompt_logprobs(hf_model: Any, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)  # row p scores token p + 1


# ---------------------------------------------------------------- the model field, models, routes


@pytest.mark.parametrize("model", ["", None], ids=["empty", "missing"])
def test_an_empty_or_missing_model_selects_the_served_one(server: str, model: str | None) -> None:
    body: dict[str, Any] = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
    if model is not None:
        body["model"] = model
    response = requests.post(f"{server}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "tiny"


def test_the_model_card_names_the_context(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    card = client.models.retrieve("tiny")
    config = json.loads((preset_dir("tiny") / "config.json").read_text())
    assert (card.id, card.object, card.owned_by) == ("tiny", "model", "rayturn")
    assert card.model_extra is not None and card.model_extra["max_model_len"] == config["max_position_embeddings"]
    assert [model.id for model in client.models.list()] == ["tiny"]
    assert client.models.list().data[0].model_extra == card.model_extra
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert caught.value.body is not None and "no-such-model" in caught.value.body["message"]  # type: ignore[index]


@pytest.mark.parametrize(
    ("method", "path", "status"), [("POST", "/v1/embeddingz", 404), ("GET", "/v1/completions", 405)]
)
def test_unknown_routes_answer_in_openais_error_shape(server: str, method: str, path: str, status: int) -> None:
    response = requests.request(method, f"{server}{path}", json={}, timeout=30)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert path in error["message"] and error["type"] == "invalid_request_error"


# ---------------------------------------------------------------- vLLM's /tokenize and /detokenize

READ_FILE = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file of the repository",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
}
AGENT_TURN = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Fix the bug in src/app.py, déjà vu ✓"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "src/app.py"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "def f():\n    return 1\n"},
]


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    return transformers.AutoTokenizer.from_pretrained(preset_dir("tiny"))


def _tokenize(server: str, body: dict[str, Any]) -> dict[str, Any]:
    response = requests.post(f"{server}/tokenize", json=body, timeout=60)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    assert set(answer) == {"count", "max_model_len", "tokens", "token_strs"}
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == 4096
    return answer


def _hf_chat_ids(hf_tokenizer: Any, messages: list[dict[str, Any]], **options: Any) -> list[int]:
    # transformers renders tool-call arguments as the objects they hold, as the chat API decodes them.
    turns = [
        {**m, "tool_calls": [_decoded(call) for call in m["tool_calls"]]} if m.get("tool_calls") else m
        for m in messages
    ]
    ids: list[int] = hf_tokenizer.apply_chat_template(turns, tokenize=True, return_dict=False, **options)
    return ids


def _decoded(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    return {**call, "function": {**function, "arguments": json.loads(function["arguments"])}}


def test_tokenize_gives_a_chats_prompt_as_transformers_renders_it_and_as_the_chat_call_counts_it(
    server: str, client: openai.OpenAI, hf_tokenizer: Any
) -> None:
    answer = _tokenize(
        server, {"model": "tiny", "messages": AGENT_TURN, "tools": [READ_FILE], "return_token_strs": True}
    )
    expected = _hf_chat_ids(hf_tokenizer, AGENT_TURN, tools=[READ_FILE], add_generation_prompt=True)
    assert answer["tokens"] == expected and len(expected) > 500
    assert answer["token_strs"] == hf_tokenizer.convert_ids_to_tokens(expected)
    call = client.chat.completions.create(
        model="tiny",
        messages=AGENT_TURN,
        tools=[READ_FILE],
        max_tokens=1,
        temperature=0,  # type: ignore[arg-type]
    )
    assert call.usage is not None and call.usage.prompt_tokens == answer["count"]
    # tool_choice "none" hides the tools from the prompt, as it does for the chat call.
    hidden = _tokenize(server, {"messages": AGENT_TURN, "tools": [READ_FILE], "tool_choice": "none"})
    assert hidden["tokens"] == _hf_chat_ids(hf_tokenizer, AGENT_TURN, add_generation_prompt=True)
    whole = _tokenize(server, {"messages": AGENT_TURN, "add_generation_prompt": False})
    assert whole["tokens"] == _hf_chat_ids(hf_tokenizer, AGENT_TURN, add_generation_prompt=False)
    assert whole["count"] < hidden["count"] and whole["token_strs"] is None
    prefill = [*AGENT_TURN[:2], {"role": "assistant", "content": "Sure, I will"}]
    left_open = _tokenize(server, {"messages": prefill, "continue_final_message": True})
    assert left_open["tokens"] == _hf_chat_ids(hf_tokenizer, prefill, continue_final_message=True)
    assert hf_tokenizer.decode(left_open["tokens"]).endswith("Sure, I will")


@pytest.mark.parametrize("add_special_tokens", [None, True, False])
def test_tokenize_and_detokenize_a_text_as_transformers_does(
    server: str, hf_tokenizer: Any, add_special_tokens: bool | None
) -> None:
    text = "x = <|im_start|> déjà vu 🙂\n\tdef f(): return 1"
    body: dict[str, Any] = {"prompt": text}
    if add_special_tokens is not None:
        body["add_special_tokens"] = add_special_tokens
    answer = _tokenize(server, body)
    expected = hf_tokenizer(text, add_special_tokens=add_special_tokens is not False).input_ids
    assert answer["tokens"] == expected and answer["token_strs"] is None
    back = requests.post(f"{server}/detokenize", json={"model": "tiny", "tokens": expected}, timeout=60)
    assert back.status_code == 200 and back.json() == {"prompt": hf_tokenizer.decode(expected)}
    assert back.json()["prompt"] == text  # special tokens are kept
    empty = requests.post(f"{server}/detokenize", json={"tokens": []}, timeout=60)
    assert empty.json() == {"prompt": ""}


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "words"),
    [
        ("/tokenize", {}, 400, "prompt", "'prompt' or 'messages'"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "messages", "not both"),
        ("/tokenize", {"prompt": "a", "tools": [READ_FILE]}, 400, "tools", "goes with 'messages'"),
        ("/tokenize", {"prompt": 7}, 400, "prompt", "expected a string"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "a"}], "chat_template": "{{ 1 }}"},
            400,
            "chat_template",
            "not support",
        ),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "a"}], "continue_final_message": True},
            400,
            "continue_final_message",
            "assistant",
        ),
        ("/tokenize", {"prompt": "a", "model": "gpt-4o"}, 404, "model", "gpt-4o"),
        ("/detokenize", {"tokens": [1, 263]}, 400, "tokens[1]", "out of the vocabulary [0, 263)"),
        ("/detokenize", {"tokens": [1, True]}, 400, "tokens[1]", "got a boolean"),
        ("/detokenize", {"tokens": "1 2"}, 400, "tokens", "expected an array"),
        ("/detokenize", {"prompt": "a"}, 400, "tokens", "Missing required parameter"),
    ],
)
def test_tokenizer_endpoints_refuse_bad_bodies_naming_the_field(
    server: str, path: str, body: dict[str, Any], status: int, param: str, words: str
) -> None:
    response = requests.post(f"{server}{path}", json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_chat_template_kwargs_reach_the_template_and_names_the_server_sets_are_refused(
    server: str, client: openai.OpenAI
) -> None:
    """``tiny``'s template reads no extra variable, so the answer is the one without them; a name the server sets
    (here ``tools``) is a 400 naming it, on chat completions and on /tokenize alike."""
    messages = [{"role": "user", "content": "Say hi"}]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    kwargs = {"enable_thinking": False, "reasoning_effort": "low"}
    answer = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, extra_body={"chat_template_kwargs": kwargs}
    )
    assert answer.choices[0].message.content == plain.choices[0].message.content
    assert answer.usage is not None and plain.usage is not None
    assert answer.usage.prompt_tokens == plain.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=2, extra_body={"chat_template_kwargs": {"tools": []}}
        )
    assert caught.value.param == "chat_template_kwargs.tools"  # type: ignore[attr-defined]
    assert "use the field 'tools'" in caught.value.message
    refused = requests.post(
        f"{server}/tokenize", json={"messages": messages, "chat_template_kwargs": {"messages": []}}, timeout=60
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs.messages"


# ---------------------------------------------------------------- completions: echo and batches


def test_echo_scores_the_prompt_as_transformers_does(
    client: openai.OpenAI, tokenizer: Tokenizer, hf_model: Any
) -> None:
    """What log-likelihood evaluation sends: echo, logprobs, no generation. A prompt past the disaggregation
    threshold still scores every position (it is computed where the scores are read)."""
    for prompt in (PROMPT, LONG_PROMPT):
        token_ids = tokenizer.encode(prompt)
        assert (len(token_ids) >= THRESHOLD) == (prompt is LONG_PROMPT)
        response = client.completions.create(
            model="tiny", prompt=prompt, echo=True, logprobs=3, max_tokens=0, temperature=0
        )
        choice = response.choices[0]
        assert choice.text == prompt and choice.finish_reason == "length"
        assert response.usage is not None
        assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(token_ids), 0)
        logprobs = choice.logprobs
        assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
        assert len(logprobs.token_logprobs) == len(token_ids)
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        expected = _hf_prompt_logprobs(hf_model, token_ids)
        for position in range(1, len(token_ids)):
            want = expected[position - 1, token_ids[position]].item()
            assert math.isclose(logprobs.token_logprobs[position], want, rel_tol=1e-4, abs_tol=1e-4)
            top = logprobs.top_logprobs[position]
            assert len(top) >= 3
            best = sorted(top.values(), reverse=True)[:3]
            want_top = expected[position - 1].topk(3).values.tolist()
            assert all(math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4) for a, b in zip(best, want_top))
        assert logprobs.text_offset is not None and logprobs.text_offset[0] == 0


def test_prompt_logprobs_come_back_in_vllms_form(client: openai.OpenAI, tokenizer: Tokenizer, hf_model: Any) -> None:
    token_ids = tokenizer.encode(PROMPT)
    response = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    scored = response.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    assert len(scored) == len(token_ids) and scored[0] is None
    expected = _hf_prompt_logprobs(hf_model, token_ids)
    for position in range(1, len(token_ids)):
        entry = scored[position][str(token_ids[position])]
        assert math.isclose(entry["logprob"], expected[position - 1, token_ids[position]].item(), abs_tol=1e-4)
        ranked = sorted((e for e in scored[position].values() if e["rank"] is not None), key=lambda e: e["rank"])
        assert [e["rank"] for e in ranked] == [1, 2]


def test_echo_with_generation_puts_the_prompt_first(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1)
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    plain_logprobs, echoed_logprobs = plain.choices[0].logprobs, echoed.choices[0].logprobs
    assert plain_logprobs is not None and echoed_logprobs is not None
    assert echoed_logprobs.tokens is not None and plain_logprobs.tokens is not None
    num_prompt = len(tokenizer.encode(PROMPT))
    assert echoed_logprobs.tokens[num_prompt:] == plain_logprobs.tokens
    streamed = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, echo=True, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in streamed) == echoed.choices[0].text


def test_a_batch_of_prompts_answers_each_as_alone(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    prompts: list[Any] = ["Once upon a time", tokenizer.encode("The answer is"), "x = [1, 2,"]
    alone = [
        client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0).choices[0].text
        for prompt in prompts
    ]
    batch = client.completions.create(model="tiny", prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert [choice.index for choice in batch.choices] == list(range(6))
    assert [choice.text for choice in batch.choices] == [text for text in alone for _ in range(2)]
    assert batch.usage is not None
    assert batch.usage.prompt_tokens == sum(
        len(p) if isinstance(p, list) else len(tokenizer.encode(p)) for p in prompts
    )
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model="tiny", prompt=prompts, max_tokens=5, temperature=0, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[index] for index in range(3)] == alone
    token_lists = client.completions.create(
        model="tiny", prompt=[tokenizer.encode(p) for p in ("ab", "cd")], max_tokens=3, temperature=0
    )
    assert len(token_lists.choices) == 2


def test_one_bad_prompt_in_a_batch_names_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt=["fine", [1, 10**6]], max_tokens=3)
    assert caught.value.param == "prompt[1]"  # type: ignore[attr-defined]


# ---------------------------------------------------------------- sampling extensions


def _hf_greedy_steps(hf_model: Any, token_ids: list[int], process: Any) -> list[int]:
    """transformers' logits, 12 greedy steps, each step's scores changed by ``process(sequence, scores)``: step by
    step, so EOS is neither masked nor a stop (``ignore_eos``)."""
    sequence = torch.tensor([token_ids])
    with torch.no_grad():
        for _ in range(12):
            scores = process(sequence, hf_model(sequence).logits[:, -1].float())
            sequence = torch.cat([sequence, scores.argmax(-1, keepdim=True)], dim=1)
    return sequence[0, len(token_ids) :].tolist()


def _greedy_token_ids(client: openai.OpenAI, token_ids: list[int], **fields: Any) -> list[int]:
    """The 12 tokens a greedy completion of ``token_ids`` with ``fields`` streams back (EOS ignored)."""
    extra_body = {"ignore_eos": True, "return_tokens_as_token_ids": True, **fields.pop("extra_body", {})}
    response = client.completions.create(
        model="tiny", prompt=token_ids, max_tokens=12, temperature=0, logprobs=0, extra_body=extra_body, **fields
    )
    logprobs = response.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    return [int(token.removeprefix("token_id:")) for token in logprobs.tokens]


def test_repetition_penalty_matches_transformers(client: openai.OpenAI, tokenizer: Tokenizer, hf_model: Any) -> None:
    token_ids = tokenizer.encode(PROMPT)
    for penalty in (1.5, 0.7):
        expected = _hf_greedy_steps(hf_model, token_ids, transformers.RepetitionPenaltyLogitsProcessor(penalty))
        assert _greedy_token_ids(client, token_ids, extra_body={"repetition_penalty": penalty}) == expected


@pytest.mark.parametrize("prompt", [PROMPT, LONG_PROMPT], ids=["local", "disaggregated"])
def test_logit_bias_and_frequency_and_presence_penalties_match_transformers(
    client: openai.OpenAI, tokenizer: Tokenizer, hf_model: Any, prompt: str
) -> None:
    token_ids = tokenizer.encode(prompt)
    plain = _hf_greedy_steps(hf_model, token_ids, OpenAIPenalties(len(token_ids), {}, 0.0, 0.0))
    # The plain first token held back, another pushed up, and both penalties on: each changes the answer here.
    bias = {plain[0]: -100.0, 50: 4.0}
    expected = _hf_greedy_steps(hf_model, token_ids, OpenAIPenalties(len(token_ids), bias, 1.2, 0.6))
    assert expected != plain
    answer = _greedy_token_ids(
        client,
        token_ids,
        logit_bias={str(token): value for token, value in bias.items()},
        frequency_penalty=1.2,
        presence_penalty=0.6,
    )
    assert answer == expected


@pytest.mark.parametrize("prompt", [PROMPT, LONG_PROMPT], ids=["local", "disaggregated"])
def test_allowed_token_ids_and_bad_words_match_transformers(
    client: openai.OpenAI, tokenizer: Tokenizer, hf_model: Any, prompt: str
) -> None:
    token_ids = tokenizer.encode(prompt)
    letters = [tokenizer.encode(letter)[0] for letter in "xyz"]  # one token each: a byte-level vocabulary

    def only_letters(_sequence: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        mask = torch.full_like(scores, float("-inf"))
        mask[:, letters] = 0.0
        return scores + mask

    plain = _hf_greedy_steps(hf_model, token_ids, lambda _sequence, scores: scores)
    lettered = _hf_greedy_steps(hf_model, token_ids, only_letters)
    assert lettered != plain and set(lettered) <= set(letters)
    assert _greedy_token_ids(client, token_ids, extra_body={"allowed_token_ids": letters}) == lettered
    # A word the letters made, given as text: the server tokenizes it, and bans its last token after the first.
    word = lettered[2:4]
    no_word = transformers.NoBadWordsLogitsProcessor([word])  # the prompt ends in a newline: no letter to match
    expected = _hf_greedy_steps(hf_model, token_ids, lambda seq, scores: no_word(seq, only_letters(seq, scores)))
    assert expected != lettered
    extra_body = {"allowed_token_ids": letters, "bad_words": [tokenizer.decode(word)]}
    assert _greedy_token_ids(client, token_ids, extra_body=extra_body) == expected
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=6,
        temperature=0.8,
        extra_body={"allowed_token_ids": letters, "ignore_eos": True},
    )
    assert chat.choices[0].message.content and set(chat.choices[0].message.content) <= set("xyz")
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_body={"allowed_token_ids": [10**6]})
    assert caught.value.param == "allowed_token_ids" and "out of vocabulary" in caught.value.message  # type: ignore[attr-defined]


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_truncated_prompt_is_answered_as_transformers_answers_the_kept_tokens(
    client: openai.OpenAI, tokenizer: Tokenizer, hf_model: Any, side: str
) -> None:
    text = LONG_PROMPT * 40
    token_ids = tokenizer.encode(text)
    assert len(token_ids) > 4096 + 1000  # the context of the tiny preset
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt=token_ids, max_tokens=4)
    assert caught.value.code == "context_length_exceeded"  # type: ignore[attr-defined]
    kept = token_ids[-200:] if side == "left" else token_ids[:200]
    truncation = {"truncate_prompt_tokens": 200, "truncation_side": side}
    expected = _hf_greedy_steps(hf_model, kept, lambda _sequence, scores: scores)
    assert _greedy_token_ids(client, token_ids, extra_body=truncation) == expected
    # As text, echoed: the echo is the prompt the model read, and usage counts it.
    echoed = client.completions.create(
        model="tiny", prompt=text, max_tokens=3, temperature=0, echo=True, extra_body={**truncation, "ignore_eos": True}
    )
    assert echoed.usage is not None and echoed.usage.prompt_tokens == 200
    assert echoed.choices[0].text == tokenizer.decode(kept + expected[:3])


def test_chat_and_responses_cut_a_conversation_too_long_for_the_context(client: openai.OpenAI) -> None:
    """vLLM's ``truncate_prompt_tokens: -1`` on a chat (room left for its max_tokens), and the Responses API's
    ``truncation: "auto"`` through the official SDK (the oldest turns dropped); without them both are a 400."""
    messages = [{"role": "user", "content": LONG_PROMPT * 40}]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)  # type: ignore[arg-type]
    chat = client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        extra_body={"truncate_prompt_tokens": -1, "ignore_eos": True},
    )
    assert chat.usage is not None and (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (4096 - 8, 8)
    turns: list[Any] = [
        {"role": role, "content": f"turn {i}: {LONG_PROMPT * 4}"} for i in range(14) for role in ("user", "assistant")
    ][:-1]
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="tiny", input=turns, max_output_tokens=16)
    assert caught.value.code == "context_length_exceeded"  # type: ignore[attr-defined]
    answer = client.responses.create(model="tiny", input=turns, max_output_tokens=16, truncation="auto")
    assert answer.status in ("completed", "incomplete") and answer.truncation == "auto"
    assert answer.usage is not None and 4096 // 2 < answer.usage.input_tokens <= 4096 - 16


def _extra(item: Any, name: str) -> Any:
    """A field the SDK's models do not name (vLLM's), as the server sent it."""
    return (item.model_extra or {}).get(name)


def test_return_token_ids_gives_the_prompts_and_the_answers_ids(
    client: openai.OpenAI, tokenizer: Tokenizer, hf_tokenizer: Any
) -> None:
    token_ids = tokenizer.encode(LONG_PROMPT)
    fields = {"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 12, "temperature": 0}
    extra_body = {"return_token_ids": True, "ignore_eos": True}
    whole = client.completions.create(**fields, extra_body=extra_body).choices[0]  # type: ignore[call-overload]
    assert _extra(whole, "prompt_token_ids") == token_ids
    assert _extra(whole, "token_ids") == _greedy_token_ids(client, token_ids)
    assert tokenizer.decode(_extra(whole, "token_ids")) == whole.text
    chunks = [chunk.choices[0] for chunk in client.completions.create(**fields, stream=True, extra_body=extra_body)]
    assert _extra(chunks[0], "prompt_token_ids") == token_ids
    assert [t for chunk in chunks for t in _extra(chunk, "token_ids")] == _extra(whole, "token_ids")
    plain = client.completions.create(**fields).choices[0]  # type: ignore[call-overload]
    assert _extra(plain, "token_ids") is None and _extra(plain, "prompt_token_ids") is None
    # A chat whose answer is a forced tool call: its text is held back while the call is split off, its ids are
    # held with it and sent with the next chunk.
    chat = {
        "model": "tiny",
        "messages": AGENT_TURN,
        "tools": [READ_FILE],
        "tool_choice": "required",
        "max_tokens": 24,
        "temperature": 0,
    }
    answer = client.chat.completions.create(**chat, extra_body={"return_token_ids": True})  # type: ignore[call-overload]
    expected_prompt = _hf_chat_ids(hf_tokenizer, AGENT_TURN, tools=[READ_FILE], add_generation_prompt=True)
    assert _extra(answer, "prompt_token_ids") == expected_prompt
    answer_ids = _extra(answer.choices[0], "token_ids")
    assert answer.usage is not None and len(answer_ids) == answer.usage.completion_tokens == 24
    assert tokenizer.decode(answer_ids).startswith("<tool_call>")
    stream = client.chat.completions.create(**chat, stream=True, extra_body={"return_token_ids": True})  # type: ignore[call-overload]
    streamed = [chunk for chunk in stream]
    assert _extra(streamed[0], "prompt_token_ids") == expected_prompt
    streamed_ids = [t for chunk in streamed for choice in chunk.choices for t in _extra(choice, "token_ids") or []]
    assert streamed_ids == answer_ids
    # gRPC's return_prompt_token_ids: the first message carries the prompt's ids as the model reads them, a
    # chat's as the template renders it, a text's as truncation kept it; not asked, none.
    question = [{"role": "user", "content": "What is in README.md?"}]
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        stub = pb_grpc.RayTurnStub(channel)
        greedy = pb.SamplingOptions(max_tokens=3, temperature=0)
        chat_request = pb.GenerateRequest(
            messages=pb.Messages(messages=[pb.ChatMessage(**question[0])]),
            sampling=greedy,
            return_prompt_token_ids=True,
        )
        replies = list(stub.Generate(chat_request, timeout=120))
        assert list(replies[0].prompt_token_ids) == _hf_chat_ids(hf_tokenizer, question, add_generation_prompt=True)
        # Tokenize: the same ids without the call, and the context's length.
        counted = stub.Tokenize(chat_request, timeout=120)
        assert list(counted.token_ids) == list(replies[0].prompt_token_ids) and counted.max_model_len == 4096
        assert len(replies) > 1 and not any(reply.prompt_token_ids for reply in replies[1:])
        cut = pb.SamplingOptions(max_tokens=2, temperature=0, truncate_prompt_tokens=20)
        asked = pb.GenerateRequest(text=LONG_PROMPT, sampling=cut, return_prompt_token_ids=True)
        replies = list(stub.Generate(asked, timeout=120))
        assert list(replies[0].prompt_token_ids) == token_ids[-20:] and replies[-1].usage.prompt_tokens == 20
        plain = stub.Generate(pb.GenerateRequest(text=LONG_PROMPT, sampling=greedy), timeout=120)
        assert not any(reply.prompt_token_ids for reply in plain)


def test_continuous_usage_stats_count_every_chunks_tokens(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    """vLLM's ``continuous_usage_stats``: each chunk's usage counts the ids sent up to it (``return_token_ids``), a
    chat's long prompt (the prefill pool's) and a completion's alike, and the final usage chunk ends the stream."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    extra_body = {"return_token_ids": True, "ignore_eos": True}
    chat = client.chat.completions.create(  # type: ignore[call-overload]
        model="tiny",
        messages=[{"role": "user", "content": LONG_PROMPT}],
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options=options,
        extra_body=extra_body,
    )
    completion = client.completions.create(  # type: ignore[call-overload]
        model="tiny",
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options=options,
        extra_body=extra_body,
    )
    for chunks in (list(chat), list(completion)):
        *streamed, final = chunks
        assert final.choices == [] and final.usage is not None and final.usage.completion_tokens == 10
        sent = 0
        for chunk in streamed:
            sent += sum(len(_extra(choice, "token_ids") or []) for choice in chunk.choices)
            assert chunk.usage is not None and chunk.usage.completion_tokens == sent
            assert chunk.usage.prompt_tokens == final.usage.prompt_tokens
            assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + sent
        assert sent == 10
    assert chunks[0].usage is not None and chunks[0].usage.prompt_tokens == len(tokenizer.encode(PROMPT))


def test_chat_logit_bias_forces_a_token_and_names_one_outside_the_vocabulary(
    client: openai.OpenAI, tokenizer: Tokenizer
) -> None:
    (forced,) = tokenizer.encode("x")
    messages: Any = [{"role": "user", "content": "say anything"}]
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, temperature=0, logit_bias={str(forced): 100}
    )
    assert chat.choices[0].message.content == "xxxxx"
    vocab_size = json.loads((preset_dir("tiny") / "config.json").read_text())["vocab_size"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, logit_bias={str(vocab_size): 5})
    assert caught.value.param == "logit_bias"  # type: ignore[attr-defined]
    assert f"out of vocabulary [0, {vocab_size}): [{vocab_size}]" in caught.value.message


def test_min_tokens_and_min_p_are_honoured(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    first = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=1,
        temperature=0,
        logprobs=0,
        extra_body={"return_tokens_as_token_ids": True},
    )
    assert first.choices[0].logprobs is not None and first.choices[0].logprobs.tokens is not None
    first_token = int(first.choices[0].logprobs.tokens[0].removeprefix("token_id:"))
    stopped = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"stop_token_ids": [first_token]}
    )
    assert stopped.usage is not None and stopped.usage.completion_tokens == 1
    held = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"stop_token_ids": [first_token], "min_tokens": 5},
    )
    assert held.usage is not None and held.usage.completion_tokens >= 5
    greedy = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    for seed in (1, 2):
        only_the_best = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=seed, extra_body={"min_p": 1.0}
        )
        assert only_the_best.choices[0].text == greedy.choices[0].text


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("use_beam_search", True),
        ("guided_decoding_backend", "xgrammar"),
        ("length_penalty", 0.5),
        ("spaces_between_special_tokens", False),
    ],
)
def test_fields_not_supported_are_refused_by_name(client: openai.OpenAI, field: str, value: Any) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={field: value})
    assert caught.value.param == field  # type: ignore[attr-defined]
    assert f"'{field}'" in caught.value.message


# ---------------------------------------------------------------- logprob tokens


def test_logprob_tokens_carry_their_raw_bytes_and_alternatives_never_collide(
    client: openai.OpenAI, tokenizer: Tokenizer
) -> None:
    """The tiny model's tokens are single bytes; those past ASCII are half characters, all decoding to U+FFFD."""
    completion = client.completions.create(model="tiny", prompt="héllo wörld", max_tokens=4, temperature=0, logprobs=20)
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.top_logprobs is not None
    assert all(len(top) == 20 for top in logprobs.top_logprobs)
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "héllo"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=20,
    )
    content = chat.choices[0].logprobs
    assert content is not None and content.content is not None
    for entry in content.content:
        assert len({top.token for top in entry.top_logprobs}) == 20
        for top in [entry, *entry.top_logprobs]:
            assert top.bytes is not None and len(top.bytes) >= 1
            raw = bytes(top.bytes)
            try:
                assert top.token == raw.decode("utf-8")
            except UnicodeDecodeError:
                assert top.token == "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)


# ---------------------------------------------------------------- per-call energy, speculative decoding per call


def _energy(usage: Any) -> dict[str, Any]:
    """rayturn's ``usage.energy`` (an extension the SDK keeps among its extra fields), checked for its shape."""
    energy = (usage.model_extra or {})["energy"]
    assert energy["joules"] > 0
    assert set(energy["meter"].split("+")) <= {"model", "rapl", "nvml"}
    return dict(energy)


def _energy_counted_j(server: str) -> float:
    """The ingress's ``rayturn_energy_joules`` counter, summed over meters."""
    families = text_string_to_metric_families(requests.get(f"{server}/metrics", timeout=30).text)
    return sum(
        sample.value
        for family in families
        if family.name == "rayturn_energy_joules"
        for sample in family.samples
        if sample.name.endswith("_total")
    )


def test_usage_carries_each_calls_energy_and_its_sessions_total(server: str, client: openai.OpenAI) -> None:
    counted_before_j = _energy_counted_j(server)
    session = {"x-session-id": "energy-session"}
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": LONG_PROMPT}],  # past the threshold: the prefill pool's joules too
        max_tokens=6,
        temperature=0,
        extra_headers=session,
    )
    streamed = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers=session,
        )
    )
    completion = client.completions.create(
        model="tiny", prompt=[PROMPT, LONG_PROMPT], max_tokens=4, temperature=0, extra_headers=session
    )
    alone = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
    energies = [_energy(chat.usage), _energy(streamed[-1].usage), _energy(completion.usage), _energy(alone.usage)]
    assert [energy["session_joules"] is None for energy in energies] == [False, False, False, True]
    in_session_j = [energy["joules"] for energy in energies[:3]]
    # Each call's usage carries its session's total so far, this call included.
    assert [energy["session_joules"] for energy in energies[:3]] == pytest.approx(
        [sum(in_session_j[: i + 1]) for i in range(3)]
    )
    counted_j = _energy_counted_j(server) - counted_before_j
    assert counted_j == pytest.approx(sum(energy["joules"] for energy in energies))


def test_responses_usage_carries_each_calls_energy_and_its_sessions_total(client: openai.OpenAI) -> None:
    """The Responses API's ``usage.energy``: the call's joules and its session's total (kept by the one ingress
    replica), in the answer and in a stream's final response."""
    session = {"x-session-id": "responses-energy"}
    answer = client.responses.create(
        model="tiny", input="Review: " + "a = b\n" * 20, max_output_tokens=4, temperature=0, extra_headers=session
    )
    events = list(
        client.responses.create(
            model="tiny", input="hi", max_output_tokens=4, temperature=0, stream=True, extra_headers=session
        )
    )
    final = events[-1].response  # type: ignore[union-attr]
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert answer.usage is not None and final.usage is not None
    energies = [(usage.model_extra or {})["energy"] for usage in (answer.usage, final.usage)]
    for energy in energies:
        assert energy["joules"] > 0 and set(energy["meter"].split("+")) <= {"model", "rapl", "nvml"}
    assert [energy["session_joules"] for energy in energies] == pytest.approx(
        [energies[0]["joules"], energies[0]["joules"] + energies[1]["joules"]]
    )


def test_speculative_decoding_per_call_gives_the_same_greedy_answer(server: str, client: openai.OpenAI) -> None:
    """The server's default is off; ``speculative: true`` turns drafting on for one call, and the answer is the
    same token for token, streamed or not."""

    def drafts() -> int:
        return int(requests.get(f"{server}/health", timeout=30).json()["details"]["decode.speculation"]["num_drafts"])

    drafts_before = drafts()
    prompt = "x = [1, 2, 3]\ny = [1, 2, 3]\n" * 4
    answers = {}
    for switch in (None, False, True):
        body: dict[str, Any] = {"ignore_eos": True, **({} if switch is None else {"speculative": switch})}
        answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=48, temperature=0, extra_body=body)
        answers[switch] = answer.choices[0].text
    chunks = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=48,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "speculative": True},
    )
    streamed = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert answers[True] == answers[False] == answers[None] == streamed
    deadline = time.monotonic() + 30  # the replica's figures are refreshed as its engine goes idle
    while drafts() <= drafts_before:  # the switched-on calls did verify drafts
        assert time.monotonic() < deadline, "no draft was verified"
        time.sleep(0.2)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={"speculative": "yes"})
    assert caught.value.param == "speculative"  # type: ignore[attr-defined]


# ---------------------------------------------------------------- structured outputs

CHOICES = ["alpha", "alps", "beta", "bet", "gamma"]
PATTERN = r"[0-9]{2}(-[a-c]+)?"


class AllowedNext:
    """The reference for a constraint, written from what it allows rather than by a grammar compiler: each step
    masks every token whose text would not keep the answer a prefix of an allowed one (``partial``), and lets EOS
    through where the answer so far is a whole one (``whole``)."""

    def __init__(self, prompt_len: int, tokenizer: Tokenizer, partial: Any, whole: Any) -> None:
        self.prompt_len, self.tokenizer, self.partial, self.whole = prompt_len, tokenizer, partial, whole
        vocab_size = json.loads((preset_dir("tiny") / "config.json").read_text())["vocab_size"]
        self.pieces = [tokenizer.decode([token_id]) for token_id in range(vocab_size)]

    def __call__(self, sequence: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        text = self.tokenizer.decode(sequence[0, self.prompt_len :].tolist())
        allowed = [t for t, piece in enumerate(self.pieces) if piece and self.partial(text + piece)]
        if self.whole(text):
            allowed.append(self.tokenizer.eos_token_id)
        masked = torch.full_like(scores, float("-inf"))
        masked[:, allowed] = scores[:, allowed]
        return masked


def _reference_text(hf_model: Any, tokenizer: Tokenizer, token_ids: list[int], allowed: AllowedNext) -> str:
    steps = _hf_greedy_steps(hf_model, token_ids, allowed)
    eos = tokenizer.eos_token_id
    return tokenizer.decode(steps[: steps.index(eos)] if eos in steps else steps)


@pytest.mark.parametrize("prompt", [PROMPT, LONG_PROMPT], ids=["local", "disaggregated"])
def test_structured_outputs_match_transformers_under_the_same_constraint(
    client: openai.OpenAI, tokenizer: Tokenizer, hf_model: Any, prompt: str
) -> None:
    """A choice and a regex, in vLLM's current form and its earlier one, and over gRPC, on the local and the
    disaggregated path (where the prefill replica samples the first token under the guide): the greedy answer
    equals transformers' with every token the constraint forbids masked."""
    regex = pytest.importorskip("regex")
    token_ids = tokenizer.encode(prompt)
    plain = client.completions.create(model="tiny", prompt=token_ids, max_tokens=12, temperature=0).choices[0].text
    cases = [
        (
            {"structured_outputs": {"choice": CHOICES}},
            lambda s: any(c.startswith(s) for c in CHOICES),
            CHOICES.__contains__,
        ),
        ({"guided_choice": CHOICES}, lambda s: any(c.startswith(s) for c in CHOICES), CHOICES.__contains__),
        (
            {"structured_outputs": {"regex": PATTERN}},
            lambda s: regex.fullmatch(PATTERN, s, partial=True) is not None,
            lambda s: regex.fullmatch(PATTERN, s) is not None,
        ),
    ]
    for body, partial, whole in cases:
        expected = _reference_text(
            hf_model, tokenizer, token_ids, AllowedNext(len(token_ids), tokenizer, partial, whole)
        )
        assert whole(expected) and expected != plain, body
        answer = client.completions.create(
            model="tiny", prompt=token_ids, max_tokens=12, temperature=0, extra_body=body
        )
        assert answer.choices[0].text == expected, body
        if "structured_outputs" in body:
            form = pb.StructuredOutput(**{key: _grpc_value(value) for key, value in body["structured_outputs"].items()})
            assert (
                _grpc_text(token_ids, pb.SamplingOptions(max_tokens=12, temperature=0, structured_output=form))
                == expected
            )


def _grpc_value(value: Any) -> Any:
    return pb.Choices(values=value) if isinstance(value, list) else value


def _grpc_text(token_ids: list[int], sampling: Any) -> str:
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=token_ids), sampling=sampling)
        return "".join(response.text for response in pb_grpc.RayTurnStub(channel).Generate(request, timeout=120))


def test_structured_outputs_on_chat_streamed_sampled_and_refused(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Is it sunny?"}]
    chunks = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, stream=True, extra_body={"guided_choice": CHOICES}
    )
    pieces = [(c.choices[0].delta.content or "", c.choices[0].finish_reason) for c in chunks if c.choices]
    assert "".join(text for text, _ in pieces) in CHOICES and pieces[-1][1] == "stop"
    sampled = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, n=4, temperature=1.0, seed=7,
        extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no" | "maybe " [0-9]'}},
    )  # fmt: skip
    for choice in sampled.choices:
        assert re.fullmatch("yes|no|maybe [0-9]", choice.message.content or ""), choice.message.content
        assert choice.finish_reason == "stop"
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2, 3]}}, "required": ["a"]}
    closed = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=24, temperature=0,
        extra_body={"structured_outputs": {"json": schema, "disable_additional_properties": True}},
    )  # fmt: skip
    assert json.loads(closed.choices[0].message.content or "") in ({"a": 1}, {"a": 2}, {"a": 3})
    refusals = [
        ({"structured_outputs": {"regex": "(?=a)b"}}, "structured_outputs.regex", "look-around"),
        ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice", "response_format"),
        ({"structured_outputs": {"regex": "a", "json_object": True}}, "structured_outputs.json_object", "ask for one"),
    ]
    for body, param, words in refusals:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, extra_body=body)
        assert caught.value.param == param and words in caught.value.message  # type: ignore[attr-defined]


def test_x_request_id_comes_back_once_and_names_the_call(server: str, client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "hi"}]
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=messages, max_tokens=2, extra_headers={"X-Request-Id": "trace-compat-1"}
    )
    assert raw.headers.get_list("x-request-id") == ["trace-compat-1"]  # once: Serve's proxy echoes it
    assert raw.parse()._request_id == "trace-compat-1"
    minted = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=2)
    assert len(minted.headers.get_list("x-request-id")) == 1 and minted.headers["x-request-id"]
    # The call's own id (here in Anthropic's request-id) starts with the client's value; two calls stay apart.
    body = {"model": "tiny", "max_tokens": 2, "messages": messages}
    answers = [
        requests.post(f"{server}/v1/messages", json=body, headers={"X-Request-Id": "trace-anthropic"}, timeout=120)
        for _ in range(2)
    ]
    for answer in answers:
        assert answer.status_code == 200 and answer.headers["x-request-id"] == "trace-anthropic"
        assert re.fullmatch(r"trace-anthropic-[0-9a-f]{12}", answer.headers["request-id"]), answer.headers
    assert answers[0].headers["request-id"] != answers[1].headers["request-id"]


def test_a_bad_x_request_id_is_a_400_naming_the_header_and_the_server_serves_on(
    server: str, client: openai.OpenAI
) -> None:
    messages: Any = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=2, extra_headers={"X-Request-Id": "x" * 129}
        )
    assert caught.value.param == "x-request-id" and "129" in caught.value.message  # type: ignore[attr-defined]
    body = {"model": "tiny", "max_tokens": 2, "messages": messages}
    answer = requests.post(f"{server}/v1/messages", json=body, headers={"X-Request-Id": "two words"}, timeout=120)
    assert answer.status_code == 400 and answer.json()["type"] == "error"
    assert "'x-request-id'" in answer.json()["error"]["message"]
    served_on = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert served_on.choices[0].finish_reason == "length"

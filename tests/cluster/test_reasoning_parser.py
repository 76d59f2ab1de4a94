"""``rayturn serve --reasoning-parser qwen3``, as a vLLM user starts a thinking model, with the official clients.

The ``tiny`` preset's random weights never write ``</think>``, so each answer is one that never ends its
reasoning: all of it is reasoning, as vLLM's ``qwen3`` parser reads it. That makes the same greedy text the
reference for every API: the raw completion of the same prompt ids (``/v1/completions``, which no reasoning
parser touches) is the chat answer's ``reasoning``, the Messages answer's thinking block, the Responses answer's
reasoning item and gRPC's ``reasoning``, and a guided answer's reasoning too (its guide waits for the end of the
reasoning); and it is the answer's ``content`` once the request turns thinking off
(``chat_template_kwargs.enable_thinking``, ``reasoning_effort: none``, Anthropic's disabled thinking). Prompts
longer than the threshold go through the prefill pool, so the split also covers an answer whose first token
came from there.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from rayturn_cli import serve_process

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
requests = pytest.importorskip("requests")
grpc = pytest.importorskip("grpc")

from rayturn.engine.presets import preset_dir  # noqa: E402
from rayturn.engine.tokenizer import Tokenizer  # noqa: E402
from rayturn.protos import rayturn_pb2 as pb  # noqa: E402
from rayturn.protos import rayturn_pb2_grpc as pb_grpc  # noqa: E402

HTTP_PORT, GRPC_PORT = 28731, 29731
BASE = f"http://127.0.0.1:{HTTP_PORT}"
CONFIG = """\
model:
  num_pages: 256
prefill:
  num_cpus: 0.25
decode:
  num_cpus: 0.25
router:
  disaggregation_threshold_tokens: 16
"""
MESSAGES: Any = [{"role": "user", "content": "Plan a refactor of the parser module, then say which file to open."}]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory = tmp_path_factory.mktemp("serve")
    config = directory / "rayturn.yaml"
    config.write_text(CONFIG)
    args = ["--model", "tiny", "--config", str(config), "--reasoning-parser", "qwen3"]
    args += ["--http-port", str(HTTP_PORT), "--grpc-port", str(GRPC_PORT)]
    with serve_process(args, directory, BASE) as base:
        yield base


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def raw(server: str, client: openai.OpenAI) -> str:
    """The greedy answer to ``MESSAGES`` as the model wrote it: a completion of the chat's own prompt ids."""
    prompt = requests.post(f"{server}/tokenize", json={"messages": MESSAGES}, timeout=60).json()["tokens"]
    assert len(prompt) > 16  # through the prefill pool
    text = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0).choices[0].text
    assert "</think>" not in text and "<tool_call>" not in text and text.strip()
    return text


def _chat(client: openai.OpenAI, **fields: Any) -> Any:
    return client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, **fields
    )


def test_an_answer_that_never_ends_its_reasoning_is_all_reasoning(client: openai.OpenAI, raw: str) -> None:
    answer = _chat(client)
    message = answer.choices[0].message
    assert message.model_extra["reasoning"] == raw.strip()
    assert message.content is None
    tokens = Tokenizer.from_dir(preset_dir("tiny")).count_tokens(raw.strip())
    # The reasoning as the tokenizer encodes it, at most the answer's own length (as every API counts it).
    assert answer.usage.completion_tokens_details.reasoning_tokens == min(tokens, answer.usage.completion_tokens) > 0


def test_the_streamed_reasoning_is_the_whole_answers(client: openai.OpenAI, raw: str) -> None:
    reasoning, content = [], []
    for chunk in _chat(client, stream=True):
        for choice in chunk.choices:
            reasoning.append((choice.delta.model_extra or {}).get("reasoning") or "")
            content.append(choice.delta.content or "")
    assert "".join(reasoning) == raw.strip()
    assert "".join(content) == ""


@pytest.mark.parametrize(
    "fields",
    [{"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}, {"reasoning_effort": "none"}],
    ids=["enable_thinking-false", "effort-none"],
)
def test_an_answer_without_thinking_is_content(client: openai.OpenAI, raw: str, fields: dict[str, Any]) -> None:
    message = _chat(client, **fields).choices[0].message
    assert "reasoning" not in (message.model_extra or {})
    assert message.content == raw  # the same prompt: tiny's template reads neither variable


def test_a_guided_answer_thinks_freely_first(client: openai.OpenAI, raw: str) -> None:
    """The guide waits for ``</think>``, which tiny never writes: the answer is the free model's reasoning, no
    token masked. Without thinking, the guide holds from the first token: the content is the grammar's."""
    guided = {"response_format": {"type": "json_object"}}
    thinking = _chat(client, **guided).choices[0].message
    assert thinking.model_extra["reasoning"] == raw.strip() and thinking.content is None
    off = _chat(client, **guided, reasoning_effort="none").choices[0].message
    assert "reasoning" not in (off.model_extra or {})
    assert off.content.startswith("{") and off.content != raw


def test_messages_answer_with_a_thinking_block(server: str, raw: str) -> None:
    client = anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=120)
    answer = client.messages.create(
        model="tiny", max_tokens=MAX_TOKENS, messages=MESSAGES, extra_body={"temperature": 0}
    )
    assert [(block.type, block.thinking) for block in answer.content] == [("thinking", raw.strip())]
    off = client.messages.create(
        model="tiny",
        max_tokens=MAX_TOKENS,
        messages=MESSAGES,
        extra_body={"temperature": 0},
        thinking={"type": "disabled"},
    )
    assert [(block.type, block.text) for block in off.content] == [("text", raw)]
    streamed = []
    with client.messages.stream(
        model="tiny", max_tokens=MAX_TOKENS, messages=MESSAGES, extra_body={"temperature": 0}
    ) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                assert event.delta.type == "thinking_delta"
                streamed.append(event.delta.thinking)
    assert "".join(streamed) == raw.strip()


def test_responses_answer_with_a_reasoning_item(client: openai.OpenAI, raw: str) -> None:
    answer = client.responses.create(model="tiny", input=MESSAGES, max_output_tokens=MAX_TOKENS, temperature=0)
    reasoning = [item for item in answer.output if item.type == "reasoning"]
    assert [part.text for item in reasoning for part in item.content or []] == [raw.strip()]
    assert 0 < answer.usage.output_tokens_details.reasoning_tokens <= answer.usage.output_tokens


def test_grpc_streams_the_reasoning_apart(server: str, raw: str) -> None:
    messages = pb.Messages(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES])
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        stub = pb_grpc.RayTurnStub(channel)
        sampling = pb.SamplingOptions(max_tokens=MAX_TOKENS, temperature=0)
        responses = list(stub.Generate(pb.GenerateRequest(messages=messages, sampling=sampling), timeout=120))
        off = list(
            stub.Generate(
                pb.GenerateRequest(
                    messages=messages, sampling=sampling, chat_template_kwargs_json='{"enable_thinking": false}'
                ),
                timeout=120,
            )
        )
    assert "".join(response.reasoning for response in responses) == raw.strip()
    assert "".join(response.text for response in responses) == ""
    assert "".join(response.text for response in off) == raw
    assert "".join(response.reasoning for response in off) == ""


BUDGET = 3


@pytest.fixture(scope="module")
def bounded(server: str, client: openai.OpenAI) -> tuple[str, str]:
    """The reasoning and answer a budget of ``BUDGET`` tokens makes, from the free model: its first ``BUDGET``
    tokens, then (``</think>`` forced) its greedy continuation of all that."""
    prompt = requests.post(f"{server}/tokenize", json={"messages": MESSAGES}, timeout=60).json()["tokens"]
    first = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=BUDGET,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    ).choices[0]
    ids = [int(token.removeprefix("token_id:")) for token in first.logprobs.tokens]
    end = requests.post(
        f"{server}/tokenize", json={"prompt": "</think>", "add_special_tokens": False}, timeout=60
    ).json()
    rest = (
        client.completions.create(
            model="tiny",
            prompt=prompt + ids + end["tokens"],
            max_tokens=MAX_TOKENS - BUDGET - end["count"],
            temperature=0,
        )
        .choices[0]
        .text
    )
    return first.text.strip(), rest.strip()


def test_a_budget_ends_the_reasoning_and_the_model_answers_after_it(
    client: openai.OpenAI, bounded: tuple[str, str]
) -> None:
    reasoning, answer = bounded
    message = _chat(client, extra_body={"thinking_token_budget": BUDGET}).choices[0].message
    assert (message.model_extra["reasoning"], message.content or "") == (reasoning, answer)
    streamed = {"reasoning": [], "content": []}
    for chunk in _chat(client, stream=True, extra_body={"thinking_token_budget": BUDGET}):
        for choice in chunk.choices:
            streamed["reasoning"].append((choice.delta.model_extra or {}).get("reasoning") or "")
            streamed["content"].append(choice.delta.content or "")
    assert ("".join(streamed["reasoning"]), "".join(streamed["content"])) == (reasoning, answer)


def test_claude_codes_thinking_budget_bounds_the_reasoning(server: str, bounded: tuple[str, str]) -> None:
    client = anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=120)
    answer = client.messages.create(
        model="tiny",
        max_tokens=MAX_TOKENS,
        messages=MESSAGES,
        thinking={"type": "enabled", "budget_tokens": BUDGET},
        extra_body={"temperature": 0},
    )
    reasoning, text = bounded
    expected = [("thinking", reasoning)] + ([("text", text)] if text else [])
    assert [
        (block.type, block.thinking if block.type == "thinking" else block.text) for block in answer.content
    ] == expected


def test_a_bounded_guided_answer_thinks_then_answers_under_the_guide(
    client: openai.OpenAI, bounded: tuple[str, str]
) -> None:
    message = (
        _chat(client, response_format={"type": "json_object"}, extra_body={"thinking_token_budget": BUDGET})
        .choices[0]
        .message
    )
    assert message.model_extra["reasoning"] == bounded[0]
    assert message.content.startswith("{")


def test_bad_budgets_are_refused_naming_the_field(server: str) -> None:
    for value in (-2, "8", 1.5):
        response = requests.post(
            f"{server}/v1/chat/completions", json={"messages": MESSAGES, "thinking_token_budget": value}, timeout=60
        )
        assert response.status_code == 400 and response.json()["error"]["param"] == "thinking_token_budget"
    response = requests.post(f"{server}/v1/completions", json={"prompt": "x", "thinking_token_budget": 4}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "thinking_token_budget"
    document = requests.get(f"{server}/openapi.json", timeout=60).json()
    chat_schema = document["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"][
        "schema"
    ]
    assert chat_schema["properties"]["thinking_token_budget"] == {
        "type": "integer",
        "minimum": -1,
        "maximum": 2**63 - 1,
    }


def test_include_reasoning_false_leaves_it_out(client: openai.OpenAI) -> None:
    answer = _chat(client, extra_body={"include_reasoning": False})
    message = answer.choices[0].message
    assert "reasoning" not in (message.model_extra or {}) and message.content is None
    assert answer.usage.completion_tokens_details.reasoning_tokens > 0  # still counted: the model still thought


def test_grpc_takes_vllms_budget(server: str, bounded: tuple[str, str]) -> None:
    messages = pb.Messages(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES])
    sampling = pb.SamplingOptions(max_tokens=MAX_TOKENS, temperature=0, thinking_token_budget=BUDGET)
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        stub = pb_grpc.RayTurnStub(channel)
        responses = list(stub.Generate(pb.GenerateRequest(messages=messages, sampling=sampling), timeout=120))
        with pytest.raises(grpc.RpcError) as refused:
            stub.Generate(pb.GenerateRequest(text="x", sampling=sampling), timeout=120).next()
    assert "".join(r.reasoning for r in responses) == bounded[0]
    assert "".join(r.text for r in responses) == bounded[1]
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.thinking_token_budget" in refused.value.details()

"""Anthropic's Messages API on the whole cluster, with the official ``anthropic`` SDK.

Greedy answers equal the chat completions answer for the same conversation
(the chat API is checked against the offline engine in test_cluster_serve),
streamed or not; usage splits the prompt into cache reads, cache creation and
the rest, on the disaggregated path too; a tool call forced with
``tool_choice: any`` comes back as a ``tool_use`` block, and the
``tool_result`` call after it reads the conversation from the cache; errors
come in Anthropic's shape and status codes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")

from small_cluster import serving, small_cluster  # noqa: E402

from rayturn.cluster.config import load_config  # noqa: E402
from rayturn.engine.presets import preset_dir  # noqa: E402
from rayturn.engine.tokenizer import Tokenizer  # noqa: E402

HTTP_PORT, GRPC_PORT = 28511, 29511
API_KEY = "anthropic-test-key"
THRESHOLD = 48
MAX_MODEL_LEN = 1024
OVERRIDES = small_cluster(
    HTTP_PORT,
    GRPC_PORT,
    THRESHOLD,
    **{"server.api_keys": [API_KEY], "server.max_request_bytes": 64 << 10, "model.max_model_len": MAX_MODEL_LEN},
)
PAGE = 16
# Today's SDK has no sampling parameters; the server still takes them.
GREEDY = {"temperature": 0}
WEATHER = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
        "required": ["city"],
    },
}
SYSTEM = [{"type": "text", "text": "You are a terse coding agent. " * 4, "cache_control": {"type": "ephemeral"}}]


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    with serving(load_config(**OVERRIDES)) as url:
        yield url


@pytest.fixture(scope="module")
def client(cluster: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=cluster, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat_client(cluster: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _chat_answer(chat_client: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int) -> tuple[str, int]:
    response = chat_client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=max_tokens, temperature=0
    )  # type: ignore[arg-type]
    assert response.usage is not None
    return response.choices[0].message.content or "", response.usage.prompt_tokens


@pytest.mark.parametrize("words", [1, 30], ids=["local-prefill", "disaggregated"])
def test_answers_equal_chat_completions(client: anthropic.Anthropic, chat_client: openai.OpenAI, words: int) -> None:
    question = "Summarise this file: " + "import os " * words + f" ({words})"
    expected, prompt_tokens = _chat_answer(
        chat_client, [{"role": "system", "content": SYSTEM[0]["text"]}, {"role": "user", "content": question}], 10
    )
    message = client.messages.create(
        model="tiny", max_tokens=10, extra_body=GREEDY, system=SYSTEM, messages=[{"role": "user", "content": question}]
    )
    assert message.content[0].type == "text" and message.content[0].text == expected
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 10
    usage = message.usage
    # The chat call cached the prompt's full pages: this one reads them all.
    assert usage.cache_read_input_tokens == (prompt_tokens - 1) // PAGE * PAGE
    assert (
        usage.input_tokens + usage.cache_read_input_tokens + (usage.cache_creation_input_tokens or 0) == prompt_tokens
    )

    with client.messages.stream(
        model="tiny", max_tokens=10, extra_body=GREEDY, system=SYSTEM, messages=[{"role": "user", "content": question}]
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].type == "text" and final.content[0].text == expected
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert final.usage.output_tokens == 10 and final.stop_reason == "max_tokens"


def test_first_call_creates_the_cache_and_the_next_reads_it(client: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": "A fresh question about caching " * 5}]
    cold = client.messages.create(model="tiny", max_tokens=3, extra_body=GREEDY, messages=messages)  # type: ignore[arg-type]
    assert cold.usage.cache_read_input_tokens == 0 and (cold.usage.cache_creation_input_tokens or 0) > 0
    total = cold.usage.input_tokens + (cold.usage.cache_creation_input_tokens or 0)
    counted = client.messages.count_tokens(model="tiny", messages=messages)  # type: ignore[arg-type]
    assert counted.input_tokens == total
    warm = client.messages.create(model="tiny", max_tokens=3, extra_body=GREEDY, messages=messages)  # type: ignore[arg-type]
    assert warm.usage.cache_read_input_tokens == cold.usage.cache_creation_input_tokens
    assert warm.content == cold.content


def test_max_tokens_past_the_context_is_capped(client: anthropic.Anthropic) -> None:
    message = client.messages.create(
        model="tiny", max_tokens=32000, extra_body=GREEDY, messages=[{"role": "user", "content": "go on"}], timeout=300
    )
    usage = message.usage
    prompt = usage.input_tokens + usage.cache_read_input_tokens + (usage.cache_creation_input_tokens or 0)
    if message.stop_reason == "max_tokens":
        assert usage.output_tokens == MAX_MODEL_LEN - prompt
    else:  # the model ended on its own before the room ran out
        assert message.stop_reason == "end_turn" and usage.output_tokens < MAX_MODEL_LEN - prompt


def test_forced_tool_use_round_trip(client: anthropic.Anthropic) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Rome? Use the tool."}]
    first = client.messages.create(
        model="tiny",
        max_tokens=60,
        extra_body=GREEDY,
        system=SYSTEM,
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "any"},
        messages=messages,  # type: ignore[arg-type]
        extra_headers={"x-claude-code-session-id": "anthropic-round-trip"},
    )
    calls = [block for block in first.content if block.type == "tool_use"]
    assert first.stop_reason == "tool_use" and calls, first.content
    call = calls[0]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    assert isinstance(call.input, dict) and call.input.get("city") in ("Paris", "Rome", "Oslo")
    messages += [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"}]},
    ]
    with client.messages.stream(
        model="tiny",
        max_tokens=8,
        extra_body=GREEDY,
        system=SYSTEM,
        tools=[WEATHER],  # type: ignore[list-item]
        messages=messages,  # type: ignore[arg-type]
        extra_headers={"x-claude-code-session-id": "anthropic-round-trip"},
    ) as stream:
        second = stream.get_final_message()
    assert second.usage.cache_read_input_tokens > 0


def test_errors_in_anthropics_shape(cluster: str, client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as not_found:
        client.messages.create(model="claude-opus-4", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert not_found.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(
            model="tiny",
            max_tokens=5,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
                    ],
                }
            ],  # type: ignore[list-item]
        )
    assert bad.value.body["type"] == "error" and "image" in bad.value.body["error"]["message"]  # type: ignore[index]
    stranger = anthropic.Anthropic(base_url=cluster, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        stranger.messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    headers = {"x-api-key": API_KEY, "content-type": "application/json", "anthropic-version": "2023-06-01"}
    huge = requests.post(
        f"{cluster}/v1/messages?beta=true", data=b'{"a": "' + b"x" * (80 << 10) + b'"}', headers=headers, timeout=30
    )
    assert huge.status_code == 413 and huge.json()["error"]["type"] == "request_too_large"
    broken = requests.post(f"{cluster}/v1/messages", data=b"{not json", headers=headers, timeout=30)
    assert broken.status_code == 400 and broken.json()["type"] == "error"
    for method, path, status in (("GET", "/v1/messages", 405), ("POST", "/v1/messages/batches", 404)):
        wrong = requests.request(method, f"{cluster}{path}", json={}, headers=headers, timeout=30)
        assert wrong.status_code == status and wrong.json()["type"] == "error", (path, wrong.text)
        assert path in wrong.json()["error"]["message"]
        assert wrong.json()["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    # The server is still up and answers.
    assert (
        client.messages.create(
            model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        ).usage.output_tokens
        == 2
    )


def test_the_models_routes_answer_anthropic_s_sdk(cluster: str, client: anthropic.Anthropic) -> None:
    """``client.models`` lists and retrieves the served model whole as ``ModelInfo``; its errors (an unknown
    model, a bad ``limit``, a wrong key) come in Anthropic's shape, while OpenAI's clients still get OpenAI's."""
    listed = client.models.list()
    assert [info.id for info in listed] == ["tiny"] and (listed.first_id, listed.has_more) == ("tiny", False)
    info = client.models.retrieve("tiny")
    assert (info.type, info.display_name, info.lifecycle, info.created_at.tzinfo is not None) == (
        "model",
        "tiny",
        "active",
        True,
    )
    assert info.max_input_tokens == MAX_MODEL_LEN and info == listed.data[0]
    assert [page.data for page in client.models.list(after_id="tiny").iter_pages()] == [[]]
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.models.retrieve("claude-opus-4")
    assert unknown.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    assert "claude-opus-4" in unknown.value.body["error"]["message"]  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.models.list(limit=0)
    assert bad.value.body["type"] == "error" and "'limit'" in bad.value.body["error"]["message"]  # type: ignore[index]
    with pytest.raises(anthropic.AuthenticationError) as stranger:
        anthropic.Anthropic(base_url=cluster, api_key="wrong", max_retries=0).models.list()
    assert stranger.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    plain = requests.get(
        f"{cluster}/v1/models/claude-opus-4", headers={"authorization": f"Bearer {API_KEY}"}, timeout=30
    )
    assert plain.status_code == 404 and plain.json()["error"]["param"] == "model"


def test_an_assistant_prefill_is_continued(client: anthropic.Anthropic, chat_client: openai.OpenAI) -> None:
    """The answer goes on from the final assistant text, as the completions API goes on from the same prompt."""
    messages = [{"role": "user", "content": "Reply in JSON: the weather."}, {"role": "assistant", "content": '{"sky":'}]
    tokenizer = Tokenizer.from_dir(preset_dir("tiny"))
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template(messages, continue_final_message=True), add_special_tokens=False
    )
    expected = chat_client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    message = client.messages.create(model="tiny", max_tokens=8, extra_body=GREEDY, messages=messages)  # type: ignore[arg-type]
    assert message.content[0].type == "text" and message.content[0].text == expected.choices[0].text
    usage = message.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0) == len(
        prompt
    )
    with pytest.raises(anthropic.BadRequestError) as trailing:
        client.messages.create(
            model="tiny", max_tokens=2, messages=[messages[0], {"role": "assistant", "content": '{"sky": '}]
        )
    assert "trailing whitespace" in trailing.value.body["error"]["message"]  # type: ignore[index]


def test_cache_control_pins_the_prefix(cluster: str, client: anthropic.Anthropic) -> None:
    """A 1 h breakpoint becomes a retention contract: the decode replica reports the pinned prefix."""

    def pinned() -> int:
        health = requests.get(f"{cluster}/health", headers={"x-api-key": API_KEY}, timeout=30).json()
        return int(health["details"]["decode.pinned_pages"])

    before = pinned()
    system = [
        {"type": "text", "text": "Pinned instructions. " * 12, "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    ]
    message = client.messages.create(
        model="tiny",
        max_tokens=2,
        extra_body=GREEDY,
        system=system,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": "pin it"}],
    )
    prompt = message.usage.input_tokens + message.usage.cache_read_input_tokens
    prompt += message.usage.cache_creation_input_tokens or 0
    # The system prompt's full pages, not the user's message after the breakpoint.
    assert 0 < pinned() - before < prompt // PAGE


def test_structured_output_gives_json(client: anthropic.Anthropic) -> None:
    schema = {
        "type": "object",
        "properties": {"done": {"type": "boolean"}, "files": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["done", "files"],
        "additionalProperties": False,
    }
    message = client.messages.create(
        model="tiny",
        max_tokens=40,
        extra_body=GREEDY,
        messages=[{"role": "user", "content": "Report in JSON."}],
        output_config={"format": {"type": "json_schema", "schema": schema}},  # type: ignore[typeddict-item]
    )
    assert message.content[0].type == "text" and message.stop_reason == "end_turn"
    value = json.loads(message.content[0].text)
    assert isinstance(value["done"], bool) and 0 <= value["files"] <= 9


def test_usage_carries_each_calls_energy_and_its_sessions_total(client: anthropic.Anthropic) -> None:
    """rayturn's ``usage.energy`` (kept by the SDK among the usage's extra fields): the call's joules, on the
    disaggregated path the prefill replica's too; the session's total in the last usage of each call."""
    session = {"x-session-id": "anthropic-energy"}
    long_question = [{"role": "user", "content": "Review this diff: " + "- a\n+ b\n" * 12}]  # past the threshold
    message = client.messages.create(
        model="tiny", max_tokens=4, extra_body=GREEDY, messages=long_question, extra_headers=session
    )  # type: ignore[arg-type]
    events = list(
        client.messages.create(
            model="tiny",
            max_tokens=4,
            extra_body=GREEDY,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_headers=session,
        )
    )
    (delta,) = [event for event in events if event.type == "message_delta"]
    (start,) = [event for event in events if event.type == "message_start"]
    assert "energy" not in (start.message.usage.model_extra or {})  # known once the call has ended
    energies = [(message.usage.model_extra or {})["energy"], (delta.usage.model_extra or {})["energy"]]
    for energy in energies:
        assert energy["joules"] > 0 and set(energy["meter"].split("+")) <= {"model", "rapl", "nvml"}
    assert [energy["session_joules"] for energy in energies] == pytest.approx(
        [energies[0]["joules"], energies[0]["joules"] + energies[1]["joules"]]
    )

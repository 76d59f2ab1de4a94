"""OpenAI's Responses API on the whole cluster, with the official ``openai`` SDK.

Greedy answers equal the chat completions answer for the same conversation
(the chat API is checked against the offline engine in test_cluster_serve),
streamed or not, with usage counted the same and the prompt cached on a
repeat; function tools and tool choices come back in valid shapes; a call
that continues a stored response by ``previous_response_id`` reads its
conversation from the cache, while an unknown, unstored, deleted or other
tenant's id is a 400; a Codex-shaped streamed call is served as Codex sends it.
A background response answers as the foreground one once polled, a streamed
one is followed again from any event, and a cancelled one stops on the decode
replica.
vLLM's sampling fields (a seed, ``top_k``, a repetition penalty, a stop string)
give the chat API's answer for the same fields.
Asked for, each answer token's log probability and alternatives equal
``transformers``' on the same weights, and the chat API's, streamed or not.
A call's class (``priority`` in the body, the ``x-rayturn-priority`` header,
bob's key's default) reaches the decode replica, and a bad one is a 400.
The cluster has two ingress replicas and Serve's proxy hands each call to
either, so all of this holds whichever replica stored a response: a
conversation continued turn after turn by id, read, listed and deleted finds
every response on both.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from openai.types.responses import Response  # noqa: E402
from small_cluster import serving, small_cluster  # noqa: E402

from rayturn.cluster.config import load_config  # noqa: E402
from rayturn.engine.presets import preset_dir  # noqa: E402

HTTP_PORT, GRPC_PORT = 28481, 29481
ALICE_KEY, BOB_KEY = "responses-alice-key", "responses-bob-key"
THRESHOLD = 96  # uncached prompt tokens from which a prefill replica computes the prompt
OVERRIDES = small_cluster(
    HTTP_PORT,
    GRPC_PORT,
    THRESHOLD,
    **{
        "server.tenant_keys": {"alice": [ALICE_KEY], "bob": [BOB_KEY]},
        "server.tenant_priorities": {"bob": "batch"},
        # Serve's proxy hands each call to either: every test here reads across replicas (``shared_responses``).
        "server.ingress_replicas": 2,
    },
)
INSTRUCTIONS = "You are a terse coding agent."
MAX_OUTPUT_TOKENS = 8


def function_tool(name: str) -> dict[str, Any]:
    return {
        "type": "function",
        "name": name,
        "description": f"Run {name}.",
        "strict": False,
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
    }


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    with serving(load_config(**OVERRIDES)) as url:
        yield url


@pytest.fixture(scope="module")
def client(cluster: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster}/v1", api_key=ALICE_KEY, max_retries=0, timeout=120)


def chat_completion(client: openai.OpenAI, question: str, **options: Any) -> Any:
    """The greedy chat completion of the conversation a Responses call with ``INSTRUCTIONS`` and ``question`` makes."""
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": question}]
    return client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        **{"max_tokens": MAX_OUTPUT_TOKENS, "temperature": 0, **options},
    )


def respond(client: openai.OpenAI, question: str, **options: Any) -> Any:
    """The greedy response to ``question`` under ``INSTRUCTIONS``, the conversation ``chat_completion`` sends."""
    return client.responses.create(
        model="tiny",
        instructions=INSTRUCTIONS,
        input=question,
        **{"max_output_tokens": MAX_OUTPUT_TOKENS, "temperature": 0, **options},
    )


def chat_answer(client: openai.OpenAI, question: str) -> tuple[str, int, int]:
    response = chat_completion(client, question)
    assert response.usage is not None
    return response.choices[0].message.content or "", response.usage.prompt_tokens, response.usage.completion_tokens


def assert_usage(response: Any, input_tokens: int, output_tokens: int) -> None:
    assert response.usage.input_tokens == input_tokens and response.usage.output_tokens == output_tokens
    assert response.usage.total_tokens == input_tokens + output_tokens
    # Random weights rarely stop early: then the answer ran out of max_output_tokens.
    assert (response.status == "incomplete") == (output_tokens == MAX_OUTPUT_TOKENS)


@pytest.mark.parametrize("words", [1, 30], ids=["local-prefill", "disaggregated"])
def test_answers_equal_chat_completions_streamed_or_not(client: openai.OpenAI, words: int) -> None:
    question = "Explain this line: " + "x = 1; " * words
    expected, prompt_tokens, completion_tokens = chat_answer(client, question)
    assert (prompt_tokens >= THRESHOLD) == (words == 30)
    settings: dict[str, Any] = {"max_output_tokens": MAX_OUTPUT_TOKENS, "temperature": 0}
    response = client.responses.create(model="tiny", instructions=INSTRUCTIONS, input=question, **settings)
    assert response.id.startswith("resp_") and response.output_text == expected
    assert_usage(response, prompt_tokens, completion_tokens)
    assert response.usage is not None and response.usage.input_tokens_details.cached_tokens > 0  # the chat call's

    events = list(
        client.responses.create(model="tiny", instructions=INSTRUCTIONS, input=question, stream=True, **settings)
    )
    types = [event.type for event in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1]
    assert final.type in ("response.completed", "response.incomplete")
    assert text == expected and final.response.output_text == expected
    assert_usage(final.response, prompt_tokens, completion_tokens)


def test_vllm_s_sampling_fields_answer_as_the_chat_api(client: openai.OpenAI) -> None:
    question = "Write a haiku about caches."
    # Seeded sampling with top_k and a repetition penalty: the chat API's answer for the same seed, twice.
    sampled = {"temperature": 1.0, "extra_body": {"seed": 1234, "top_k": 20, "repetition_penalty": 1.2}}
    chat = chat_completion(client, question, **sampled)
    answers = [respond(client, question, **sampled).output_text for _ in range(2)]
    assert answers == [chat.choices[0].message.content] * 2
    # A stop string (the answer's first printable ASCII character after its first) cuts the greedy answer where
    # the chat API's cuts it.
    greedy = chat_completion(client, question, max_tokens=24).choices[0].message.content
    stop = next(char for char in greedy[1:] if char.isascii() and char.isprintable())
    stopped = respond(client, question, max_output_tokens=24, extra_body={"stop": [stop]})
    assert stopped.output_text == greedy[: greedy.index(stop)] and stopped.status == "completed"
    chat_stopped = chat_completion(client, question, max_tokens=24, stop=[stop])
    assert stopped.output_text == chat_stopped.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="tiny", input=question, extra_body={"top_k": -5})
    assert refused.value.body["param"] == "top_k"  # type: ignore[index]


def test_function_tools_and_tool_choices_answer_in_valid_shapes(cluster: str, client: openai.OpenAI) -> None:
    tools = [function_tool("shell"), function_tool("read_file")]
    for tool_choice in ("auto", "required", {"type": "function", "name": "read_file"}, "none"):
        body = {
            "model": "tiny",
            "input": "Open README.md",
            "tools": tools,
            "tool_choice": tool_choice,
            "max_output_tokens": MAX_OUTPUT_TOKENS,
            "temperature": 0,
        }
        raw = requests.post(f"{cluster}/v1/responses", json=body, headers={"Authorization": f"Bearer {ALICE_KEY}"})
        assert raw.status_code == 200, raw.text
        response = Response.model_validate(raw.json())
        assert response.tool_choice is not None and len(response.tools) == 2
        for item in response.output:
            assert item.type in ("message", "function_call")
            if item.type == "function_call":
                assert item.call_id and item.name in ("shell", "read_file")


def test_a_stored_response_is_continued_from_the_cache(cluster: str, client: openai.OpenAI) -> None:
    first = client.responses.create(
        model="tiny", instructions=INSTRUCTIONS, input="Name a sorting algorithm.", max_output_tokens=6, temperature=0
    )
    second = client.responses.create(
        model="tiny",
        instructions=INSTRUCTIONS,
        previous_response_id=first.id,
        input=[{"role": "user", "content": "And a faster one?"}],
        max_output_tokens=6,
        temperature=0,
    )
    assert first.usage is not None and second.usage is not None
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert client.responses.retrieve(first.id).output_text == first.output_text

    # Its input items, newest first, two to a page as the SDK follows them: its own input, then the first call's
    # output and input.
    items = list(client.responses.input_items.list(second.id, limit=2))
    assert [item.type for item in items] == ["message"] * 3 and items[1].id == first.output[0].id
    assert [items[0].content[0].text, items[2].content[0].text] == ["And a faster one?", "Name a sorting algorithm."]
    # The same conversation sent again by reference is the same prompt: the same greedy answer, from the cache.
    again = client.responses.create(
        model="tiny",
        instructions=INSTRUCTIONS,
        input=[{"type": "item_reference", "id": item.id} for item in reversed(items)],  # type: ignore[misc]
        max_output_tokens=6,
        temperature=0,
        store=False,
    )
    assert again.output_text == second.output_text and again.usage is not None
    assert again.usage.input_tokens == second.usage.input_tokens and again.usage.input_tokens_details.cached_tokens
    # Counted before it is sent, the continuation is the prompt the call sent; by reference too, and for bob's key
    # the conversation is not found.
    continuation = {"instructions": INSTRUCTIONS, "input": [{"role": "user", "content": "And a faster one?"}]}
    counted = client.responses.input_tokens.count(model="tiny", previous_response_id=first.id, **continuation)  # type: ignore[arg-type]
    assert (counted.object, counted.input_tokens) == ("response.input_tokens", second.usage.input_tokens)
    references = [{"type": "item_reference", "id": item.id} for item in reversed(items)]
    assert client.responses.input_tokens.count(instructions=INSTRUCTIONS, input=references).input_tokens == (  # type: ignore[arg-type]
        second.usage.input_tokens
    )

    bob = openai.OpenAI(base_url=f"{cluster}/v1", api_key=BOB_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as other_tenant:
        bob.responses.create(model="tiny", previous_response_id=first.id, input="hi", max_output_tokens=2)
    assert other_tenant.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.input_items.list(second.id)
    with pytest.raises(openai.BadRequestError) as not_bobs:
        bob.responses.input_tokens.count(model="tiny", previous_response_id=first.id, input="hi")
    assert not_bobs.value.body["param"] == "previous_response_id"  # type: ignore[index]

    client.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", previous_response_id=first.id, input="hi", max_output_tokens=2)


def test_both_ingress_replicas_read_continue_and_delete_what_either_stored(cluster: str, client: openai.OpenAI) -> None:
    pools = requests.get(f"{cluster}/health", timeout=30).json()["pools"]
    assert pools["ingress"]["replicas"] == 2 and pools["responses"] == {"ok": True, "replicas": 1, "target_replicas": 1}
    # 18 calls, each to either replica: with a store per replica one would miss its predecessor (all 18 reaching
    # one replica has odds of 1 in 2**17).
    turns = [respond(client, "Name a file.", max_output_tokens=2)]
    for turn in range(5):
        turns.append(
            client.responses.create(
                model="tiny", previous_response_id=turns[-1].id, input=f"And {turn}?", max_output_tokens=2
            )
        )
        assert turns[-1].previous_response_id == turns[-2].id and turns[-1].status in ("completed", "incomplete")
    for response in turns:
        assert client.responses.retrieve(response.id).output_text == response.output_text
    assert len(list(client.responses.input_items.list(turns[-1].id))) == 2 * len(turns) - 1
    client.responses.delete(turns[0].id)
    for _ in range(4):  # gone from both
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(turns[0].id)


def test_a_sessions_energy_total_counts_its_calls_on_both_ingress_replicas(client: openai.OpenAI) -> None:
    """``session_joules`` is kept in the deployment both ingress replicas share: after each of 8 calls of one
    session (each to either replica) it is the sum of the session's calls so far (all 8 reaching one replica has
    odds of 1 in 2**7)."""
    session = {"x-session-id": "energy-across-replicas"}
    energies = []
    for turn in range(8):
        if turn % 2:
            events = list(
                client.responses.create(
                    model="tiny", input=f"Step {turn}.", max_output_tokens=3, stream=True, extra_headers=session
                )
            )
            usage = events[-1].response.usage  # type: ignore[union-attr]
        else:
            usage = client.responses.create(
                model="tiny", input=f"Step {turn}.", max_output_tokens=3, extra_headers=session
            ).usage
        assert usage is not None
        energies.append((usage.model_extra or {})["energy"])
    joules = [energy["joules"] for energy in energies]
    assert all(value > 0 for value in joules)
    totals = [sum(joules[: turn + 1]) for turn in range(len(joules))]
    assert [energy["session_joules"] for energy in energies] == pytest.approx(totals)


def test_unknown_and_unstored_ids_and_bad_items_are_400s(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as unknown:
        client.responses.create(model="tiny", previous_response_id="resp_nothing", input="hi", max_output_tokens=2)
    assert unknown.value.body["param"] == "previous_response_id"  # type: ignore[index]
    unstored = client.responses.create(model="tiny", input="hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", previous_response_id=unstored.id, input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as bad_item:
        client.responses.create(model="tiny", input=[{"type": "item_reference", "id": "msg_1"}])  # type: ignore[list-item]
    assert bad_item.value.body["param"] == "input[0].id"  # type: ignore[index]
    assert bad_item.value.body["code"] == "item_not_found"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as image:
        client.responses.create(
            model="tiny",
            input=[{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}],  # type: ignore[list-item]
        )
    assert "not supported" in str(image.value)


def test_a_codex_shaped_stream_is_served(cluster: str) -> None:
    body = {
        "model": "tiny",
        "instructions": INSTRUCTIONS,
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sandbox: on"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list files"}]},
            {"type": "function_call", "name": "shell", "arguments": '{"cmd": "ls"}', "call_id": "call_1"},
            {"type": "function_call_output", "call_id": "call_1", "output": "a.py"},
        ],
        "tools": [*(function_tool(f"tool_{i}") for i in range(8)), function_tool("shell"), {"type": "web_search"}],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "codex-session-1",
        "max_output_tokens": MAX_OUTPUT_TOKENS,
    }
    headers = {
        "Authorization": f"Bearer {ALICE_KEY}",
        "x-codex-turn-metadata": json.dumps({"session_id": "codex-session-1", "turn_id": "t1"}),
    }
    raw = requests.post(f"{cluster}/v1/responses", json=body, headers=headers)
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    # The body's prompt_cache_key named the session, so the replica reported its state.
    assert "x-rayturn-session" in raw.headers
    frames = [frame for frame in raw.text.split("\n\n") if frame]
    names = [frame.split("\n")[0].removeprefix("event: ") for frame in frames]
    events = [json.loads(frame.split("\n")[1].removeprefix("data: ")) for frame in frames]
    assert names == [event["type"] for event in events]
    assert names[0] == "response.created" and names[-1] in ("response.completed", "response.incomplete")
    final = Response.model_validate(events[-1]["response"])
    assert final.store is False and len(final.tools) == 9 and final.usage is not None


def test_required_tool_choice_forces_a_valid_call(client: openai.OpenAI) -> None:
    """``required`` and a named function are enforced by constrained decoding: random weights still call. (The
    tools' arguments are bounded: random weights never close a free string.)"""
    enum_tool = {
        "type": "function",
        "name": "open_file",
        "description": "Open a file.",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "enum": ["README.md", "setup.py"]},
                "line": {"type": "integer", "minimum": 1, "maximum": 99},
            },
            "required": ["path", "line"],
        },
    }
    for tool_choice in ("required", {"type": "function", "name": "open_file"}):
        response = client.responses.create(
            model="tiny",
            input="Open the readme.",
            tools=[enum_tool, {**enum_tool, "name": "close_file"}],  # type: ignore[list-item]
            tool_choice=tool_choice,  # type: ignore[arg-type]
            parallel_tool_calls=False,
            max_output_tokens=80,
            temperature=0,
            store=False,
        )
        calls = [item for item in response.output if item.type == "function_call"]
        if isinstance(tool_choice, dict):
            assert [call.name for call in calls] == ["open_file"]
        assert len(calls) == 1 and response.status == "completed", response.output
        assert calls[0].name in ("open_file", "close_file")
        arguments = json.loads(calls[0].arguments)
        assert arguments["path"] in ("README.md", "setup.py") and 1 <= arguments["line"] <= 99


def test_json_schema_text_format_gives_valid_json(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "size": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["ok", "size"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model="tiny",
        input="Answer in JSON.",
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}},
        max_output_tokens=40,
        temperature=0,
        store=False,
    )
    value = json.loads(response.output_text)
    assert set(value) == {"ok", "size"} and isinstance(value["ok"], bool) and 0 <= value["size"] <= 9


def test_structured_outputs_hold_the_answer_and_exclude_a_text_format(client: openai.OpenAI) -> None:
    """vLLM's Responses API takes ``structured_outputs`` too, streamed or not; never beside a JSON text format."""
    choices = ["approve", "reject", "revise"]
    body = {"structured_outputs": {"choice": choices}}
    response = client.responses.create(model="tiny", input="Review it.", store=False, extra_body=body)
    assert response.output_text in choices and response.status == "completed"
    events = client.responses.create(model="tiny", input="Review it.", store=False, stream=True, extra_body=body)
    streamed = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert streamed in choices
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model="tiny", input="x", text={"format": {"type": "json_object"}}, store=False, extra_body=body
        )
    assert caught.value.param == "structured_outputs.choice" and "'text.format'" in caught.value.message  # type: ignore[attr-defined]


def decode_details(cluster: str) -> dict[str, Any]:
    """The (one) decode replica's own report, in the health details."""
    health = requests.get(f"{cluster}/health", headers={"Authorization": f"Bearer {ALICE_KEY}"}, timeout=30)
    details: dict[str, Any] = health.json()["details"]
    return details


def decode_calls_by_priority(cluster: str) -> dict[str, int]:
    """The calls the (one) decode replica admitted, by class, from its own report."""
    counts = decode_details(cluster)["decode.calls_by_priority"]
    assert isinstance(counts, dict)
    return counts


def test_each_calls_class_reaches_the_decode_replica_and_a_bad_one_is_a_400(
    cluster: str, client: openai.OpenAI
) -> None:
    bob = openai.OpenAI(base_url=f"{cluster}/v1", api_key=BOB_KEY, max_retries=0, timeout=120)
    chat: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    before = decode_calls_by_priority(cluster)
    client.chat.completions.create(**chat, extra_body={"priority": "background"})
    client.chat.completions.create(**chat, extra_headers={"x-rayturn-priority": "continuation"})  # a new turn
    client.responses.create(model="tiny", input="hi", max_output_tokens=2, extra_body={"priority": 1})  # vLLM's
    client.chat.completions.create(**chat)  # by its kind: a new turn
    bob.chat.completions.create(**chat)  # bob's key's default
    bob.responses.create(model="tiny", input="hi", max_output_tokens=2, extra_body={"priority": "interactive"})
    after = decode_calls_by_priority(cluster)
    assert {name: after[name] - before[name] for name in after} == {
        "continuation": 1,
        "interactive": 2,
        "background": 3,
    }

    for bad in ({"extra_body": {"priority": "urgent"}}, {"extra_headers": {"x-rayturn-priority": "urgent"}}):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(**chat, **bad)
        assert caught.value.body["param"] == "priority"  # type: ignore[index]
        assert "continuation, interactive, background, batch" in caught.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="tiny", input="hi", extra_body={"priority": 2.5})
    assert caught.value.body["param"] == "priority"  # type: ignore[index]
    assert decode_calls_by_priority(cluster) == after  # refused at the ingress: no replica saw them


def test_logprobs_equal_transformers_and_the_chat_apis_streamed_or_not(client: openai.OpenAI) -> None:
    question = "Write one line of Python: " + "x = 1; " * 6
    chat = chat_completion(client, question, logprobs=True, top_logprobs=3, extra_body={"return_token_ids": True})
    choice = chat.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    expected = [entry.model_dump() for entry in choice.logprobs.content]
    asked: dict[str, Any] = {
        "model": "tiny",
        "instructions": INSTRUCTIONS,
        "input": question,
        "max_output_tokens": MAX_OUTPUT_TOKENS,
        "temperature": 0,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 3,
    }
    response = client.responses.create(**asked)
    assert response.output_text == choice.message.content and response.top_logprobs == 3
    content = response.output[0].content[0]  # type: ignore[union-attr]
    scored = [entry.model_dump() for entry in content.logprobs]  # type: ignore[union-attr]
    assert [entry["token"] for entry in scored] == [entry["token"] for entry in expected]
    assert len(scored) == response.usage.output_tokens  # type: ignore[union-attr]

    # The reference: transformers' log-softmax over the prompt and the answer the chat API gave the ids of.
    prompt_ids, answer_ids = chat.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]  # type: ignore[index]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(preset_dir("tiny"), torch_dtype=torch.float32)
    with torch.no_grad():
        logits = hf_model.eval()(torch.tensor([prompt_ids + answer_ids])).logits[0, len(prompt_ids) - 1 : -1]
    reference = torch.log_softmax(logits.float(), dim=-1)
    for position, (entry, token_id) in enumerate(zip(scored, answer_ids, strict=True)):
        assert entry["logprob"] == pytest.approx(reference[position, token_id].item(), abs=1e-3)
        best = torch.topk(reference[position], 3)
        assert [top["logprob"] for top in entry["top_logprobs"]] == pytest.approx(best.values.tolist(), abs=1e-3)
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy: the answer's token is the best
        assert bytes(entry["bytes"]) == bytes(expected[position]["bytes"])

    events = list(client.responses.create(**asked, stream=True))
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    streamed = [entry.model_dump() for event in deltas for entry in event.logprobs]
    assert [entry["token"] for entry in streamed] == [entry["token"] for entry in scored]
    assert [entry["logprob"] for entry in streamed] == pytest.approx([entry["logprob"] for entry in scored], abs=1e-3)
    final = events[-1].response.output[0].content[0]  # type: ignore[union-attr]
    assert [entry.token for entry in final.logprobs] == [entry["token"] for entry in scored]  # type: ignore[union-attr]

    plain = client.responses.create(**{**asked, "include": []})
    assert plain.output[0].content[0].logprobs == []  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError) as too_many:
        client.responses.create(**{**asked, "top_logprobs": 21})
    assert too_many.value.body["param"] == "top_logprobs"  # type: ignore[index]


def finished(client: openai.OpenAI, response_id: str, timeout_s: float = 120.0) -> Response:
    """A background response polled until it is no longer queued or in progress."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = client.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress"):
            return response
        assert time.monotonic() < deadline, response
        time.sleep(0.1)


def test_background_responses_are_polled_streamed_again_and_cancelled(cluster: str, client: openai.OpenAI) -> None:
    settings: dict[str, Any] = {
        "model": "tiny",
        "instructions": INSTRUCTIONS,
        "input": "List the steps of a merge sort.",
        "max_output_tokens": 24,
        "temperature": 0,
    }
    foreground = client.responses.create(**settings)
    queued = client.responses.create(**settings, background=True)
    assert queued.status in ("queued", "in_progress") and queued.background and not queued.output
    done = finished(client, queued.id)
    assert (done.status, done.output_text) == (foreground.status, foreground.output_text)
    assert done.usage is not None and foreground.usage is not None
    assert done.usage.output_tokens == foreground.usage.output_tokens

    # A streamed one whose connection drops after a few events is followed from the last event seen.
    seen = []
    with client.responses.create(**settings, background=True, stream=True) as stream:
        for event in stream:
            seen.append(event)
            if len(seen) == 6:
                break
    assert seen[0].type == "response.created"
    response_id = seen[0].response.id
    after = seen[-1].sequence_number
    events = seen + list(client.responses.retrieve(response_id, stream=True, starting_after=after))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == foreground.output_text and events[-1].type == f"response.{foreground.status}"
    # Once ended, the whole stream is there to read again.
    again = list(client.responses.retrieve(response_id, stream=True))
    assert [event.model_dump() for event in again] == [event.model_dump() for event in events]

    # A long one (a guide holds off the end of text for 2,500 tokens, several seconds) is cancelled: it is stored
    # cancelled and the decode replica stops computing it.
    long_guide = {"structured_outputs": {"regex": "[a-z ]{2500,}"}}
    long = client.responses.create(**{**settings, "max_output_tokens": 3000}, background=True, extra_body=long_guide)
    deadline = time.monotonic() + 30
    while decode_details(cluster)["decode.running_seqs"] == 0:  # its report is up to 0.5 s old
        assert time.monotonic() < deadline, "the long response never ran"
        time.sleep(0.1)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(long.id).status == "cancelled"
    deadline = time.monotonic() + 3
    while sum(decode_details(cluster)[f"decode.{seqs}_seqs"] for seqs in ("running", "waiting")) > 0:
        assert time.monotonic() < deadline, "the cancelled response still runs on the decode replica"
        time.sleep(0.2)
    with pytest.raises(openai.BadRequestError) as not_running:
        client.responses.cancel(done.id)
    assert not_running.value.body["param"] == "response_id"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as unstored:
        client.responses.create(**settings, background=True, store=False)
    assert unstored.value.body["param"] == "background"  # type: ignore[index]

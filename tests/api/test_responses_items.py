"""A response's input items (``GET /v1/responses/{id}/input_items``) and input items that name a stored item
(``item_reference``), through the ingress's real Responses path with a scripted decode pool: each stored
response lists the items it was made from (the conversation it continues, then its input), with ids and in
the ``openai`` SDK's shapes, paged as OpenAI pages; a reference stands for the item it names, so the prompt is
the one the item sent whole makes; the store's item index follows its entries; bad queries and unknown ids are
400s naming the parameter, and nothing crosses tenants."""

from __future__ import annotations

import asyncio
from typing import Any

import jsonschema
import pytest
from openai.types.responses import ResponseItem
from openai.types.responses.response_item_list import ResponseItemList
from pydantic import TypeAdapter
from test_background_responses import BOB, WORDS, ScriptedDecode, body_of, request, serving, settle

from rayturn.api.errors import APIError
from rayturn.api.openapi import openapi_document
from rayturn.api.response_store import ResponseStore, StoredResponse
from rayturn.api.responses_items import items_page, listed_items, page_query, resolve_references
from rayturn.api.responses_request import parse_responses_request
from rayturn.api.serving_responses import ServingResponses

ITEMS: TypeAdapter[Any] = TypeAdapter(ResponseItem)
DOCUMENT = openapi_document("tiny", vocab_size=263, max_model_len=4096)
CALL = {"type": "function_call", "call_id": "call_1", "name": "ls", "arguments": '{"path": "."}'}
OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": "a.py"}
REASONING = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "List it."}]}


def ids(items: list[dict[str, Any]]) -> list[str]:
    return [item["id"] for item in items]


def test_an_input_is_listed_as_items_with_ids_in_the_sdk_s_shapes() -> None:
    [text] = listed_items("Hi.")
    assert text["id"].startswith("msg_") and text["status"] == "completed"
    assert (text["role"], text["content"]) == ("user", [{"type": "input_text", "text": "Hi."}])
    given = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "assistant", "content": "Sure.", "id": "msg_given", "status": "incomplete"},
        REASONING,
        CALL,
        OUTPUT,
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And?"}]},
    ]
    listed = listed_items(given)
    assert [item["type"] for item in listed] == ["message", "message", "reasoning", "function_call"] + [
        "function_call_output",
        "message",
    ]
    assert [item["id"][: item["id"].index("_") + 1] for item in listed] == ["msg_", "msg_", "rs_", "fc_", "fco_"] + [
        "msg_"
    ]
    assert listed[1]["id"] == "msg_given" and listed[1]["status"] == "incomplete"  # kept as sent
    assert listed[1]["content"] == [{"type": "output_text", "text": "Sure.", "annotations": []}]
    assert listed[0]["content"] == [{"type": "input_text", "text": "Be brief."}] and listed[0]["role"] == "developer"
    assert {key: listed[3][key] for key in CALL} == CALL and listed[4]["output"] == "a.py"
    assert len(set(ids(listed))) == len(listed)
    for item in listed:
        assert ITEMS.validate_python(item).id == item["id"]
    assert given[0] == {"role": "developer", "content": "Be brief."}  # the request's own items are not changed


def test_a_reference_is_replaced_by_the_item_it_names_and_an_unknown_one_is_refused() -> None:
    stored = {**CALL, "id": "fc_1", "status": "completed"}
    body = {"input": [{"role": "user", "content": "Go."}, {"type": "item_reference", "id": "fc_1"}, OUTPUT]}
    resolved = resolve_references(body, {"fc_1": stored}.get)
    assert resolved == {"input": [{"role": "user", "content": "Go."}, stored, OUTPUT]}
    assert body["input"][1] == {"type": "item_reference", "id": "fc_1"}  # the request's body is not changed
    plain = {"input": [{"role": "user", "content": "Go."}]}
    assert resolve_references(plain, {}.get) is plain and resolve_references("x", {}.get) == "x"
    with pytest.raises(APIError) as unknown:
        resolve_references(body, {}.get)
    assert (unknown.value.status_code, unknown.value.param, unknown.value.code) == (
        400,
        "input[1].id",
        "item_not_found",
    )
    assert "'fc_1'" in unknown.value.message
    for reference, said in (({"type": "item_reference"}, "Missing"), ({"type": "item_reference", "id": 3}, "string")):
        with pytest.raises(APIError) as refused:
            resolve_references({"input": [reference]}, {}.get)
        assert refused.value.param == "input[0].id" and said in refused.value.message


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"id": 7}, "input[0].id"), ({"status": "done"}, "input[0].status"), ({"id": {"a": 1}}, "input[0].id")],
)
def test_an_item_s_id_and_status_are_checked_as_the_schema_says(extra: dict[str, Any], param: str) -> None:
    body = {"model": "tiny", "input": [{"role": "user", "content": "Hi.", **extra}]}
    with pytest.raises(APIError) as refused:
        parse_responses_request(body, "tiny")
    assert refused.value.param == param
    schema = DOCUMENT["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(body, schema)


def test_pages_follow_openai_s_limit_order_and_after() -> None:
    items = [{"id": f"i{n}"} for n in range(5)]
    assert page_query({}) == (20, True, None)
    assert page_query({"limit": "2", "order": "asc", "after": "i1"}) == (2, False, ("after", "i1"))
    first = items_page(items, limit=2, descending=True, after=None)
    assert (ids(first["data"]), first["first_id"], first["last_id"], first["has_more"]) == (
        ["i4", "i3"],
        "i4",
        "i3",
        True,
    )
    rest = items_page(items, limit=2, descending=True, after=("after", "i1"))
    assert (ids(rest["data"]), rest["has_more"]) == (["i0"], False)
    ascending = items_page(items, limit=20, descending=False, after=("after", "i2"))
    assert (ids(ascending["data"]), ascending["has_more"]) == (["i3", "i4"], False)
    empty = items_page(items, limit=3, descending=False, after=("after", "i4"))
    assert empty == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}
    with pytest.raises(APIError) as unknown:
        items_page(items, limit=2, descending=True, after=("after", "i9"))
    assert unknown.value.param == "after" and "'i9'" in unknown.value.message
    for query, param in (
        ({"limit": "0"}, "limit"),
        ({"limit": "101"}, "limit"),
        ({"limit": "-1"}, "limit"),
        ({"limit": "1e2"}, "limit"),
        ({"limit": "9" * 40}, "limit"),
        ({"limit": "²"}, "limit"),
        ({"order": "up"}, "order"),
    ):
        with pytest.raises(APIError) as refused:
            page_query(query)
        assert (refused.value.status_code, refused.value.param) == (400, param), query


def entry(response_id: str, items: list[dict[str, Any]], output: list[dict[str, Any]], tenant: str = "t") -> Any:
    return StoredResponse(response_id, tenant, {"id": response_id, "output": output}, (), 10, (), tuple(items))


def test_the_store_finds_items_while_an_entry_holds_them() -> None:
    first_in, first_out = {"id": "msg_a", "n": 1}, {"id": "fc_a", "n": 2}
    second_in = {"id": "msg_b", "n": 3}
    store = ResponseStore(max_entries=2)
    store.put(entry("r1", [first_in], [first_out]))
    store.put(entry("r2", [first_in, first_out, second_in], [{"id": "msg_c", "n": 4}]))
    assert store.find_item("t", "fc_a") == first_out and store.find_item("t", "msg_c") == {"id": "msg_c", "n": 4}
    assert store.find_item("other", "fc_a") is None and store.find_item("t", "nope") is None
    assert store.delete("t", "r1")
    assert store.find_item("t", "msg_a") == first_in  # r2 still holds the conversation it continued
    store.put(entry("r3", [], [{"id": "x", "n": 5}]))
    store.put(entry("r4", [], [{"id": "y", "n": 6}]))  # two entries at most: r2 goes
    assert store.find_item("t", "msg_a") is None and store.find_item("t", "msg_c") is None
    assert store.delete("t", "r3") and store.delete("t", "r4")
    assert store._items == {}  # nothing left behind


def answered(api: ServingResponses, decode: ScriptedDecode, body: dict[str, Any], key: str = "alice-key") -> Any:
    """The response to a (not background) ``body``, its steps released once its call reached the decode pool."""

    async def go() -> Any:
        task = asyncio.create_task(api.create(request("POST", body, key=key), "r"))
        await settle()
        if decode.streams and not decode.streams[-1].sent:
            decode.streams[-1].release()
        return await task

    return asyncio.run(go())


def listed(api: ServingResponses, response_id: str, query: str = "", key: str = "alice-key") -> Any:
    return asyncio.run(api.input_items(request("GET", query=query, key=key), response_id, "r"))


def test_a_stored_response_lists_its_conversation_and_a_reference_makes_the_same_prompt() -> None:
    api, decode = serving()
    first = body_of(answered(api, decode, {"model": "tiny", "input": [{"role": "user", "content": "List files."}]}))
    page = body_of(listed(api, first["id"]))
    ResponseItemList.model_validate(page)
    [question] = page["data"]
    assert question["content"] == [{"type": "input_text", "text": "List files."}] and not page["has_more"]

    tool_turn = [REASONING, CALL, OUTPUT]
    second = body_of(answered(api, decode, {"model": "tiny", "input": tool_turn, "previous_response_id": first["id"]}))
    chain = body_of(listed(api, second["id"], "order=asc"))["data"]
    # The first response's input and output, then the second's input.
    assert ids(chain[:2]) == [question["id"], first["output"][0]["id"]] and len(chain) == 5
    assert [item["type"] for item in chain[2:]] == ["reasoning", "function_call", "function_call_output"]
    assert chain[1]["content"][0]["text"] == "".join(WORDS)
    newest = body_of(listed(api, second["id"], "limit=2"))
    assert ids(newest["data"]) == ids(chain[::-1][:2]) and newest["has_more"]
    after = body_of(listed(api, second["id"], f"limit=2&after={newest['last_id']}"))
    assert ids(after["data"]) == ids(chain[::-1][2:4])

    # The whole conversation sent again by reference, item for item, makes the prompt the items themselves make.
    references = [{"type": "item_reference", "id": item["id"]} for item in chain]
    answered(api, decode, {"model": "tiny", "input": references, "store": False})
    answered(api, decode, {"model": "tiny", "input": chain, "store": False})
    by_reference, whole = decode.streams[-2].call, decode.streams[-1].call
    assert by_reference.prompt_token_ids == whole.prompt_token_ids
    assert by_reference.prompt_token_ids != decode.streams[0].call.prompt_token_ids

    # Another tenant sees neither the responses nor their items.
    assert listed(api, second["id"], key=BOB).status_code == 404
    refused = answered(api, decode, {"model": "tiny", "input": references[:1]}, key=BOB)
    assert refused.status_code == 400 and body_of(refused)["error"]["param"] == "input[0].id"
    # A response not stored has no items to list.
    unstored = body_of(answered(api, decode, {"model": "tiny", "input": "Hi.", "store": False}))
    assert listed(api, unstored["id"]).status_code == 404


def test_a_running_background_response_lists_its_input() -> None:
    async def scenario() -> None:
        api, decode = serving()
        body = {"model": "tiny", "input": "Say hello.", "background": True}
        created = body_of(await api.create(request("POST", body), "r1"))
        await settle()
        assert api.runs.get("alice", created["id"]) is not None
        running = body_of(await api.input_items(request("GET"), created["id"], "r2"))
        assert [item["content"] for item in running["data"]] == [[{"type": "input_text", "text": "Say hello."}]]
        decode.streams[-1].release()
        await settle()
        assert api.runs.get("alice", created["id"]) is None
        done = body_of(await api.input_items(request("GET"), created["id"], "r3"))
        assert done == running

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("query", "param"), [("limit=0", "limit"), ("limit=abc", "limit"), ("order=newest", "order"), ("after=x", "after")]
)
def test_a_bad_list_query_is_a_400_naming_it(query: str, param: str) -> None:
    api, decode = serving()
    created = body_of(answered(api, decode, {"model": "tiny", "input": "Hi."}))
    refused = listed(api, created["id"], query)
    assert refused.status_code == 400 and body_of(refused)["error"]["param"] == param


def test_the_published_document_has_the_route_and_the_reference_item() -> None:
    route = DOCUMENT["paths"]["/v1/responses/{response_id}/input_items"]["get"]
    assert {parameter["name"] for parameter in route["parameters"]} == {"response_id", "limit", "order", "after"}
    schema = DOCUMENT["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    jsonschema.validate({"model": "tiny", "input": [{"type": "item_reference", "id": "fc_1"}, OUTPUT]}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"model": "tiny", "input": [{"type": "item_reference"}]}, schema)


def test_the_list_asks_for_a_key_where_keys_are_set() -> None:
    api, decode = serving()
    created = body_of(answered(api, decode, {"model": "tiny", "input": "Hi."}))
    no_key = request("GET")
    no_key.scope["headers"] = []
    for refused in (
        asyncio.run(api.input_items(no_key, created["id"], "r")),
        listed(api, created["id"], key="wrong-key"),
    ):
        assert refused.status_code == 401 and body_of(refused)["error"]["code"] == "invalid_api_key"
    assert listed(api, created["id"]).status_code == 200

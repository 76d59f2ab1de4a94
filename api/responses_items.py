"""The items a response was made from, as ``GET /v1/responses/{id}/input_items`` lists them, and input items
that stand for a stored item (``{"type": "item_reference", "id": ...}``).

A stored response keeps its conversation's items: those of the responses it continues (each one's input,
then its output), then its own input. Every item has an id: the one it was sent with, else one given here
(``msg_``, ``fc_``, ``fco_``, ``rs_``), and a status (``completed`` unless sent with one). A text input is one
user message, and a message's text content becomes a list of parts (``input_text``, ``output_text`` for the
assistant's), as OpenAI lists them.

An item reference in a request's ``input`` is replaced by the item of that id among the tenant's stored
responses (their inputs and outputs) before the request is read; one that names no stored item is a 400
naming it. The list is paged as OpenAI pages it: ``limit`` (1 to 100, 20 if not given), ``order`` (``desc``,
the default, or ``asc``) and ``after``, the id of the item after which the page starts, in that order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from .errors import invalid_request
from .json_fields import Fields
from .pages import Cursor, cursor_page, query_cursor, query_limit
from .protocol import JSON
from .responses_bodies import function_call_item_id, function_call_output_item_id, message_item_id, reasoning_item_id

ITEM_REFERENCE = "item_reference"
DEFAULT_LIMIT = 20
MAX_LIMIT = 100
_NEW_ID: dict[str, Callable[[], str]] = {
    "function_call": function_call_item_id,
    "function_call_output": function_call_output_item_id,
    "reasoning": reasoning_item_id,
}


def referenced_ids(body: object) -> list[str]:
    """The ids the item references in ``body``'s ``input`` name (those that are strings: ``resolve_references``
    names what is wrong with the others)."""
    if not isinstance(body, dict) or not isinstance(body.get("input"), list):
        return []
    return [
        item["id"]
        for item in body["input"]
        if isinstance(item, dict) and item.get("type") == ITEM_REFERENCE and isinstance(item.get("id"), str)
    ]


def resolve_references(body: object, find: Callable[[str], JSON | None]) -> object:
    """``body`` with each item reference in its ``input`` replaced by the stored item ``find`` returns for its id."""
    if not isinstance(body, dict) or not isinstance(body.get("input"), list):
        return body  # nothing to resolve; the request's reader says what is wrong, if anything
    items = body["input"]
    if not any(isinstance(item, dict) and item.get("type") == ITEM_REFERENCE for item in items):
        return body
    resolved = []
    for i, item in enumerate(items):
        if isinstance(item, dict) and item.get("type") == ITEM_REFERENCE:
            fields = Fields(item, f"input[{i}]")
            item_id = fields.required_string("id")
            found = find(item_id)
            if found is None:
                param = fields.path("id")
                message = (
                    f"Invalid '{param}': no stored item has id {item_id!r}. Items are those of responses made "
                    "with 'store' true, kept as long as their response; send the item itself instead."
                )
                raise invalid_request(message, param=param, code="item_not_found")
            item = found
        resolved.append(item)
    return {**body, "input": resolved}


def listed_items(value: str | Sequence[JSON]) -> list[JSON]:
    """A request's ``input``, already read (so well formed, references resolved), as its response lists it."""
    if isinstance(value, str):
        return [_message_item({"role": "user", "content": value})]
    return [_message_item(item) if (item.get("type") or "message") == "message" else _item(item) for item in value]


def _item(item: JSON, **fields: object) -> JSON:
    """``item`` (with ``fields`` over its own) with its id, else a new one for its type, and its status."""
    listed = {**item, **fields}
    new_id = _NEW_ID.get(listed["type"], message_item_id)
    return {**listed, "id": item.get("id") or new_id(), "status": item.get("status") or "completed"}


def _message_item(item: JSON) -> JSON:
    content = item["content"]
    if isinstance(content, str):
        if item["role"] == "assistant":
            content = [{"type": "output_text", "text": content, "annotations": []}]
        else:
            content = [{"type": "input_text", "text": content}]
    return _item(item, type="message", content=content)


def page_query(params: Mapping[str, str]) -> tuple[int, bool, Cursor | None]:
    """``limit``, whether ``order`` is descending, and the ``after`` cursor from a list request's query."""
    limit = query_limit(params, maximum=MAX_LIMIT, default=DEFAULT_LIMIT)
    order = params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid_request(f"Invalid 'order': expected 'asc' or 'desc', got {order!r}.", param="order")
    return limit, order == "desc", query_cursor(params, "after")


def items_page(items: Sequence[JSON], *, limit: int, descending: bool, after: Cursor | None) -> JSON:
    """One page of ``items`` (in conversation order), as OpenAI's list object."""
    ordered = list(reversed(items)) if descending else items
    return cursor_page(ordered, limit=limit, after=after, what="input item of this response")

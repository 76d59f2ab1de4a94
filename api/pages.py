"""Pages of a list as OpenAI's and Anthropic's list endpoints answer them, for one list body both SDKs follow.

A page is ``{"object": "list", "data", "first_id", "last_id", "has_more"}`` (OpenAI's list object; Anthropic's
carries the same cursor fields). A page starts after the item whose id an ``after`` cursor names (OpenAI's
``after``, Anthropic's ``after_id``), or ends before the one a ``before`` cursor names (Anthropic's
``before_id``), and holds at most ``limit`` items. A cursor that names no listed item, a ``limit`` out of its
range and both cursors at once are 400s naming the query parameter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .errors import invalid_request
from .protocol import JSON

# A cursor: the query parameter that sent it and the item id it names.
Cursor = tuple[str, str]


def query_limit(params: Mapping[str, str], *, maximum: int, default: int) -> int:
    """A list request's ``limit`` query parameter: an integer from 1 to ``maximum``, ``default`` if not given."""
    limit = params.get("limit")
    if limit is None:
        return default
    if not (limit.isascii() and limit.isdigit() and len(limit) < 8 and 1 <= int(limit) <= maximum):
        message = f"Invalid 'limit': expected an integer from 1 to {maximum}, got {limit!r}."
        raise invalid_request(message, param="limit")
    return int(limit)


def query_cursor(params: Mapping[str, str], name: str) -> Cursor | None:
    """The cursor the query parameter ``name`` sends, if any."""
    value = params.get(name)
    return None if value is None else (name, value)


def cursor_page(
    items: Sequence[JSON], *, limit: int, what: str, after: Cursor | None = None, before: Cursor | None = None
) -> JSON:
    """One page of ``items`` (in the listed order); ``what`` names the items in a cursor's error."""
    if after is not None and before is not None:
        message = f"Invalid '{before[0]}': send '{after[0]}' or '{before[0]}', not both."
        raise invalid_request(message, param=before[0])
    ids = [item["id"] for item in items]
    for cursor in (after, before):
        if cursor is not None and cursor[1] not in ids:
            param, item_id = cursor
            raise invalid_request(f"Invalid '{param}': no {what} has id {item_id!r}.", param=param)
    if before is not None:
        end = ids.index(before[1])
        start = max(0, end - limit)
        has_more = start > 0
    else:
        start = 0 if after is None else ids.index(after[1]) + 1
        end = start + limit
        has_more = end < len(items)
    page = list(items[start:end])
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": has_more,
    }

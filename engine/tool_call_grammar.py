"""What the forced-call grammars of every tool-call format are built from (llguidance's Lark dialect).

A forced call's grammar is::

    start: <prefix> call (<separator> call)* <suffix>     (just one call without parallel)
    call: call_0 | call_1 | ...                           (one alternative per tool)

where each ``call_i`` spells that tool's name as fixed text and its arguments
as an inline JSON schema (``%json {...}``). The JSON is compact -- no free
whitespace, ``", "`` and ``": "`` between items, as the engine's own JSON
guides (``rayturn.engine.guided``) -- because a model free to add whitespace
can add it forever. A schema's own ``x-guidance`` options win.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from .tool_call_parser import TokenId, ToolSpec, function_tools

JSON_OPTIONS: Mapping[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def forced_tools(tools: Sequence[ToolSpec]) -> list[tuple[str, Mapping[str, Any]]]:
    """(name, parameters schema) of each function tool a forced call may choose."""
    functions = function_tools(tools)
    if not functions:
        raise ValueError("forcing a tool call needs at least one function tool")
    return list(functions.items())


def literal(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def tag(text: str, token_id: TokenId | None) -> str:
    """A format's tag: its token when the tokenizer holds it as one (``<[id]>``), else its text."""
    token = token_id(text) if token_id is not None else None
    return literal(text) if token is None else f"<[{token}]>"


def json_schema(schema: Mapping[str, Any]) -> str:
    """An inline JSON schema, compact unless the schema's own ``x-guidance`` says otherwise."""
    own_options = schema.get("x-guidance")
    options = {**JSON_OPTIONS, **(own_options if isinstance(own_options, Mapping) else {})}
    return "%json " + json.dumps({**schema, "x-guidance": options}, ensure_ascii=False)


def json_call(name: str, arguments_key: str, parameters: Mapping[str, Any]) -> str:
    """A call spelt as the JSON object ``{"name": <name>, <arguments_key>: <arguments>}``."""
    head = "{" + f'"name": {json.dumps(name, ensure_ascii=False)}, {json.dumps(arguments_key)}: '
    return f"{literal(head)} {json_schema(parameters)} {literal('}')}"


def assemble(
    call_bodies: Sequence[str],
    *,
    parallel: bool,
    separator: str = "",
    prefix: str = "",
    suffix: str = "",
    extra_rules: Sequence[str] = (),
) -> str:
    """The whole grammar: one call, or with ``parallel`` calls joined by ``separator`` (Lark items)."""
    calls = "call" if not parallel else f"call ({separator} call)*" if separator else "call+"
    lines = [
        " ".join(item for item in ("start:", prefix, calls, suffix) if item),
        "call: " + " | ".join(f"call_{index}" for index in range(len(call_bodies))),
        *(f"call_{index}: {body}" for index, body in enumerate(call_bodies)),
        *extra_rules,
    ]
    return "\n".join(lines) + "\n"

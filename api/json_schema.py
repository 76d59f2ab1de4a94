"""JSON Schema pieces the OpenAPI document's request schemas are built from (``rayturn.api.openapi``).

Objects are closed (``additionalProperties: false``): a schema lists the
fields a client should send, and every integer is an int64 at most, as
``json_fields`` reads every one.
"""

from __future__ import annotations

from typing import Any

from rayturn.engine.priority import PRIORITY_NAMES

from .json_fields import INT64_MAX, INT64_MIN
from .session import MAX_SESSION_ID_CHARS

JSON = dict[str, Any]

SHARED_RULES = (
    "max_tokens plus the prompt's tokens must fit the model's context (max_model_len)",
    "function tool names are unique within 'tools'",
)


def object_of(properties: JSON, required: tuple[str, ...] = (), **extra: Any) -> JSON:
    schema: JSON = {"type": "object", "properties": properties, "additionalProperties": False, **extra}
    if required:
        schema["required"] = list(required)
    return schema


def string(**extra: Any) -> JSON:
    return {"type": "string", **extra}


def integer(minimum: int = INT64_MIN, maximum: int = INT64_MAX) -> JSON:
    """An integer field: an int64 at most, as ``json_fields.Fields.integer`` reads every one."""
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


def number(minimum: float, maximum: float, *, exclusive_minimum: bool = False) -> JSON:
    bound = {"exclusiveMinimum": minimum} if exclusive_minimum else {"minimum": minimum}
    return {"type": "number", **bound, "maximum": maximum}


def array_of(items: JSON, min_items: int = 0, max_items: int | None = None) -> JSON:
    schema: JSON = {"type": "array", "items": items, "minItems": min_items}
    if max_items is not None:
        schema["maxItems"] = max_items
    return schema


def enum_of(*values: str) -> JSON:
    return {"type": "string", "enum": list(values)}


BOOLEAN: JSON = {"type": "boolean"}
ANY_OBJECT: JSON = {"type": "object", "description": "A JSON Schema object, as the tool or format declares it."}
TOOL_NAME_64 = string(pattern="^[a-zA-Z0-9_-]{1,64}$")
NON_EMPTY = string(minLength=1)
# Fields that name the call's session when no header does (``session.MAX_SESSION_ID_CHARS``).
SESSION_ID = string(maxLength=MAX_SESSION_ID_CHARS)
# The call's class on every HTTP API (``priority.body_priority``): a name, or vLLM's integer.
PRIORITY: JSON = {
    "anyOf": [enum_of(*PRIORITY_NAMES), integer()],
    "description": "The call's class; an integer as vLLM's: < 0 continuation, 0 unset, > 0 background.",
}
SPECULATIVE: JSON = {
    "type": "boolean",
    "description": "Speculative decoding for this call (the same answer, faster when drafts match); "
    "absent: the server's default.",
}

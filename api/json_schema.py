"""JSON Schema pieces the OpenAPI document's request schemas are built from (``rayturn.api.openapi``).

Objects are closed (``additionalProperties: false``): a schema lists the
fields a client should send, and every integer is an int64 at most, as
``json_fields`` reads every one.
"""

from __future__ import annotations

from typing import Any

from rayturn.engine.priority import PRIORITY_NAMES

from .chat_request import RESERVED_KWARGS
from .json_fields import INT64_MAX, INT64_MIN
from .session import MAX_SESSION_ID_CHARS
from .structured_outputs import CONSTRAINTS, MAX_CHOICES
from .tenants import MAX_CACHE_SALT_CHARS

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


def nullable(*types: str) -> JSON:
    """A field of any of ``types`` or null, its content not checked: one sent back as an answer gave it, unread."""
    return {"type": [*types, "null"]}


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


def token_id_key(vocab_size: int) -> JSON:
    """An object key naming a token id of a ``vocab_size``-token vocabulary: the decimal forms of 0 to
    ``vocab_size - 1``, without leading zeros (``logit_bias``'s keys)."""
    return string(pattern=f"^{decimal_at_most(vocab_size - 1)}$")


def decimal_at_most(most: int) -> str:
    """A regular expression (unanchored) that matches the decimal forms of 0 to ``most`` and nothing else."""
    if most < 0:
        raise ValueError(f"most must be >= 0, got {most}")
    digits = str(most)
    width = len(digits)
    if width == 1:
        return _digit_range(0, most)
    shorter = ["[0-9]"] + ([f"[1-9][0-9]{{1,{width - 2}}}"] if width > 2 else [])
    # As wide as ``most``: its first i digits, then a smaller digit, then anything.
    as_wide = []
    for i, digit in enumerate(digits):
        lowest, below = (1 if i == 0 else 0), int(digit) - 1
        if below >= lowest:
            rest = width - i - 1
            tail = "" if rest == 0 else "[0-9]" if rest == 1 else f"[0-9]{{{rest}}}"
            as_wide.append(digits[:i] + _digit_range(lowest, below) + tail)
    return "(?:" + "|".join([*shorter, *as_wide, digits]) + ")"


def _digit_range(lowest: int, highest: int) -> str:
    return str(lowest) if lowest == highest else f"[{lowest}-{highest}]"


def enum_of(*values: str) -> JSON:
    return {"type": "string", "enum": list(values)}


BOOLEAN: JSON = {"type": "boolean"}
ARRAY: JSON = {"type": "array"}
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
# vLLM's ``cache_salt`` on every HTTP API (``tenants.body_cache_salt``).
CACHE_SALT: JSON = {
    **string(minLength=1, maxLength=MAX_CACHE_SALT_CHARS, pattern=r"^[^@/\\\x00]*$"),
    "description": "The call's cached prefix is shared only with calls of the same tenant naming the same salt.",
}
SPECULATIVE: JSON = {
    "type": "boolean",
    "description": "Speculative decoding for this call (the same answer, faster when drafts match); "
    "absent: the server's default.",
}


# vLLM's structured outputs: exactly one constraint (chat and completions also read its earlier ``guided_*``).
STRUCTURED_OUTPUTS: JSON = object_of(
    {
        "json": ANY_OBJECT,
        "regex": string(minLength=1, description="The whole answer matches it (Rust regex syntax)."),
        "choice": array_of(string(), 1, MAX_CHOICES),
        "grammar": string(pattern=r"\S", description="A Lark or GBNF grammar the answer keeps to."),
        "json_object": {"const": True},
        "disable_any_whitespace": BOOLEAN,
        "disable_additional_properties": BOOLEAN,
    },
    oneOf=[{"required": [constraint]} for constraint in CONSTRAINTS],
)
STRUCTURED_OUTPUT_RULE = "'structured_outputs.regex' and 'structured_outputs.grammar' compile"
# ``protocol.vllm_sampling``'s bound on ``min_tokens``.
MIN_TOKENS_RULE = (
    "'min_tokens' is at most the answer's bound ('max_tokens', 'max_completion_tokens', 'max_output_tokens')"
)


# Where vLLM's token filters are taken (``chat_request.unfiltered_guide``).
def token_filter_rule(format_param: str = "response_format") -> str:
    return f"'allowed_token_ids' and 'bad_words' go with no structured output, '{format_param}' or forced tool call"


TOKEN_FILTER_RULE = token_filter_rule()
# vLLM's ``chat_template_kwargs``: variables for the chat template, none the server sets itself.
TEMPLATE_KWARGS: JSON = {
    "type": "object",
    "propertyNames": {"not": {"enum": sorted(RESERVED_KWARGS)}},
    "description": "More variables for the chat template (e.g. enable_thinking).",
}

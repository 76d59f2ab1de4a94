"""Request schemas of the agents' HTTP APIs: Anthropic Messages (Claude Code) and OpenAI Responses (Codex).

Written from ``anthropic_request`` and ``responses_request`` with the same
bounds; part of the document ``rayturn.api.openapi`` serves.
"""

from __future__ import annotations

from rayturn.engine.sampling_params import MAX_LOGPROBS

from .anthropic_request import CACHE_TTLS_S
from .anthropic_request import MAX_STOP_SEQUENCES as MAX_ANTHROPIC_STOP_SEQUENCES
from .bodies import MAX_MODELS_LIMIT
from .chat_request import MAX_TOOLS, REASONING_EFFORTS
from .json_schema import (
    ANY_OBJECT,
    ARRAY,
    BOOLEAN,
    CACHE_SALT,
    JSON,
    MIN_TOKENS_RULE,
    NON_EMPTY,
    PRIORITY,
    SESSION_ID,
    SHARED_RULES,
    SPECULATIVE,
    STRUCTURED_OUTPUT_RULE,
    STRUCTURED_OUTPUTS,
    TEMPLATE_KWARGS,
    TOOL_NAME_64,
    array_of,
    enum_of,
    integer,
    nullable,
    number,
    object_of,
    string,
    token_filter_rule,
)
from .openapi_sampling import sampling_properties
from .protocol import MAX_TEMPERATURE, PROMPT_CACHE_RETENTION_S
from .responses_bodies import INCLUDABLE
from .responses_items import MAX_LIMIT
from .responses_request import IGNORED_TOOL_TYPES, INPUT_TOKEN_FIELDS, TRUNCATION_MODES, VERBOSITIES

# -- the Anthropic Messages API -------------------------------------------------------------------

_CACHE_CONTROL = object_of({"type": {"const": "ephemeral"}, "ttl": enum_of(*CACHE_TTLS_S)}, ("type",))
# ``citations`` and ``caller``: what an answer's blocks carry besides their text or call, sent back as they came.
_TEXT_BLOCK = object_of(
    {"type": {"const": "text"}, "text": string(), "cache_control": _CACHE_CONTROL, "citations": nullable("array")},
    ("type", "text"),
)
_TEXT_OR_BLOCKS: JSON = {"anyOf": [string(), array_of(_TEXT_BLOCK)]}
_THINKING_BLOCKS = [
    object_of({"type": {"const": "thinking"}, "thinking": string(), "signature": string()}, ("type",)),
    object_of({"type": {"const": "redacted_thinking"}, "data": string()}, ("type",)),
]
_TOOL_USE_BLOCK = object_of(
    {
        "type": {"const": "tool_use"},
        "id": string(),
        "name": string(),
        "input": {"type": "object"},
        "cache_control": _CACHE_CONTROL,
        "caller": nullable("object"),
    },
    ("type", "id", "name", "input"),
)
_TOOL_RESULT_BLOCK = object_of(
    {
        "type": {"const": "tool_result"},
        "tool_use_id": string(),
        "content": _TEXT_OR_BLOCKS,
        "is_error": BOOLEAN,
        "cache_control": _CACHE_CONTROL,
    },
    ("type", "tool_use_id"),
)
_ANTHROPIC_MESSAGE: JSON = {
    "anyOf": [
        object_of(
            {
                "role": {"const": "user"},
                "content": {"anyOf": [string(), array_of({"anyOf": [_TEXT_BLOCK, _TOOL_RESULT_BLOCK]})]},
            },
            ("role", "content"),
        ),
        object_of(
            {
                "role": {"const": "assistant"},
                "content": {
                    "anyOf": [string(), array_of({"anyOf": [_TEXT_BLOCK, _TOOL_USE_BLOCK, *_THINKING_BLOCKS]})]
                },
            },
            ("role", "content"),
        ),
        object_of({"role": {"const": "system"}, "content": _TEXT_OR_BLOCKS}, ("role", "content")),
    ]
}
_ANTHROPIC_TOOL = object_of(
    {
        "type": {"const": "custom"},
        "name": string(pattern="^[a-zA-Z0-9_-]{1,128}$"),
        "description": string(),
        "input_schema": ANY_OBJECT,
        "cache_control": _CACHE_CONTROL,
    },
    ("name", "input_schema"),
)


def messages_request_schema(served_model: str, *, count_tokens: bool = False) -> JSON:
    properties: JSON = {
        "model": enum_of(served_model, ""),
        "messages": array_of(_ANTHROPIC_MESSAGE, min_items=1),
        "system": _TEXT_OR_BLOCKS,
        "tools": array_of(_ANTHROPIC_TOOL, max_items=MAX_TOOLS),
        "tool_choice": {
            "anyOf": [
                object_of({"type": enum_of("auto", "any", "none"), "disable_parallel_tool_use": BOOLEAN}, ("type",)),
                object_of(
                    {"type": {"const": "tool"}, "name": string(), "disable_parallel_tool_use": BOOLEAN},
                    ("type", "name"),
                ),
            ]
        },
        "cache_control": _CACHE_CONTROL,
        "thinking": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"type": {"const": "enabled"}, "budget_tokens": integer(minimum=0)},
                    "required": ["type", "budget_tokens"],
                },
                {"type": "object", "properties": {"type": {"not": {"const": "enabled"}}}},
            ],
            "description": "'enabled': 'budget_tokens' bounds the reasoning (with a reasoning parser); 'disabled' "
            "reaches the chat template as reasoning effort 'none'.",
        },
        "metadata": object_of({"user_id": SESSION_ID}),
        "chat_template_kwargs": TEMPLATE_KWARGS,
    }
    if not count_tokens:
        properties |= {
            "max_tokens": integer(minimum=1),
            "temperature": number(0.0, 1.0),
            "top_p": number(0.0, 1.0, exclusive_minimum=True),
            "top_k": integer(minimum=0),
            "stop_sequences": array_of(NON_EMPTY, max_items=MAX_ANTHROPIC_STOP_SEQUENCES),
            "stream": BOOLEAN,
            "cache_salt": CACHE_SALT,
            "priority": PRIORITY,
            "speculative": SPECULATIVE,
        }
    rules = [
        "tool names are unique within 'tools'",
        "a 'tool_choice' of type 'tool' names a tool declared in 'tools'",
        "a final assistant message's text (a prefill, continued by the answer) does not end in whitespace",
    ]
    return object_of(
        properties,
        ("messages",) if count_tokens else ("max_tokens", "messages"),
        dependentSchemas={"tool_choice": {"required": ["tools"], "properties": {"tools": {"minItems": 1}}}},
        **{"x-rayturn-rules": rules},
    )


# -- the OpenAI Responses API ---------------------------------------------------------------------

# What an output item of a response carries besides its content, so that a response's output is sent back as is.
_ITEM_ID: JSON = {"id": string(), "status": enum_of("in_progress", "completed", "incomplete")}
_INPUT_PART: JSON = {
    "anyOf": [
        object_of({"type": {"const": "input_text"}, "text": string()}, ("type", "text")),
        # An answer's text as a response gave it (its annotations and log probabilities are not read).
        object_of(
            {"type": {"const": "output_text"}, "text": string(), "annotations": ARRAY, "logprobs": ARRAY},
            ("type", "text"),
        ),
        object_of({"type": {"const": "refusal"}, "refusal": string()}, ("type", "refusal")),
    ]
}
_INPUT_CONTENT: JSON = {"anyOf": [string(), array_of(_INPUT_PART)]}
# The items that make messages: an input needs one (reasoning items alone make none).
_MESSAGE_ITEM: JSON = {
    "anyOf": [
        object_of(
            {
                "type": {"const": "message"},
                "role": enum_of("user", "assistant", "system", "developer"),
                "content": _INPUT_CONTENT,
                **_ITEM_ID,
            },
            ("role", "content"),
        ),
        object_of(
            {
                "type": {"const": "function_call"},
                "call_id": string(),
                "name": string(),
                "arguments": string(),
                **_ITEM_ID,
            },
            ("type", "call_id", "name", "arguments"),
        ),
        object_of(
            {"type": {"const": "function_call_output"}, "call_id": string(), "output": _INPUT_CONTENT, **_ITEM_ID},
            ("type", "call_id", "output"),
        ),
        {
            **object_of({"type": {"const": "item_reference"}, "id": string()}, ("type", "id")),
            "description": "An item of a stored response (its input or output), named by its id.",
        },
    ]
}
_REASONING_PARTS: JSON = array_of(object_of({"type": string(), "text": string()}, ("type", "text")))
_REASONING_ITEM: JSON = object_of(
    {
        "type": {"const": "reasoning"},
        "content": _REASONING_PARTS,
        "summary": _REASONING_PARTS,
        "encrypted_content": string(),
        **_ITEM_ID,
    },
    ("type",),
)
_INPUT_ITEMS: JSON = {**array_of({"anyOf": [_MESSAGE_ITEM, _REASONING_ITEM]}, min_items=1), "contains": _MESSAGE_ITEM}
_RESPONSES_TOOL: JSON = {
    "anyOf": [
        object_of(
            {
                "type": {"const": "function"},
                "name": TOOL_NAME_64,
                "description": string(),
                "parameters": ANY_OBJECT,
                "strict": BOOLEAN,
            },
            ("type", "name"),
        ),
        {
            "type": "object",
            "properties": {"type": enum_of(*IGNORED_TOOL_TYPES)},
            "required": ["type"],
            "description": "Built-in tools a client may list; they are dropped, the model sees only function tools.",
        },
    ]
}
_TEXT_FORMAT: JSON = {
    "anyOf": [
        object_of({"type": enum_of("text", "json_object")}, ("type",)),
        object_of(
            {
                "type": {"const": "json_schema"},
                "name": string(),
                "schema": ANY_OBJECT,
                "description": string(),
                "strict": BOOLEAN,
            },
            ("type", "name", "schema"),
        ),
    ]
}


def _query(schemas: JSON) -> list[JSON]:
    return [{"name": name, "in": "query", "schema": schema} for name, schema in schemas.items()]


_RESPONSE_ID = [{"name": "response_id", "in": "path", "required": True, "schema": string()}]
# The path and query parameters of the routes that take some, by name.
PARAMETERS = {
    "response_id": _RESPONSE_ID,
    # Reading a response: ``stream`` and ``starting_after`` follow a streamed background response's events.
    "response_read": [*_RESPONSE_ID, *_query({"stream": BOOLEAN, "starting_after": integer(minimum=0)})],
    # ``GET /v1/responses/{id}/input_items`` (``responses_items``).
    "input_items": [
        *_RESPONSE_ID,
        *_query({"limit": integer(1, MAX_LIMIT), "order": enum_of("asc", "desc"), "after": string()}),
    ],
    "model_id": [{"name": "model_id", "in": "path", "required": True, "schema": string()}],
    # ``GET /v1/models``: Anthropic's models list's query (``bodies.models_list``).
    "models_page": _query({"limit": integer(1, MAX_MODELS_LIMIT), "after_id": string(), "before_id": string()}),
}


# The sampling fields the Responses API reads as the chat API does (``protocol.vllm_sampling``).
RESPONSES_SAMPLING = (
    "stop",
    "seed",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "min_tokens",
    "stop_token_ids",
)


def responses_request_schema(served_model: str, vocab_size: int, *, input_tokens: bool = False) -> JSON:
    shared = sampling_properties(vocab_size)
    properties = {
        **{name: shared[name] for name in RESPONSES_SAMPLING},
        "n": {"const": 1, "description": "A response has one answer."},
        "model": enum_of(served_model, ""),
        "input": {"anyOf": [string(), _INPUT_ITEMS]},
        "instructions": string(),
        "tools": array_of(_RESPONSES_TOOL, max_items=MAX_TOOLS),
        "tool_choice": {
            "anyOf": [
                enum_of("none", "auto", "required"),
                object_of({"type": {"const": "function"}, "name": string()}, ("type", "name")),
            ]
        },
        "parallel_tool_calls": BOOLEAN,
        "max_output_tokens": integer(minimum=1),
        "temperature": number(0.0, MAX_TEMPERATURE),
        "top_p": number(0.0, 1.0, exclusive_minimum=True),
        "text": object_of({"format": _TEXT_FORMAT, "verbosity": enum_of(*VERBOSITIES)}),
        "store": BOOLEAN,
        "previous_response_id": string(description="The id of a stored response this call continues."),
        "stream": BOOLEAN,
        "prompt_cache_key": SESSION_ID,
        "prompt_cache_retention": enum_of(*PROMPT_CACHE_RETENTION_S),
        "reasoning": object_of({"effort": enum_of(*REASONING_EFFORTS), "summary": string()}),
        "include": array_of(enum_of(*INCLUDABLE)),
        "metadata": {"type": "object", "additionalProperties": string()},
        "truncation": enum_of(*TRUNCATION_MODES),
        "service_tier": string(),
        "user": SESSION_ID,
        "safety_identifier": string(),
        "background": BOOLEAN,
        # Alternatives per answer token, returned when ``include`` names ``message.output_text.logprobs``.
        "top_logprobs": integer(0, MAX_LOGPROBS),
        "cache_salt": CACHE_SALT,
        "priority": PRIORITY,
        "speculative": SPECULATIVE,
        "chat_template_kwargs": TEMPLATE_KWARGS,
        "structured_outputs": STRUCTURED_OUTPUTS,
    }
    continues = "'previous_response_id' names a response stored for the same tenant, completed or incomplete"
    chooses = "a 'tool_choice' of 'required' or a named function needs function tools; a named one is declared"
    if input_tokens:  # ``POST /v1/responses/input_tokens``: the fields that make the prompt
        counted = {name: properties[name] for name in INPUT_TOKEN_FIELDS if name in properties}
        choice_needs_tools = {"tool_choice": {"required": ["tools"]}}
        return object_of(
            counted, ("input",), dependentSchemas=choice_needs_tools, **{"x-rayturn-rules": [continues, chooses]}
        )
    rules = [
        *SHARED_RULES,
        continues,
        "'background': true needs 'store': true",
        chooses,
        STRUCTURED_OUTPUT_RULE,
        token_filter_rule("text.format"),
        MIN_TOKENS_RULE,
    ]
    # One guide per call: structured outputs go with neither a text.format other than text nor a forced call.
    plain_text = {"properties": {"format": {"properties": {"type": {"const": "text"}}}}}
    one_guide = {"properties": {"tool_choice": enum_of("none", "auto"), "text": plain_text}}
    return object_of(
        properties,
        ("input",),
        dependentSchemas={"tool_choice": {"required": ["tools"]}, "structured_outputs": one_guide},
        # A background response is read back from the store.
        **{"if": {"properties": {"background": {"const": True}}, "required": ["background"]}},
        then={"properties": {"store": {"const": True}}},
        **{"x-rayturn-rules": rules},
    )

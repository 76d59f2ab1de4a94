"""The OpenAPI 3.1 document of the HTTP APIs (``GET /openapi.json``): what each route accepts, as JSON Schemas.

The bodies are parsed by hand (``chat_request``, ``completion_request``,
``anthropic_request``, ``responses_request``); the schemas here are written
from those parsers' rules, field by field, with the same bounds, so that a
body valid under its schema is one the parser accepts. Where the schema and
the parser differ, the schema is the tighter one: it lists the fields a
client should send (no unknown ones: the parsers ignore those, a schema that
allowed them would promise they mean something) and leaves out the accepted
legacy spellings. A few rules tie one value to another and have no JSON
Schema form; each operation lists them under ``x-rayturn-rules``: a body
that breaks one is refused with a 400 naming the field.

Every operation answers errors in its API's own shape: ``OpenAIError``
(``{"error": {...}}``) for the OpenAI APIs, ``AnthropicError``
(``{"type": "error", "error": {...}}``) for the Messages API.

The document names the served model, so it is served like ``/v1/models``:
to a caller with a valid key when keys are set.
"""

from __future__ import annotations

from typing import Any

from rayturn import __version__
from rayturn.engine.sampling_params import MAX_LOGPROBS

from .anthropic_request import CACHE_TTLS_S
from .anthropic_request import MAX_STOP_SEQUENCES as MAX_ANTHROPIC_STOP_SEQUENCES
from .chat_request import MAX_TOOLS
from .completion_request import MAX_PROMPTS
from .json_fields import INT64_MAX, INT64_MIN
from .protocol import (
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_STOP_SEQUENCES,
    MAX_TEMPERATURE,
    PROMPT_CACHE_RETENTION_S,
)
from .responses_request import IGNORED_TOOL_TYPES, TRUNCATION_MODES, VERBOSITIES
from .session import MAX_SESSION_ID_CHARS

JSON = dict[str, Any]

SHARED_RULES = (
    "max_tokens plus the prompt's tokens must fit the model's context (max_model_len)",
    "function tool names are unique within 'tools'",
)


def _object(properties: JSON, required: tuple[str, ...] = (), **extra: Any) -> JSON:
    schema: JSON = {"type": "object", "properties": properties, "additionalProperties": False, **extra}
    if required:
        schema["required"] = list(required)
    return schema


def _string(**extra: Any) -> JSON:
    return {"type": "string", **extra}


def _integer(minimum: int = INT64_MIN, maximum: int = INT64_MAX) -> JSON:
    """An integer field: an int64 at most, as ``json_fields.Fields.integer`` reads every one."""
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


def _number(minimum: float, maximum: float, *, exclusive_minimum: bool = False) -> JSON:
    bound = {"exclusiveMinimum": minimum} if exclusive_minimum else {"minimum": minimum}
    return {"type": "number", **bound, "maximum": maximum}


def _array(items: JSON, min_items: int = 0, max_items: int | None = None) -> JSON:
    schema: JSON = {"type": "array", "items": items, "minItems": min_items}
    if max_items is not None:
        schema["maxItems"] = max_items
    return schema


def _enum(*values: str) -> JSON:
    return {"type": "string", "enum": list(values)}


BOOLEAN: JSON = {"type": "boolean"}
ANY_OBJECT: JSON = {"type": "object", "description": "A JSON Schema object, as the tool or format declares it."}
TOOL_NAME_64 = _string(pattern="^[a-zA-Z0-9_-]{1,64}$")
NON_EMPTY = _string(minLength=1)
# Fields that name the call's session when no header does (``session.MAX_SESSION_ID_CHARS``).
SESSION_ID = _string(maxLength=MAX_SESSION_ID_CHARS)


# -- the OpenAI chat completions and completions APIs ----------------------------------------------

_TEXT_PART = _object({"type": {"const": "text"}, "text": _string()}, ("type", "text"))
_CHAT_CONTENT: JSON = {"anyOf": [_string(), _array(_TEXT_PART)]}
_CHAT_TOOL_CALL = _object(
    {
        "id": _string(),
        "type": {"const": "function"},
        "function": _object({"name": _string(), "arguments": _string()}, ("name", "arguments")),
    },
    ("id", "function"),
)
_CHAT_MESSAGE: JSON = {
    "anyOf": [
        _object(
            {"role": _enum("system", "developer", "user"), "content": _CHAT_CONTENT, "name": _string()},
            ("role", "content"),
        ),
        _object(
            {
                "role": {"const": "assistant"},
                "content": _CHAT_CONTENT,
                "name": _string(),
                "tool_calls": _array(_CHAT_TOOL_CALL),
                "reasoning_content": _string(),
            },
            ("role", "content"),
        ),
        _object(
            {"role": {"const": "tool"}, "content": _CHAT_CONTENT, "tool_call_id": _string()},
            ("role", "content", "tool_call_id"),
        ),
    ]
}
_CHAT_TOOL = _object(
    {
        "type": {"const": "function"},
        "function": _object(
            {"name": TOOL_NAME_64, "description": _string(), "parameters": ANY_OBJECT, "strict": BOOLEAN}, ("name",)
        ),
    },
    ("type", "function"),
)
_RESPONSE_FORMAT: JSON = {
    "anyOf": [
        _object({"type": _enum("text", "json_object")}, ("type",)),
        _object(
            {
                "type": {"const": "json_schema"},
                "json_schema": _object(
                    {"name": _string(), "schema": ANY_OBJECT, "strict": BOOLEAN, "description": _string()}, ("name",)
                ),
            },
            ("type", "json_schema"),
        ),
    ]
}


def _sampling(max_tokens_minimum: int = 1) -> JSON:
    """The sampling fields of both OpenAI APIs, vLLM's extensions included (``protocol.sampling_spec``)."""
    return {
        "max_tokens": _integer(minimum=max_tokens_minimum),
        "temperature": _number(0.0, MAX_TEMPERATURE),
        "top_p": _number(0.0, 1.0, exclusive_minimum=True),
        "n": _integer(1, MAX_N),
        "stop": {"anyOf": [NON_EMPTY, _array(NON_EMPTY, max_items=MAX_STOP_SEQUENCES)]},
        "seed": _integer(INT64_MIN, INT64_MAX),
        "stream": BOOLEAN,
        "stream_options": _object({"include_usage": BOOLEAN}),
        "user": SESSION_ID,
        "frequency_penalty": {"const": 0, "description": "Only 0 is supported."},
        "presence_penalty": {"const": 0, "description": "Only 0 is supported."},
        "logit_bias": {"type": "object", "maxProperties": 0, "description": "Only an empty object is supported."},
        "top_k": _integer(minimum=-1),
        "min_p": _number(0.0, 1.0),
        "repetition_penalty": _number(0.0, MAX_REPETITION_PENALTY, exclusive_minimum=True),
        "ignore_eos": BOOLEAN,
        "include_stop_str_in_output": BOOLEAN,
        "skip_special_tokens": BOOLEAN,
        "return_tokens_as_token_ids": BOOLEAN,
    }


# ``stream_options`` only with ``"stream": true``.
_STREAM_OPTIONS_NEED_STREAM = {"stream_options": {"properties": {"stream": {"const": True}}, "required": ["stream"]}}


def chat_request_schema(served_model: str) -> JSON:
    properties = {
        "model": _enum(served_model, ""),
        "messages": _array(_CHAT_MESSAGE, min_items=1),
        **_sampling(),
        "max_completion_tokens": _integer(minimum=1),
        "logprobs": BOOLEAN,
        "top_logprobs": _integer(0, MAX_LOGPROBS),
        "tools": _array(_CHAT_TOOL, 1, MAX_TOOLS),
        "tool_choice": {
            "anyOf": [
                _enum("none", "auto", "required"),
                _object(
                    {"type": {"const": "function"}, "function": _object({"name": _string()}, ("name",))},
                    ("type", "function"),
                ),
            ]
        },
        "parallel_tool_calls": BOOLEAN,
        "response_format": _RESPONSE_FORMAT,
        "prompt_cache_key": SESSION_ID,
        "prompt_cache_retention": _enum(*PROMPT_CACHE_RETENTION_S),
    }
    return _object(
        properties,
        ("messages",),
        dependentSchemas={
            **_STREAM_OPTIONS_NEED_STREAM,
            "top_logprobs": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
            "tool_choice": {"required": ["tools"]},
        },
        **{"x-rayturn-rules": [*SHARED_RULES, "a named 'tool_choice' names a tool declared in 'tools'"]},
    )


def completion_request_schema(served_model: str, vocab_size: int) -> JSON:
    text = NON_EMPTY
    token_ids = _array(_integer(0, vocab_size - 1), min_items=1)
    prompt = {"anyOf": [text, token_ids, _array({"anyOf": [text, token_ids]}, 1, MAX_PROMPTS)]}
    properties = {
        "model": _enum(served_model, ""),
        "prompt": prompt,
        **_sampling(),
        "echo": BOOLEAN,
        "logprobs": _integer(0, MAX_LOGPROBS),
        "prompt_logprobs": _integer(0, MAX_LOGPROBS),
        "suffix": {"const": "", "description": "Only an empty suffix is supported."},
    }
    rules = [*SHARED_RULES[:1], "with 'echo', 'max_tokens' may be 0: the prompt is scored, nothing generated"]
    return _object(properties, ("prompt",), dependentSchemas=_STREAM_OPTIONS_NEED_STREAM, **{"x-rayturn-rules": rules})


# -- the Anthropic Messages API -------------------------------------------------------------------

_CACHE_CONTROL = _object({"type": {"const": "ephemeral"}, "ttl": _enum(*CACHE_TTLS_S)}, ("type",))
_TEXT_BLOCK = _object({"type": {"const": "text"}, "text": _string(), "cache_control": _CACHE_CONTROL}, ("type", "text"))
_TEXT_OR_BLOCKS: JSON = {"anyOf": [_string(), _array(_TEXT_BLOCK)]}
_THINKING_BLOCKS = [
    _object({"type": {"const": "thinking"}, "thinking": _string(), "signature": _string()}, ("type",)),
    _object({"type": {"const": "redacted_thinking"}, "data": _string()}, ("type",)),
]
_TOOL_USE_BLOCK = _object(
    {
        "type": {"const": "tool_use"},
        "id": _string(),
        "name": _string(),
        "input": {"type": "object"},
        "cache_control": _CACHE_CONTROL,
    },
    ("type", "id", "name", "input"),
)
_TOOL_RESULT_BLOCK = _object(
    {
        "type": {"const": "tool_result"},
        "tool_use_id": _string(),
        "content": _TEXT_OR_BLOCKS,
        "is_error": BOOLEAN,
        "cache_control": _CACHE_CONTROL,
    },
    ("type", "tool_use_id"),
)
_ANTHROPIC_MESSAGE: JSON = {
    "anyOf": [
        _object(
            {
                "role": {"const": "user"},
                "content": {"anyOf": [_string(), _array({"anyOf": [_TEXT_BLOCK, _TOOL_RESULT_BLOCK]})]},
            },
            ("role", "content"),
        ),
        _object(
            {
                "role": {"const": "assistant"},
                "content": {"anyOf": [_string(), _array({"anyOf": [_TEXT_BLOCK, _TOOL_USE_BLOCK, *_THINKING_BLOCKS]})]},
            },
            ("role", "content"),
        ),
        _object({"role": {"const": "system"}, "content": _TEXT_OR_BLOCKS}, ("role", "content")),
    ]
}
_ANTHROPIC_TOOL = _object(
    {
        "type": {"const": "custom"},
        "name": _string(pattern="^[a-zA-Z0-9_-]{1,128}$"),
        "description": _string(),
        "input_schema": ANY_OBJECT,
        "cache_control": _CACHE_CONTROL,
    },
    ("name", "input_schema"),
)


def messages_request_schema(served_model: str, *, count_tokens: bool = False) -> JSON:
    properties: JSON = {
        "model": _enum(served_model, ""),
        "messages": _array(_ANTHROPIC_MESSAGE, min_items=1),
        "system": _TEXT_OR_BLOCKS,
        "tools": _array(_ANTHROPIC_TOOL, max_items=MAX_TOOLS),
        "tool_choice": {
            "anyOf": [
                _object({"type": _enum("auto", "any", "none"), "disable_parallel_tool_use": BOOLEAN}, ("type",)),
                _object(
                    {"type": {"const": "tool"}, "name": _string(), "disable_parallel_tool_use": BOOLEAN},
                    ("type", "name"),
                ),
            ]
        },
        "cache_control": _CACHE_CONTROL,
        "thinking": {"type": "object", "description": "Accepted and ignored."},
        "metadata": _object({"user_id": SESSION_ID}),
    }
    if not count_tokens:
        properties |= {
            "max_tokens": _integer(minimum=1),
            "temperature": _number(0.0, 1.0),
            "top_p": _number(0.0, 1.0, exclusive_minimum=True),
            "top_k": _integer(minimum=0),
            "stop_sequences": _array(NON_EMPTY, max_items=MAX_ANTHROPIC_STOP_SEQUENCES),
            "stream": BOOLEAN,
        }
    rules = [
        "tool names are unique within 'tools'",
        "a 'tool_choice' of type 'tool' names a tool declared in 'tools'",
    ]
    return _object(
        properties,
        ("messages",) if count_tokens else ("max_tokens", "messages"),
        dependentSchemas={"tool_choice": {"required": ["tools"], "properties": {"tools": {"minItems": 1}}}},
        **{"x-rayturn-rules": rules},
    )


# -- the OpenAI Responses API ---------------------------------------------------------------------

_INPUT_PART: JSON = {
    "anyOf": [
        _object({"type": _enum("input_text", "output_text"), "text": _string()}, ("type", "text")),
        _object({"type": {"const": "refusal"}, "refusal": _string()}, ("type", "refusal")),
    ]
}
_INPUT_CONTENT: JSON = {"anyOf": [_string(), _array(_INPUT_PART)]}
_INPUT_ITEM: JSON = {
    "anyOf": [
        _object(
            {
                "type": {"const": "message"},
                "role": _enum("user", "assistant", "system", "developer"),
                "content": _INPUT_CONTENT,
            },
            ("role", "content"),
        ),
        _object(
            {"type": {"const": "function_call"}, "call_id": _string(), "name": _string(), "arguments": _string()},
            ("type", "call_id", "name", "arguments"),
        ),
        _object(
            {"type": {"const": "function_call_output"}, "call_id": _string(), "output": _INPUT_CONTENT},
            ("type", "call_id", "output"),
        ),
    ]
}
_RESPONSES_TOOL: JSON = {
    "anyOf": [
        _object(
            {
                "type": {"const": "function"},
                "name": TOOL_NAME_64,
                "description": _string(),
                "parameters": ANY_OBJECT,
                "strict": BOOLEAN,
            },
            ("type", "name"),
        ),
        {
            "type": "object",
            "properties": {"type": _enum(*IGNORED_TOOL_TYPES)},
            "required": ["type"],
            "description": "Built-in tools a client may list; they are dropped, the model sees only function tools.",
        },
    ]
}
_TEXT_FORMAT: JSON = {
    "anyOf": [
        _object({"type": _enum("text", "json_object")}, ("type",)),
        _object(
            {
                "type": {"const": "json_schema"},
                "name": _string(),
                "schema": ANY_OBJECT,
                "description": _string(),
                "strict": BOOLEAN,
            },
            ("type", "name", "schema"),
        ),
    ]
}


def responses_request_schema(served_model: str) -> JSON:
    properties = {
        "model": _enum(served_model, ""),
        "input": {"anyOf": [_string(), _array(_INPUT_ITEM, min_items=1)]},
        "instructions": _string(),
        "tools": _array(_RESPONSES_TOOL, max_items=MAX_TOOLS),
        "tool_choice": {
            "anyOf": [
                _enum("none", "auto", "required"),
                _object({"type": {"const": "function"}, "name": _string()}, ("type", "name")),
            ]
        },
        "parallel_tool_calls": BOOLEAN,
        "max_output_tokens": _integer(minimum=1),
        "temperature": _number(0.0, MAX_TEMPERATURE),
        "top_p": _number(0.0, 1.0, exclusive_minimum=True),
        "text": _object({"format": _TEXT_FORMAT, "verbosity": _enum(*VERBOSITIES)}),
        "store": BOOLEAN,
        "previous_response_id": _string(description="The id of a stored response this call continues."),
        "stream": BOOLEAN,
        "prompt_cache_key": SESSION_ID,
        "prompt_cache_retention": _enum(*PROMPT_CACHE_RETENTION_S),
        "reasoning": _object({"effort": _string(), "summary": _string()}),
        "include": _array(_string()),
        "metadata": {"type": "object", "additionalProperties": _string()},
        "truncation": _enum(*TRUNCATION_MODES),
        "service_tier": _string(),
        "user": SESSION_ID,
        "safety_identifier": _string(),
        "background": {"const": False},
        "top_logprobs": {"const": 0},
    }
    rules = [
        *SHARED_RULES,
        "'previous_response_id' names a response stored for the same tenant",
        "a 'tool_choice' of 'required' or a named function needs function tools; a named one is declared",
    ]
    return _object(
        properties,
        ("input",),
        dependentSchemas={"tool_choice": {"required": ["tools"]}},
        **{"x-rayturn-rules": rules},
    )


# -- errors and the document ----------------------------------------------------------------------

ERROR_SCHEMAS: JSON = {
    "OpenAIError": _object(
        {
            "error": _object(
                {
                    "message": _string(),
                    "type": _string(),
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
                ("message", "type", "param", "code"),
            )
        },
        ("error",),
    ),
    "AnthropicError": _object(
        {"type": {"const": "error"}, "error": _object({"type": _string(), "message": _string()}, ("type", "message"))},
        ("type", "error"),
    ),
}


def _errors(shape: str) -> JSON:
    content = {"application/json": {"schema": {"$ref": f"#/components/schemas/{shape}"}}}
    return {
        "4XX": {"description": "The request was refused.", "content": content},
        "5XX": {"description": "The server failed; retry.", "content": content},
    }


def _operation(summary: str, shape: str, body: JSON | None = None, *, streams: bool = False) -> JSON:
    ok_content: JSON = {"application/json": {"schema": {"type": "object"}}}
    if streams:
        ok_content["text/event-stream"] = {"schema": {"type": "string"}}
    operation: JSON = {"summary": summary, "responses": {"200": {"description": "OK", "content": ok_content}}}
    operation["responses"] |= _errors(shape)
    if body is not None:
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
        operation["x-rayturn-rules"] = body.pop("x-rayturn-rules", [])
    return operation


_RESPONSE_ID = [{"name": "response_id", "in": "path", "required": True, "schema": _string()}]


def openapi_document(served_model: str, vocab_size: int) -> JSON:
    """The document ``GET /openapi.json`` serves, for the model this ingress serves."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "rayturn", "version": __version__},
        "paths": {
            "/v1/chat/completions": {
                "post": _operation(
                    "OpenAI chat completions", "OpenAIError", chat_request_schema(served_model), streams=True
                )
            },
            "/v1/completions": {
                "post": _operation(
                    "OpenAI completions",
                    "OpenAIError",
                    completion_request_schema(served_model, vocab_size),
                    streams=True,
                )
            },
            "/v1/models": {"get": _operation("The served model", "OpenAIError")},
            "/v1/messages": {
                "post": _operation(
                    "Anthropic Messages", "AnthropicError", messages_request_schema(served_model), streams=True
                )
            },
            "/v1/messages/count_tokens": {
                "post": _operation(
                    "Anthropic token count", "AnthropicError", messages_request_schema(served_model, count_tokens=True)
                )
            },
            "/v1/responses": {
                "post": _operation(
                    "OpenAI Responses", "OpenAIError", responses_request_schema(served_model), streams=True
                )
            },
            "/v1/responses/{response_id}": {
                "get": {**_operation("A stored response", "OpenAIError"), "parameters": _RESPONSE_ID},
                "delete": {**_operation("Delete a stored response", "OpenAIError"), "parameters": _RESPONSE_ID},
            },
            "/health": {
                "get": {
                    "summary": "Pool health",
                    "responses": {"200": {"description": "OK"}, "503": {"description": "Degraded"}},
                }
            },
        },
        "components": {"schemas": ERROR_SCHEMAS},
    }

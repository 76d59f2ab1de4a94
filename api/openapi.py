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

from rayturn import __version__
from rayturn.engine.sampling_params import MAX_LOGPROBS

from .chat_request import MAX_TOOLS, REASONING_EFFORTS
from .completion_request import MAX_PROMPTS
from .json_fields import INT64_MAX
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
    TEMPLATE_KWARGS,
    TOKEN_FILTER_RULE,
    TOOL_NAME_64,
    array_of,
    enum_of,
    integer,
    nullable,
    object_of,
    string,
)
from .openapi_agents import PARAMETERS, messages_request_schema, responses_request_schema
from .openapi_operations import ERROR_SCHEMAS, operation
from .openapi_sampling import sampling_properties
from .protocol import PROMPT_CACHE_RETENTION_S
from .tokenize_request import CHAT_ONLY_FIELDS

# -- the OpenAI chat completions and completions APIs ----------------------------------------------

_TEXT_PART = object_of({"type": {"const": "text"}, "text": string()}, ("type", "text"))
_CHAT_CONTENT: JSON = {"anyOf": [string(), array_of(_TEXT_PART)]}
_CHAT_TOOL_CALL = object_of(
    {
        "id": string(),
        "type": {"const": "function"},
        "function": object_of({"name": string(), "arguments": string()}, ("name", "arguments")),
    },
    ("id", "function"),
)
_CALLS = array_of(_CHAT_TOOL_CALL, min_items=1)
# An assistant message's fields besides its content: a chat completion's message sent back as it came (its
# ``refusal``, ``annotations``, ``audio`` and ``function_call`` are not read).
_ASSISTANT: JSON = {
    "name": string(),
    "tool_calls": {**array_of(_CHAT_TOOL_CALL), **nullable("array")},
    "reasoning": nullable("string"),
    "reasoning_content": nullable("string"),
    "refusal": nullable("string"),
    "annotations": ARRAY,
    "audio": nullable(),
    "function_call": nullable(),
}
_CHAT_MESSAGE: JSON = {
    "anyOf": [
        object_of(
            {"role": enum_of("system", "developer", "user"), "content": _CHAT_CONTENT, "name": string()},
            ("role", "content"),
        ),
        object_of({"role": {"const": "assistant"}, "content": _CHAT_CONTENT, **_ASSISTANT}, ("role", "content")),
        # An answer of calls alone: no content (or a null one, as a chat completion's message has it).
        object_of(
            {"role": {"const": "assistant"}, "content": {"type": "null"}, **_ASSISTANT, "tool_calls": _CALLS},
            ("role", "tool_calls"),
        ),
        object_of(
            {"role": {"const": "tool"}, "content": _CHAT_CONTENT, "tool_call_id": string(), "name": string()},
            ("role", "content", "tool_call_id"),
        ),
    ]
}
_CHAT_TOOL = object_of(
    {
        "type": {"const": "function"},
        "function": object_of(
            {"name": TOOL_NAME_64, "description": string(), "parameters": ANY_OBJECT, "strict": BOOLEAN}, ("name",)
        ),
    },
    ("type", "function"),
)
_TOOL_CHOICE: JSON = {
    "anyOf": [
        enum_of("none", "auto", "required"),
        object_of(
            {"type": {"const": "function"}, "function": object_of({"name": string()}, ("name",))},
            ("type", "function"),
        ),
    ]
}
_RESPONSE_FORMAT: JSON = {
    "anyOf": [
        object_of({"type": enum_of("text", "json_object")}, ("type",)),
        object_of(
            {
                "type": {"const": "json_schema"},
                "json_schema": object_of(
                    {"name": string(), "schema": ANY_OBJECT, "strict": BOOLEAN, "description": string()}, ("name",)
                ),
            },
            ("type", "json_schema"),
        ),
    ]
}


# ``stream_options`` only with ``"stream": true``.
_STREAM_OPTIONS_NEED_STREAM = {"stream_options": {"properties": {"stream": {"const": True}}, "required": ["stream"]}}


_CHAT_RULES = (
    "a named 'tool_choice' names a tool declared in 'tools'",
    "'continue_final_message' needs a final assistant message with text",
)


def chat_request_schema(
    served_model: str, vocab_size: int, *, reasoning: bool = False, max_model_len: int = INT64_MAX
) -> JSON:
    """``reasoning``: the server splits reasoning off (a reasoning parser), which ``thinking_token_budget`` bounds."""
    properties = {
        "model": enum_of(served_model, ""),
        "messages": array_of(_CHAT_MESSAGE, min_items=1),
        **sampling_properties(vocab_size, max_model_len),
        "max_completion_tokens": integer(minimum=1),
        "logprobs": BOOLEAN,
        "top_logprobs": integer(0, MAX_LOGPROBS),
        "tools": array_of(_CHAT_TOOL, 1, MAX_TOOLS),
        "tool_choice": _TOOL_CHOICE,
        "parallel_tool_calls": BOOLEAN,
        "response_format": _RESPONSE_FORMAT,
        "prompt_cache_key": SESSION_ID,
        "prompt_cache_retention": enum_of(*PROMPT_CACHE_RETENTION_S),
        "cache_salt": CACHE_SALT,
        "priority": PRIORITY,
        "speculative": SPECULATIVE,
        # vLLM's assistant prefill: both or neither.
        "continue_final_message": BOOLEAN,
        "add_generation_prompt": BOOLEAN,
        "chat_template_kwargs": TEMPLATE_KWARGS,
        "reasoning_effort": enum_of(*REASONING_EFFORTS),
        "include_reasoning": BOOLEAN,
        **({"thinking_token_budget": integer(minimum=-1)} if reasoning else {}),
    }
    continue_final = {"properties": {"continue_final_message": {"const": True}}, "required": ["continue_final_message"]}
    return object_of(
        properties,
        ("messages",),
        dependentSchemas={
            **_STREAM_OPTIONS_NEED_STREAM,
            "top_logprobs": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
            "tool_choice": {"required": ["tools"]},
            # One guide per call: structured outputs go with neither a response format nor a forced tool call.
            "structured_outputs": {
                "not": {"required": ["response_format"]},
                "properties": {"tool_choice": enum_of("none", "auto")},
            },
            "continue_final_message": {
                "if": continue_final,
                "then": {
                    "properties": {"add_generation_prompt": {"const": False}},
                    "required": ["add_generation_prompt"],
                },
            },
            "add_generation_prompt": {
                "if": {"properties": {"add_generation_prompt": {"const": False}}},
                "then": continue_final,
            },
        },
        **{
            "x-rayturn-rules": [
                *SHARED_RULES,
                *_CHAT_RULES,
                STRUCTURED_OUTPUT_RULE,
                TOKEN_FILTER_RULE,
                MIN_TOKENS_RULE,
            ]
        },
    )


def completion_request_schema(served_model: str, vocab_size: int, max_model_len: int = INT64_MAX) -> JSON:
    text = NON_EMPTY
    token_ids = array_of(integer(0, vocab_size - 1), min_items=1)
    prompt = {"anyOf": [text, token_ids, array_of({"anyOf": [text, token_ids]}, 1, MAX_PROMPTS)]}
    properties = {
        "model": enum_of(served_model, ""),
        "prompt": prompt,
        **sampling_properties(vocab_size, max_model_len),
        "echo": BOOLEAN,
        "logprobs": integer(0, MAX_LOGPROBS),
        "prompt_logprobs": integer(0, MAX_LOGPROBS),
        "suffix": {"const": "", "description": "Only an empty suffix is supported."},
        "cache_salt": CACHE_SALT,
        "priority": PRIORITY,
        "speculative": SPECULATIVE,
    }
    rules = [
        *SHARED_RULES[:1],
        "with 'echo', 'max_tokens' may be 0: the prompt is scored, nothing generated",
        STRUCTURED_OUTPUT_RULE,
        TOKEN_FILTER_RULE,
        MIN_TOKENS_RULE,
    ]
    return object_of(
        properties, ("prompt",), dependentSchemas=_STREAM_OPTIONS_NEED_STREAM, **{"x-rayturn-rules": rules}
    )


def tokenize_request_schema(served_model: str) -> JSON:
    """vLLM's ``/tokenize``: a text (``prompt``) or a chat (``messages``, ``tokenize_request``)."""
    properties = {
        "model": enum_of(served_model, ""),
        "prompt": string(),
        "messages": array_of(_CHAT_MESSAGE, min_items=1),
        "tools": array_of(_CHAT_TOOL, 1, MAX_TOOLS),
        "tool_choice": _TOOL_CHOICE,
        "add_generation_prompt": BOOLEAN,
        "continue_final_message": BOOLEAN,
        "add_special_tokens": BOOLEAN,
        "return_token_strs": BOOLEAN,
        "chat_template_kwargs": TEMPLATE_KWARGS,
    }
    continue_final = {"properties": {"continue_final_message": {"const": True}}, "required": ["continue_final_message"]}
    chat_only: JSON = {name: {"required": ["messages"]} for name in CHAT_ONLY_FIELDS}
    chat_only["tool_choice"] = {"required": ["messages", "tools"]}
    chat_only["continue_final_message"] |= {
        "if": continue_final,
        "then": {"properties": {"add_generation_prompt": {"const": False}}},
    }
    rules = [SHARED_RULES[1], *_CHAT_RULES]
    return object_of(
        properties,
        (),
        oneOf=[{"required": ["prompt"]}, {"required": ["messages"]}],
        dependentSchemas=chat_only,
        **{"x-rayturn-rules": rules},
    )


def detokenize_request_schema(served_model: str, vocab_size: int) -> JSON:
    token_ids = array_of(integer(0, vocab_size - 1))
    return object_of({"model": enum_of(served_model, ""), "tokens": token_ids}, ("tokens",))


# -- the document ----------------------------------------------------------------------------------

_HEALTH: JSON = {
    "summary": "Pool health",
    "responses": {"200": {"description": "OK"}, "503": {"description": "Degraded"}},
}


def openapi_document(
    served_model: str, vocab_size: int, *, reasoning: bool = False, max_model_len: int = INT64_MAX
) -> JSON:
    """The document ``GET /openapi.json`` serves, for the model this ingress serves (``reasoning``: with a
    reasoning parser)."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "rayturn", "version": __version__},
        "paths": {
            "/v1/chat/completions": {
                "post": operation(
                    "OpenAI chat completions",
                    "OpenAIError",
                    chat_request_schema(served_model, vocab_size, reasoning=reasoning, max_model_len=max_model_len),
                    streams=True,
                )
            },
            "/v1/completions": {
                "post": operation(
                    "OpenAI completions",
                    "OpenAIError",
                    completion_request_schema(served_model, vocab_size, max_model_len),
                    streams=True,
                )
            },
            "/v1/models": {"get": operation("The served model", "OpenAIError", parameters=PARAMETERS["models_page"])},
            "/v1/models/{model_id}": {
                "get": operation("The served model's card", "OpenAIError", parameters=PARAMETERS["model_id"])
            },
            "/tokenize": {
                "post": operation(
                    "Token ids of a text or a chat (vLLM's)", "OpenAIError", tokenize_request_schema(served_model)
                )
            },
            "/detokenize": {
                "post": operation(
                    "The text of token ids (vLLM's)", "OpenAIError", detokenize_request_schema(served_model, vocab_size)
                )
            },
            "/v1/messages": {
                "post": operation(
                    "Anthropic Messages", "AnthropicError", messages_request_schema(served_model), streams=True
                )
            },
            "/v1/messages/count_tokens": {
                "post": operation(
                    "Anthropic token count", "AnthropicError", messages_request_schema(served_model, count_tokens=True)
                )
            },
            "/v1/responses": {
                "post": operation(
                    "OpenAI Responses", "OpenAIError", responses_request_schema(served_model, vocab_size), streams=True
                )
            },
            "/v1/responses/input_tokens": {
                "post": operation(
                    "Count a response's input tokens",
                    "OpenAIError",
                    responses_request_schema(served_model, vocab_size, input_tokens=True),
                )
            },
            "/v1/responses/{response_id}": {
                "get": operation("A stored response", "OpenAIError", parameters=PARAMETERS["response_read"]),
                "delete": operation("Delete a stored response", "OpenAIError", parameters=PARAMETERS["response_id"]),
            },
            "/v1/responses/{response_id}/input_items": {
                "get": operation("A response's input items", "OpenAIError", parameters=PARAMETERS["input_items"]),
            },
            "/v1/responses/{response_id}/cancel": {
                "post": operation("Cancel a background response", "OpenAIError", parameters=PARAMETERS["response_id"]),
            },
            "/health": {"get": _HEALTH},
            "/ping": {"get": {**_HEALTH, "summary": "Pool health, as SageMaker probes it (also POST)"}},
            "/version": {"get": operation("The server's version", "OpenAIError")},
        },
        "components": {"schemas": ERROR_SCHEMAS},
    }

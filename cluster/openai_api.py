"""The OpenAI HTTP API at its edge: request bodies in, response bodies out.

Everything here is pure: JSON-decoded bodies are validated into frozen
request objects, and engine results are turned into plain dicts in the exact
shapes of OpenAI's chat completions, completions and models endpoints. The
HTTP server owns transport, authentication and the engine; this module owns
the wire format.

Supported request fields (any other top-level field is ignored, since OpenAI
clients routinely send extras such as ``metadata`` or ``store``):

* both endpoints: ``model``, ``max_tokens``, ``temperature``, ``top_p``,
  ``n``, ``stop``, ``seed``, ``stream``, ``stream_options.include_usage``,
  ``user``; ``frequency_penalty``/``presence_penalty`` only at 0 and
  ``logit_bias`` only empty; the extensions ``top_k``, ``stop_token_ids`` and
  ``ignore_eos``.
* ``/v1/chat/completions``: ``messages`` (text content only),
  ``max_completion_tokens`` (wins over ``max_tokens``), ``logprobs``,
  ``top_logprobs``, ``tools``, ``tool_choice``, ``parallel_tool_calls``,
  ``response_format`` of type ``text``.
* ``/v1/completions``: ``prompt`` (one string or one list of token ids),
  ``logprobs`` (an integer), ``echo`` only false, ``suffix`` only empty,
  ``best_of`` only equal to ``n``.

A supported field with a bad value is a 400 whose ``param`` is the field's
dotted path (``messages[2].content``) and whose message quotes that path; a
field this server recognises but cannot honour (images, JSON mode, penalties) is a 400
too, rather than being silently ignored.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from rayturn.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from rayturn.engine.sequence import TokenLogprob
from rayturn.engine.tool_calls import (
    TOOL_CALL_END,
    TOOL_CALL_START,
    ParsedToolCalls,
    ToolCall,
    parse_tool_calls,
    random_tool_call_id,
)

SSE_DONE = "data: [DONE]\n\n"

MAX_N = 16
MAX_STOP_SEQUENCES = 4
MAX_TOOLS = 128
MAX_TEMPERATURE = 2.0
MAX_PENALTY = 2.0
# OpenAI reports log probabilities that are -inf (or otherwise not finite) as this floor.
MIN_LOGPROB = -9999.0
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
OWNED_BY = "rayturn"

MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CHOICE_MODES = ("none", "auto", "required")
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_ENGINE_FIELD = re.compile(r"^SamplingParams\.(\w+) ")
_JSON_DECODER = json.JSONDecoder()
_NOT_A_BLOCK = -1

JSON = dict[str, Any]
ToolChoice = str | JSON
TokenText = Callable[[int], str]
"""The text of one token id, e.g. ``lambda i: tokenizer.decode([i], skip_special_tokens=False)``."""


class APIError(Exception):
    """An error response: HTTP status plus OpenAI's ``{"error": {...}}`` body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def to_dict(self) -> JSON:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid_request(message: str, *, param: str | None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(message: str, *, param: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_value")


def authentication_failed() -> APIError:
    message = "Invalid or missing API key; send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'."
    return APIError(401, message, type="authentication_error", code="invalid_api_key")


def model_not_found(model: str, served_model: str) -> APIError:
    message = f"The model '{model}' does not exist; this server serves '{served_model}'."
    return APIError(404, message, type="not_found_error", param="model", code="model_not_found")


def context_length_exceeded(prompt_tokens: int, max_model_len: int, *, param: str) -> APIError:
    """The prompt alone fills the context. OpenAI answers this with a 400, not a 413."""
    message = (
        f"This model's maximum context length is {max_model_len} tokens. However, your '{param}' resulted in "
        f"{prompt_tokens} tokens. Please reduce the length of the '{param}'."
    )
    return APIError(400, message, param=param, code="context_length_exceeded")


def rate_limited(message: str) -> APIError:
    return APIError(429, message, type="rate_limit_error", code="rate_limit_exceeded")


def server_error(message: str, *, status_code: int = 500) -> APIError:
    return APIError(status_code, message, type="server_error")


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """Sampling as the client asked for it, before the prompt length is known."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    logprobs: bool = False
    top_logprobs: int | None = None
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A validated chat completions request.

    ``messages`` are ready for the chat template: content is a string (text
    parts joined with newlines, as vLLM does), ``developer`` became ``system``
    (open-weight templates know only the latter), and assistant tool-call
    ``arguments`` holding a JSON object are decoded into a dict, the form Hugging
    Face templates render with ``tojson``.
    """

    model: str
    messages: list[JSON]
    tools: list[JSON] | None
    tool_choice: ToolChoice
    sampling: SamplingSpec
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    parallel_tool_calls: bool = True

    @property
    def prompt_tools(self) -> list[JSON] | None:
        """The tools to show the model: none for ``tool_choice="none"``, only the named one for a named choice.

        Nothing constrains decoding, so ``"required"`` and a named choice are
        requests the model is trusted to follow, not guarantees.
        """
        if self.tools is None or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, dict):
            name = self.tool_choice["function"]["name"]
            return [tool for tool in self.tools if tool["function"]["name"] == name]
        return self.tools


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """A validated legacy completions request; ``prompt`` is text or token ids."""

    model: str
    prompt: str | list[int]
    sampling: SamplingSpec
    stream: bool = False
    include_usage: bool = False
    user: str | None = None


def parse_chat_request(body: object, served_model: str) -> ChatRequest:
    fields = _body(body)
    model = _model(fields, served_model)
    messages = _messages(fields)
    tools = _tools(fields)
    tool_choice = _tool_choice(fields, tools)
    _reject_unsupported_chat_fields(fields)
    logprobs = fields.boolean("logprobs") or False
    top_logprobs = fields.integer("top_logprobs", minimum=0, maximum=MAX_LOGPROBS)
    if top_logprobs is not None and not logprobs:
        raise invalid_request("Invalid 'top_logprobs': requires 'logprobs' to be true.", param="top_logprobs")
    max_tokens = fields.integer("max_tokens", minimum=1)
    max_completion_tokens = fields.integer("max_completion_tokens", minimum=1)
    stream = fields.boolean("stream") or False
    parallel_tool_calls = fields.boolean("parallel_tool_calls")
    return ChatRequest(
        model=model,
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        sampling=_sampling(
            fields,
            max_tokens=max_tokens if max_completion_tokens is None else max_completion_tokens,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
        ),
        stream=stream,
        include_usage=_include_usage(fields, stream),
        user=fields.string("user"),
        parallel_tool_calls=True if parallel_tool_calls is None else parallel_tool_calls,
    )


def parse_completion_request(body: object, served_model: str) -> CompletionRequest:
    fields = _body(body)
    model = _model(fields, served_model)
    prompt = _prompt(fields)
    if fields.boolean("echo"):
        raise unsupported("Unsupported 'echo': echoing the prompt is not supported; send false.", param="echo")
    if fields.string("suffix"):
        raise unsupported("Unsupported 'suffix': insertion after a suffix is not supported.", param="suffix")
    logprobs = fields.integer("logprobs", minimum=0, maximum=MAX_LOGPROBS)
    sampling = _sampling(
        fields,
        max_tokens=fields.integer("max_tokens", minimum=1),
        logprobs=logprobs is not None,
        top_logprobs=logprobs,
    )
    best_of = fields.integer("best_of", minimum=1)
    if best_of is not None and best_of != sampling.n:
        raise unsupported(f"Unsupported 'best_of': only best_of == n ({sampling.n}) is supported.", param="best_of")
    stream = fields.boolean("stream") or False
    return CompletionRequest(
        model=model,
        prompt=prompt,
        sampling=sampling,
        stream=stream,
        include_usage=_include_usage(fields, stream),
        user=fields.string("user"),
    )


def to_sampling_params(
    spec: SamplingSpec,
    *,
    default_max_tokens: int,
    prompt_tokens: int,
    max_model_len: int,
    prompt_param: str = "messages",
) -> SamplingParams:
    """Engine settings once the prompt length is known.

    Without ``max_tokens`` a request may fill the rest of the context, capped
    at ``default_max_tokens``. ``prompt_param`` is the field blamed when the
    prompt alone is too long (``"prompt"`` for completions).
    """
    if prompt_tokens >= max_model_len:
        raise context_length_exceeded(prompt_tokens, max_model_len, param=prompt_param)
    room_tokens = max_model_len - prompt_tokens
    if spec.max_tokens is None:
        max_tokens = min(default_max_tokens, room_tokens)
    elif spec.max_tokens > room_tokens:
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + spec.max_tokens} tokens ({prompt_tokens} in the '{prompt_param}', "
            f"{spec.max_tokens} in 'max_tokens'). Please reduce the length of the '{prompt_param}' or 'max_tokens'."
        )
        raise invalid_request(message, param="max_tokens", code="context_length_exceeded")
    else:
        max_tokens = spec.max_tokens
    try:
        return SamplingParams(
            n=spec.n,
            max_tokens=max_tokens,
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k,
            seed=spec.seed,
            stop=spec.stop,
            stop_token_ids=spec.stop_token_ids,
            ignore_eos=spec.ignore_eos,
            logprobs=(spec.top_logprobs or 0) if spec.logprobs else None,
        )
    except ValueError as error:
        match = _ENGINE_FIELD.match(str(error))
        field_name = match.group(1) if match else None
        raise invalid_request(f"Invalid '{field_name}': {error}", param=field_name) from error


# ---------------------------------------------------------------- validation


class _Fields:
    """Typed reads from one JSON object; null counts as absent, errors name the dotted path."""

    __slots__ = ("_object", "_prefix")

    def __init__(self, value: object, prefix: str) -> None:
        if not isinstance(value, dict):
            raise _type_error(prefix, "an object", value)
        self._object: Mapping[str, Any] = value
        self._prefix = prefix

    def path(self, key: str) -> str:
        return f"{self._prefix}.{key}" if self._prefix else key

    def raw(self, key: str) -> Any:
        return self._object.get(key)

    def present(self, key: str) -> Any:
        value = self._object.get(key)
        if value is None:
            raise invalid_request(f"Missing required parameter: '{self.path(key)}'.", param=self.path(key))
        return value

    def string(self, key: str) -> str | None:
        value = self.raw(key)
        if value is not None and not isinstance(value, str):
            raise _type_error(self.path(key), "a string", value)
        return value

    def required_string(self, key: str) -> str:
        value = self.present(key)
        if not isinstance(value, str):
            raise _type_error(self.path(key), "a string", value)
        return value

    def boolean(self, key: str) -> bool | None:
        value = self.raw(key)
        if value is not None and not isinstance(value, bool):
            raise _type_error(self.path(key), "a boolean", value)
        return value

    def integer(self, key: str, *, minimum: int | None = None, maximum: int | None = None) -> int | None:
        value = self.raw(key)
        if value is None:
            return None
        if not _is_integer(value):
            raise _type_error(self.path(key), "an integer", value)
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            raise _range_error(self.path(key), f"an integer {_bounds(minimum, maximum)}", value)
        return int(value)

    def number(self, key: str, *, minimum: float, maximum: float, exclusive_minimum: bool = False) -> float | None:
        value = self.raw(key)
        if value is None:
            return None
        if not _is_number(value):
            raise _type_error(self.path(key), "a number", value)
        if value < minimum or (exclusive_minimum and value == minimum) or value > maximum:
            interval = f"({minimum:g}, {maximum:g}]" if exclusive_minimum else f"[{minimum:g}, {maximum:g}]"
            raise _range_error(self.path(key), f"a number in {interval}", value)
        return float(value)

    def nested(self, key: str) -> _Fields | None:
        value = self.raw(key)
        return None if value is None else _Fields(value, self.path(key))

    def required_nested(self, key: str) -> _Fields:
        return _Fields(self.present(key), self.path(key))

    def array(self, key: str) -> list[Any] | None:
        value = self.raw(key)
        if value is not None and not isinstance(value, list):
            raise _type_error(self.path(key), "an array", value)
        return value


def _is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _bounds(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f"in [{minimum}, {maximum}]"
    return f">= {minimum}" if minimum is not None else f"<= {maximum}"


def _json_type(value: object) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _type_error(param: str, expected: str, value: object) -> APIError:
    return invalid_request(f"Invalid type for '{param}': expected {expected}, got {_json_type(value)}.", param=param)


def _range_error(param: str, expected: str, value: object) -> APIError:
    return invalid_request(f"Invalid '{param}': expected {expected}, got {value!r}.", param=param)


def _body(body: object) -> _Fields:
    if not isinstance(body, dict):
        raise invalid_request(f"The request body must be a JSON object, got {_json_type(body)}.", param=None)
    return _Fields(body, "")


def _model(fields: _Fields, served_model: str) -> str:
    model = fields.required_string("model")
    if model != served_model:
        raise model_not_found(model, served_model)
    return model


def _sampling(fields: _Fields, *, max_tokens: int | None, logprobs: bool, top_logprobs: int | None) -> SamplingSpec:
    for penalty in ("frequency_penalty", "presence_penalty"):
        if fields.number(penalty, minimum=-MAX_PENALTY, maximum=MAX_PENALTY):
            raise unsupported(f"Unsupported '{penalty}': only 0 is supported.", param=penalty)
    if fields.nested("logit_bias") is not None and fields.raw("logit_bias"):
        raise unsupported("Unsupported 'logit_bias': only an empty object is supported.", param="logit_bias")
    temperature = fields.number("temperature", minimum=0.0, maximum=MAX_TEMPERATURE)
    top_p = fields.number("top_p", minimum=0.0, maximum=1.0, exclusive_minimum=True)
    top_k = fields.integer("top_k", minimum=-1)
    return SamplingSpec(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=0 if top_k is None else top_k,
        seed=fields.integer("seed", minimum=INT64_MIN, maximum=INT64_MAX),
        stop=_stop(fields),
        stop_token_ids=_stop_token_ids(fields),
        n=fields.integer("n", minimum=1, maximum=MAX_N) or 1,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        ignore_eos=fields.boolean("ignore_eos") or False,
    )


def _stop(fields: _Fields) -> tuple[str, ...]:
    value = fields.raw("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        entries = [("stop", value)]
    elif isinstance(value, list):
        if len(value) > MAX_STOP_SEQUENCES:
            message = f"Invalid 'stop': expected at most {MAX_STOP_SEQUENCES} sequences, got {len(value)}."
            raise invalid_request(message, param="stop")
        entries = [(f"stop[{i}]", entry) for i, entry in enumerate(value)]
    else:
        raise _type_error("stop", "a string or an array of strings", value)
    for param, entry in entries:
        if not isinstance(entry, str):
            raise _type_error(param, "a string", entry)
        if not entry:
            raise invalid_request(f"Invalid '{param}': stop sequences must not be empty.", param=param)
    return tuple(entry for _, entry in entries)


def _stop_token_ids(fields: _Fields) -> tuple[int, ...]:
    values = fields.array("stop_token_ids") or []
    for i, token_id in enumerate(values):
        if not _is_integer(token_id) or token_id < 0:
            raise _range_error(f"stop_token_ids[{i}]", "a non-negative integer", token_id)
    return tuple(values)


def _include_usage(fields: _Fields, stream: bool) -> bool:
    options = fields.nested("stream_options")
    if options is None:
        return False
    if not stream:
        message = "Invalid 'stream_options': only allowed when 'stream' is true."
        raise invalid_request(message, param="stream_options")
    return options.boolean("include_usage") or False


def _reject_unsupported_chat_fields(fields: _Fields) -> None:
    response_format = fields.nested("response_format")
    if response_format is not None:
        format_type = response_format.required_string("type")
        if format_type != "text":
            message = f"Unsupported 'response_format.type': only 'text' is supported, got {format_type!r}."
            raise unsupported(message, param="response_format.type")
    for legacy, replacement in (("functions", "tools"), ("function_call", "tool_choice")):
        if fields.raw(legacy) is not None:
            raise unsupported(f"Unsupported '{legacy}': use '{replacement}' instead.", param=legacy)


def _messages(fields: _Fields) -> list[JSON]:
    messages = fields.present("messages")
    if not isinstance(messages, list):
        raise _type_error("messages", "an array", messages)
    if not messages:
        raise invalid_request("Invalid 'messages': expected a non-empty array.", param="messages")
    return [_message(_Fields(item, f"messages[{i}]")) for i, item in enumerate(messages)]


def _message(fields: _Fields) -> JSON:
    role = fields.required_string("role")
    if role not in MESSAGE_ROLES:
        raise _range_error(fields.path("role"), f"one of {', '.join(MESSAGE_ROLES)}", role)
    message: JSON = {"role": "system" if role == "developer" else role}
    tool_calls = _assistant_tool_calls(fields) if role == "assistant" else None
    content = _content(fields, required=tool_calls is None)
    if content is not None:
        message["content"] = content
    if tool_calls:
        message["tool_calls"] = tool_calls
    name = fields.string("name")
    if name is not None:
        message["name"] = name
    if role == "tool":
        message["tool_call_id"] = fields.required_string("tool_call_id")
    reasoning = fields.string("reasoning_content") if role == "assistant" else None
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


def _content(fields: _Fields, *, required: bool) -> str | None:
    parts = fields.present("content") if required else fields.raw("content")
    if parts is None or isinstance(parts, str):
        return parts
    path = fields.path("content")
    if not isinstance(parts, list):
        raise _type_error(path, "a string or an array of content parts", parts)
    texts = []
    for i, part in enumerate(parts):
        part_fields = _Fields(part, f"{path}[{i}]")
        part_type = part_fields.required_string("type")
        if part_type != "text":
            message = f"Unsupported '{part_fields.path('type')}': only 'text' content parts are supported, "
            raise unsupported(message + f"got {part_type!r}.", param=part_fields.path("type"))
        texts.append(part_fields.required_string("text"))
    return "\n".join(texts)


def _assistant_tool_calls(fields: _Fields) -> list[JSON] | None:
    calls = fields.array("tool_calls")
    if not calls:
        return None
    normalized = []
    for i, item in enumerate(calls):
        call = _Fields(item, fields.path(f"tool_calls[{i}]"))
        call_type = call.string("type")
        if call_type not in (None, "function"):
            raise unsupported(f"Unsupported '{call.path('type')}': expected 'function'.", param=call.path("type"))
        function = call.required_nested("function")
        arguments = function.required_string("arguments")
        normalized.append(
            {
                "id": call.required_string("id"),
                "type": "function",
                "function": {"name": function.required_string("name"), "arguments": _decoded(arguments)},
            }
        )
    return normalized


def _decoded(arguments: str) -> JSON | str:
    """A JSON-object argument string as a dict; anything else (models emit bad JSON) stays a string."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return value if isinstance(value, dict) else arguments


def _tools(fields: _Fields) -> list[JSON] | None:
    tools = fields.array("tools")
    if tools is None:
        return None
    if not 1 <= len(tools) <= MAX_TOOLS:
        message = f"Invalid 'tools': expected an array of 1 to {MAX_TOOLS} tools, got {len(tools)}."
        raise invalid_request(message, param="tools")
    normalized: list[JSON] = []
    names: set[str] = set()
    for i, item in enumerate(tools):
        tool = _Fields(item, f"tools[{i}]")
        if tool.required_string("type") != "function":
            raise unsupported(f"Unsupported '{tool.path('type')}': expected 'function'.", param=tool.path("type"))
        function = tool.required_nested("function")
        name = function.required_string("name")
        if not _TOOL_NAME.fullmatch(name):
            raise _range_error(function.path("name"), "1 to 64 characters of a-z, A-Z, 0-9, _ or -", name)
        if name in names:
            raise invalid_request(
                f"Invalid '{function.path('name')}': duplicate tool {name!r}.", param=function.path("name")
            )
        names.add(name)
        spec: JSON = {"name": name}
        description = function.string("description")
        if description is not None:
            spec["description"] = description
        parameters = function.nested("parameters")
        if parameters is not None:
            spec["parameters"] = function.raw("parameters")
        strict = function.boolean("strict")
        if strict is not None:
            spec["strict"] = strict
        normalized.append({"type": "function", "function": spec})
    return normalized


def _tool_choice(fields: _Fields, tools: list[JSON] | None) -> ToolChoice:
    value = fields.raw("tool_choice")
    if value is None:
        return "auto" if tools else "none"
    if isinstance(value, str):
        if value not in TOOL_CHOICE_MODES:
            raise _range_error("tool_choice", f"one of {', '.join(TOOL_CHOICE_MODES)} or an object", value)
        if value != "none" and tools is None:
            raise invalid_request(f"Invalid 'tool_choice': {value!r} requires 'tools'.", param="tool_choice")
        return value
    if not isinstance(value, dict):
        raise _type_error("tool_choice", "a string or an object", value)
    choice = _Fields(value, "tool_choice")
    if choice.required_string("type") != "function":
        raise unsupported("Unsupported 'tool_choice.type': expected 'function'.", param="tool_choice.type")
    function = choice.required_nested("function")
    name = function.required_string("name")
    declared = [tool["function"]["name"] for tool in tools or []]
    if name not in declared:
        message = f"Invalid 'tool_choice.function.name': no tool named {name!r} is declared in 'tools'."
        raise invalid_request(message, param="tool_choice.function.name")
    return {"type": "function", "function": {"name": name}}


def _prompt(fields: _Fields) -> str | list[int]:
    prompt = fields.present("prompt")
    path = "prompt"
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt, path = prompt[0], "prompt[0]"
    if isinstance(prompt, str | list) and not prompt:
        raise invalid_request(f"Invalid '{path}': the prompt must not be empty.", param=path)
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list):
        raise _type_error(path, "a string or an array of token ids", prompt)
    if all(isinstance(entry, str | list) for entry in prompt):
        raise unsupported(f"Unsupported '{path}': batched prompts are not supported; send one per request.", param=path)
    for i, token_id in enumerate(prompt):
        if not _is_integer(token_id) or token_id < 0:
            raise _range_error(f"{path}[{i}]", "a non-negative integer token id", token_id)
    return list(prompt)


# ---------------------------------------------------------------- responses


def chat_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def openai_finish_reason(engine_reason: str | None, *, has_tool_calls: bool = False) -> str | None:
    """OpenAI's reason for the engine's: ``length`` stays, tool calls win, anything else ends as ``stop``."""
    if engine_reason is None:
        return None
    if has_tool_calls:
        return "tool_calls"
    return "length" if engine_reason == "length" else "stop"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, kv_store_tokens: int = 0) -> JSON:
    """OpenAI's usage object. ``prompt_tokens_details.kv_store_tokens`` (rayturn's own) counts the
    cached tokens whose KV came from the KV store rather than the serving replica's device."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens, "kv_store_tokens": kv_store_tokens},
    }


def assistant_output(
    text: str, request: ChatRequest, *, id_factory: Callable[[], str] = random_tool_call_id
) -> ParsedToolCalls:
    """A finished completion's text split into content and tool calls, as the request allows."""
    if request.prompt_tools is None:
        return ParsedToolCalls(content=text, tool_calls=())
    parsed = parse_tool_calls(text, id_factory=id_factory)
    if request.parallel_tool_calls:
        return parsed
    return ParsedToolCalls(content=parsed.content, tool_calls=parsed.tool_calls[:1])


def chat_logprobs(logprobs: Sequence[TokenLogprob], token_text: TokenText) -> list[JSON]:
    """``logprobs.content`` of a chat choice: one entry per generated token."""
    return [
        {
            **_chat_token(entry.token_id, entry.logprob, token_text),
            "top_logprobs": [_chat_token(token_id, logprob, token_text) for token_id, logprob in entry.top],
        }
        for entry in logprobs
    ]


def _chat_token(token_id: int, logprob: float, token_text: TokenText) -> JSON:
    text = token_text(token_id)
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def completion_logprobs(logprobs: Sequence[TokenLogprob], token_text: TokenText, *, text_offset: int = 0) -> JSON:
    """``logprobs`` of a completion choice; offsets count characters from the start of the completion."""
    tokens = [token_text(entry.token_id) for entry in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [_finite(entry.logprob) for entry in logprobs],
        "top_logprobs": [
            {token_text(token_id): _finite(logprob) for token_id, logprob in entry.top} for entry in logprobs
        ],
        "text_offset": offsets,
    }


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def chat_choice(
    index: int,
    *,
    content: str | None,
    tool_calls: Sequence[ToolCall] = (),
    finish_reason: str | None,
    logprobs: list[JSON] | None = None,
) -> JSON:
    """One choice of a chat completion; ``finish_reason`` is the engine's."""
    message: JSON = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = [call.to_openai() for call in tool_calls]
    return {
        "index": index,
        "message": message,
        "logprobs": None if logprobs is None else {"content": logprobs},
        "finish_reason": openai_finish_reason(finish_reason, has_tool_calls=bool(tool_calls)),
    }


def chat_completion(*, response_id: str, model: str, created: int, choices: Sequence[JSON], usage: JSON) -> JSON:
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": list(choices),
        "usage": usage,
    }


def completion_choice(index: int, *, text: str, finish_reason: str | None, logprobs: JSON | None = None) -> JSON:
    """One choice of a completion, or of a completion chunk while ``finish_reason`` is None."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": openai_finish_reason(finish_reason)}


def completion(*, response_id: str, model: str, created: int, choices: Sequence[JSON], usage: JSON) -> JSON:
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": list(choices),
        "usage": usage,
    }


def chat_chunk_choice(
    index: int, *, delta: JSON, finish_reason: str | None = None, logprobs: list[JSON] | None = None
) -> JSON:
    """One choice of a chat chunk; ``finish_reason`` is already OpenAI's (see ``openai_finish_reason``)."""
    return {
        "index": index,
        "delta": delta,
        "logprobs": None if logprobs is None else {"content": logprobs},
        "finish_reason": finish_reason,
    }


def chat_chunk(
    *, response_id: str, model: str, created: int, choices: Sequence[JSON], include_usage: bool = False
) -> JSON:
    """A ``chat.completion.chunk``; with ``include_usage`` it carries ``usage: null`` as OpenAI's do."""
    return _chunk("chat.completion.chunk", response_id, model, created, list(choices), include_usage)


def chat_usage_chunk(*, response_id: str, model: str, created: int, usage: JSON) -> JSON:
    """The last chunk of a stream with ``include_usage``: no choices, the whole request's usage."""
    chunk = _chunk("chat.completion.chunk", response_id, model, created, [], False)
    return {**chunk, "usage": usage}


def completion_chunk(
    *, response_id: str, model: str, created: int, choices: Sequence[JSON], include_usage: bool = False
) -> JSON:
    """A streamed completion chunk; OpenAI gives it the ``text_completion`` object type too."""
    return _chunk("text_completion", response_id, model, created, list(choices), include_usage)


def completion_usage_chunk(*, response_id: str, model: str, created: int, usage: JSON) -> JSON:
    chunk = _chunk("text_completion", response_id, model, created, [], False)
    return {**chunk, "usage": usage}


def _chunk(object_type: str, response_id: str, model: str, created: int, choices: list[JSON], null_usage: bool) -> JSON:
    chunk: JSON = {"id": response_id, "object": object_type, "created": created, "model": model, "choices": choices}
    if null_usage:
        chunk["usage"] = None
    return chunk


def sse(data: JSON) -> str:
    """One server-sent event carrying ``data`` as compact JSON."""
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def models_list(served_model: str, created: int) -> JSON:
    """The body of ``GET /v1/models``."""
    return {
        "object": "list",
        "data": [{"id": served_model, "object": "model", "created": created, "owned_by": OWNED_BY}],
    }


# ---------------------------------------------------------------- streaming


class ChatStreamState:
    """Turns one choice's text deltas into chat chunk choices, pulling out tool calls.

    Without tools every delta passes straight through. With tools, text that
    may belong to a ``<tool_call>`` block is held back until the block is
    decided the way ``parse_tool_calls`` decides it on the whole text, so the
    stream yields the same tool calls and the same (stripped) content::

                 text without "<tool_call>"  -> emitted (a trailing partial tag is held)
        PROSE ----------------------------------------------------------+
          |  "<tool_call>" seen                                         |
          v                                                             |
        IN_BLOCK  -- JSON object + "</tool_call>" -> tool call emitted -> PROSE
          |       -- anything else               -> the tag goes out as prose -> PROSE
          |       -- JSON or closing tag incomplete -> wait for more text
          v finish()
        FINISHED (what is still held is decided as final text; finish_reason sent)

    Content is stripped at both ends, as ``parse_tool_calls`` strips it:
    leading whitespace is dropped and trailing whitespace waits for the next
    non-space text. Logprob entries given with a delta go out with the next
    chunk this choice emits.
    """

    __slots__ = (
        "_content_started",
        "_decode_failed_len",
        "_held",
        "_id_factory",
        "_index",
        "_parallel_tool_calls",
        "_parse_tools",
        "_pending_logprobs",
        "_role_sent",
        "_tool_calls",
        "_trailing_whitespace",
    )

    def __init__(
        self,
        index: int,
        *,
        parse_tools: bool,
        parallel_tool_calls: bool = True,
        id_factory: Callable[[], str] = random_tool_call_id,
    ) -> None:
        self._index = index
        self._parse_tools = parse_tools
        self._parallel_tool_calls = parallel_tool_calls
        self._id_factory = id_factory
        self._held = ""
        self._trailing_whitespace = ""
        self._content_started = False
        # Length of ``_held`` when the JSON payload last failed to decode; an
        # object can only complete once a later "}" arrives.
        self._decode_failed_len: int | None = None
        self._role_sent = False
        self._tool_calls: list[ToolCall] = []
        self._pending_logprobs: list[JSON] | None = None

    @classmethod
    def for_request(
        cls, request: ChatRequest, index: int, *, id_factory: Callable[[], str] = random_tool_call_id
    ) -> ChatStreamState:
        return cls(
            index,
            parse_tools=request.prompt_tools is not None,
            parallel_tool_calls=request.parallel_tool_calls,
            id_factory=id_factory,
        )

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        return tuple(self._tool_calls)

    def start(self) -> JSON:
        """The opening choice, ``{"role": "assistant", "content": ""}``, sent before any text."""
        self._role_sent = True
        return chat_chunk_choice(self._index, delta={"role": "assistant", "content": ""})

    def push(self, text: str, logprobs: Sequence[JSON] | None = None) -> JSON | None:
        """The chunk choice for a text delta, or None when nothing can be sent yet."""
        self._hold_logprobs(logprobs)
        if not self._parse_tools:
            return self._choice(text, [], None)
        self._held += text
        content, calls = self._scan(final=False)
        return self._choice(content, calls, None)

    def finish(self, engine_finish_reason: str, logprobs: Sequence[JSON] | None = None) -> JSON:
        """The final chunk choice: whatever was held, then ``finish_reason``."""
        self._hold_logprobs(logprobs)
        content, calls = self._scan(final=True) if self._parse_tools else ("", [])
        reason = openai_finish_reason(engine_finish_reason, has_tool_calls=bool(self._tool_calls))
        choice = self._choice(content, calls, reason)
        assert choice is not None
        return choice

    def _hold_logprobs(self, logprobs: Sequence[JSON] | None) -> None:
        if logprobs is not None:
            self._pending_logprobs = (self._pending_logprobs or []) + list(logprobs)

    def _choice(self, content: str, calls: list[JSON], reason: str | None) -> JSON | None:
        if not content and not calls and reason is None:
            return None
        delta: JSON = {}
        if not self._role_sent:
            delta["role"] = "assistant"
            self._role_sent = True
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        logprobs, self._pending_logprobs = self._pending_logprobs, None
        return chat_chunk_choice(self._index, delta=delta, finish_reason=reason, logprobs=logprobs)

    def _scan(self, *, final: bool) -> tuple[str, list[JSON]]:
        """Decide as much of the held text as possible: the content to send and new tool-call deltas."""
        prose: list[str] = []
        calls: list[JSON] = []
        while (start_char := self._held.find(TOOL_CALL_START)) != -1:
            prose.append(self._take(start_char))
            block_end_char = self._block_end(final=final)
            if block_end_char is None:
                break
            call = None if block_end_char == _NOT_A_BLOCK else self._tool_call(self._held[:block_end_char])
            if call is None:
                # Not a block after all: the tag is prose and scanning resumes after it, as in parse_tool_calls.
                prose.append(self._take(len(TOOL_CALL_START)))
                continue
            self._take(block_end_char)
            delta = self._record(call)
            if delta is not None:
                calls.append(delta)
        else:
            keep_chars = 0 if final else _partial_tag_len(self._held)
            prose.append(self._take(len(self._held) - keep_chars))
        return self._strip("".join(prose), final=final), calls

    def _take(self, num_chars: int) -> str:
        taken, self._held = self._held[:num_chars], self._held[num_chars:]
        if num_chars:
            self._decode_failed_len = None
        return taken

    def _block_end(self, *, final: bool) -> int | None:
        """Where the block opening the held text ends, ``_NOT_A_BLOCK``, or None while undecided."""
        held = self._held
        json_start_char = _skip_whitespace(held, len(TOOL_CALL_START))
        if json_start_char == len(held):
            return _NOT_A_BLOCK if final else None
        if held[json_start_char] != "{":
            return _NOT_A_BLOCK
        if not final and self._decode_failed_len is not None and "}" not in held[self._decode_failed_len :]:
            return None
        try:
            _, json_end_char = _JSON_DECODER.raw_decode(held, json_start_char)
        except json.JSONDecodeError:
            if final:
                return _NOT_A_BLOCK
            self._decode_failed_len = len(held)
            return None
        close_char = _skip_whitespace(held, json_end_char)
        if held.startswith(TOOL_CALL_END, close_char):
            return close_char + len(TOOL_CALL_END)
        return None if not final and TOOL_CALL_END.startswith(held[close_char:]) else _NOT_A_BLOCK

    def _tool_call(self, block: str) -> ToolCall | None:
        """The call a complete ``<tool_call>...</tool_call>`` block holds, or None if its payload is not a call."""
        parsed = parse_tool_calls(block, id_factory=lambda: "")
        if parsed.content is not None or len(parsed.tool_calls) != 1:
            return None
        return replace(parsed.tool_calls[0], id=self._id_factory())

    def _record(self, call: ToolCall) -> JSON | None:
        """The tool-call delta for ``call``; None when it is a surplus call under ``parallel_tool_calls=false``."""
        if self._tool_calls and not self._parallel_tool_calls:
            return None
        self._tool_calls.append(call)
        return {"index": len(self._tool_calls) - 1, **call.to_openai()}

    def _strip(self, text: str, *, final: bool) -> str:
        if not self._content_started:
            text = text.lstrip()
        text = self._trailing_whitespace + text
        body = text.rstrip()
        self._trailing_whitespace = "" if final else text[len(body) :]
        self._content_started = self._content_started or bool(body)
        return body


def _skip_whitespace(text: str, position_char: int) -> int:
    while position_char < len(text) and text[position_char].isspace():
        position_char += 1
    return position_char


def _partial_tag_len(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``."""
    for length in range(min(len(text), len(TOOL_CALL_START) - 1), 0, -1):
        if TOOL_CALL_START.startswith(text[-length:]):
            return length
    return 0

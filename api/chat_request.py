"""``/v1/chat/completions`` request bodies, validated into ``ChatRequest`` (fields: ``protocol``)."""

from __future__ import annotations

import re

from rayturn.engine.chat_template import RESERVED_VARIABLES
from rayturn.engine.sampling_params import MAX_LOGPROBS

from .errors import invalid_request, unsupported
from .json_fields import Fields, body_fields, json_in_text, range_error, type_error
from .priority import body_priority
from .protocol import (
    JSON,
    ChatRequest,
    SamplingSpec,
    ToolChoice,
    model_field,
    prompt_cache_points,
    sampling_spec,
    stream_usage,
)
from .sampling_fields import reject_unsupported
from .tenants import body_cache_salt

MAX_TOOLS = 128
# ``chat_template_kwargs`` names the server sets: the template's own variables and functions, the rendering's
# switches (vLLM refuses ``chat_template`` and ``tokenize`` there too).
RESERVED_KWARGS = RESERVED_VARIABLES | {"continue_final_message", "chat_template", "tokenize"}
# OpenAI's reasoning efforts (vLLM's ``reasoning_effort`` takes these and "max").
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CHOICE_MODES = ("none", "auto", "required")
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def parse_chat_request(body: object, served_model: str) -> ChatRequest:
    fields = body_fields(body)
    model = model_field(fields, served_model)
    messages = chat_messages(fields)
    tools = chat_tools(fields)
    tool_choice = chat_tool_choice(fields, tools)
    _reject_unsupported_chat_fields(fields)
    logprobs = fields.boolean("logprobs") or False
    top_logprobs = fields.integer("top_logprobs", minimum=0, maximum=MAX_LOGPROBS)
    if top_logprobs is not None and not logprobs:
        raise invalid_request("Invalid 'top_logprobs': requires 'logprobs' to be true.", param="top_logprobs")
    max_tokens = fields.integer("max_tokens", minimum=1)
    max_completion_tokens = fields.integer("max_completion_tokens", minimum=1)
    stream = fields.boolean("stream") or False
    include_usage, continuous_usage = stream_usage(fields, stream)
    parallel_tool_calls = fields.boolean("parallel_tool_calls")
    sampling = sampling_spec(
        fields,
        max_tokens=max_tokens if max_completion_tokens is None else max_completion_tokens,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
    response_format = _response_format(fields)
    one_guide(sampling.guide_param, response_format, tools, tool_choice)
    unfiltered_guide(sampling, response_format, tools, tool_choice)
    return ChatRequest(
        model=model,
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        user=fields.string("user"),
        parallel_tool_calls=True if parallel_tool_calls is None else parallel_tool_calls,
        cache_points=prompt_cache_points(fields, len(messages)),
        prompt_cache_key=fields.string("prompt_cache_key"),
        return_tokens_as_token_ids=fields.boolean("return_tokens_as_token_ids") or False,
        return_token_ids=fields.boolean("return_token_ids") or False,
        response_format=response_format,
        priority=body_priority(fields),
        continue_final_message=_continue_final_message(fields, messages),
        template_kwargs=with_reasoning_effort(chat_template_kwargs(fields), reasoning_effort(fields)),
        include_reasoning=fields.boolean("include_reasoning") is not False,
        cache_salt=body_cache_salt(fields),
    )


def _response_format(fields: Fields) -> JSON | None:
    """``response_format``: None for text; ``{"type": "json_object"}``; or ``{"type": "json_schema",
    "json_schema": {"name", "schema", ...}}`` (a missing schema is any JSON object, as OpenAI's)."""
    form = fields.nested("response_format")
    if form is None:
        return None
    format_type = form.required_string("type")
    if format_type == "text":
        return None
    if format_type == "json_object":
        return {"type": "json_object"}
    if format_type != "json_schema":
        raise range_error(form.path("type"), "one of text, json_object, json_schema", format_type)
    spec = form.required_nested("json_schema")
    json_schema: JSON = {"name": spec.required_string("name")}
    schema = spec.nested("schema")
    json_schema["schema"] = {"type": "object"} if schema is None else spec.raw("schema")
    strict = spec.boolean("strict")
    if strict is not None:
        json_schema["strict"] = strict
    return {"type": "json_schema", "json_schema": json_schema}


def one_guide(
    param: str | None,
    response_format: JSON | None,
    tools: list[JSON] | None,
    choice: ToolChoice,
    format_param: str = "response_format",
) -> None:
    """A call has one guide: vLLM's structured outputs (named by ``param``) go with neither a ``response_format``
    (the API's ``format_param``) nor a forced tool call (``tool_choice`` "required" or a named function)."""
    if param is None:
        return
    if response_format is not None:
        message = f"Cannot set both '{param}' and '{format_param}': ask for one output format."
        raise invalid_request(message, param=param)
    if tools and (choice == "required" or isinstance(choice, dict)):
        message = f"Cannot set '{param}' with a forced 'tool_choice': the answer is either a tool call or the format."
        raise invalid_request(message, param=param)


def unfiltered_guide(
    sampling: SamplingSpec,
    response_format: JSON | None,
    tools: list[JSON] | None,
    choice: ToolChoice,
    prefix: str = "",
    format_param: str = "response_format",
) -> None:
    """A guided answer (structured outputs, a ``response_format``, a forced tool call) takes neither vLLM's
    ``allowed_token_ids`` nor ``bad_words`` (under ``prefix``: gRPC's ``sampling.``): where the format's next token
    is one they forbid, no token is left that both allow, and the answer could neither go on nor keep its form.
    ``format_param``: the field that holds the format (the Responses API's ``text.format``)."""
    forced = bool(tools) and (choice == "required" or isinstance(choice, dict))
    guide = sampling.guide_param or (format_param if response_format else None) or ("tool_choice" if forced else None)
    filters = {"allowed_token_ids": sampling.allowed_token_ids is not None, "bad_words": bool(sampling.bad_words)}
    for name in (name for name, used in filters.items() if used and guide is not None):
        message = f"Cannot set '{prefix}{name}' with '{guide}': the answer's format decides which tokens follow."
        raise invalid_request(message, param=f"{prefix}{name}")


# Chat fields (OpenAI's and vLLM's) this server does not honour, with the value that means "not used".
UNSUPPORTED_CHAT_FIELDS: dict[str, object] = {
    "audio": None,
    "prediction": None,
    "web_search_options": None,
    "chat_template": None,
    "documents": None,
    "mm_processor_kwargs": None,
    "echo": False,
    "add_special_tokens": False,
    "prompt_logprobs": None,
}


def _continue_final_message(fields: Fields, messages: list[JSON]) -> bool:
    """vLLM's ``continue_final_message`` (with ``add_generation_prompt`` false): the answer goes on from the final
    assistant message's text instead of starting a new turn."""
    continues = fields.boolean("continue_final_message") or False
    generation_prompt = fields.boolean("add_generation_prompt")
    if continues and generation_prompt is not False:
        message = "Cannot set both 'continue_final_message' and 'add_generation_prompt' to true."
        raise invalid_request(message, param="continue_final_message")
    if generation_prompt is False and not continues:
        message = "Unsupported 'add_generation_prompt': false is supported only with 'continue_final_message': true."
        raise unsupported(message, param="add_generation_prompt")
    if continues:
        check_open_final_message(messages)
    return continues


def check_open_final_message(messages: list[JSON]) -> None:
    """A prompt left open in its final message (``continue_final_message``) needs an assistant's text there."""
    final = messages[-1]
    content = final.get("content")
    if final["role"] != "assistant" or not isinstance(content, str) or not content.strip():
        message = "Invalid 'continue_final_message': the final message must be an assistant message with text."
        raise invalid_request(message, param="continue_final_message")


def chat_template_kwargs(fields: Fields, key: str = "chat_template_kwargs") -> JSON | None:
    """vLLM's ``chat_template_kwargs`` (the object at ``key``): variables the chat template reads (Qwen3's
    ``enable_thinking``). Names the request's own fields set, and the template environment's globals, are refused:
    they would change what those fields say, or hide a function the template calls."""
    kwargs = fields.nested(key)
    if kwargs is None:
        return None
    for name in kwargs.names():
        if name in RESERVED_KWARGS:
            message = f"Invalid '{kwargs.path(name)}': the server sets '{name}' itself"
            hint = f"; use the field '{name}'." if name in ("tools", "add_generation_prompt") else "."
            raise invalid_request(message + hint, param=kwargs.path(name))
    return dict(fields.raw(key)) or None


def with_reasoning_effort(kwargs: JSON | None, effort: str | None) -> JSON | None:
    """The template variables with a reasoning effort the request named (chat's ``reasoning_effort``, Responses'
    ``reasoning.effort``), as vLLM passes it: ``reasoning_effort`` (GPT-OSS templates write it into the system
    turn) over any the kwargs name, and ``enable_thinking`` (false for "none") unless the kwargs name one."""
    if effort is None:
        return kwargs
    return {"enable_thinking": effort != "none", **(kwargs or {}), "reasoning_effort": effort}


def reasoning_effort(fields: Fields, key: str = "reasoning_effort") -> str | None:
    effort = fields.string(key)
    if effort is not None and effort not in REASONING_EFFORTS:
        raise range_error(fields.path(key), f"one of {', '.join(REASONING_EFFORTS)}", effort)
    return effort


def _reject_unsupported_chat_fields(fields: Fields) -> None:
    for legacy, replacement in (("functions", "tools"), ("function_call", "tool_choice")):
        if fields.raw(legacy) is not None:
            raise unsupported(f"Unsupported '{legacy}': use '{replacement}' instead.", param=legacy)
    reject_unsupported(fields, UNSUPPORTED_CHAT_FIELDS, " for chat")


def chat_messages(fields: Fields) -> list[JSON]:
    messages = fields.present("messages")
    if not isinstance(messages, list):
        raise type_error("messages", "an array", messages)
    if not messages:
        raise invalid_request("Invalid 'messages': expected a non-empty array.", param="messages")
    return [_message(Fields(item, f"messages[{i}]")) for i, item in enumerate(messages)]


def _message(fields: Fields) -> JSON:
    role = fields.required_string("role")
    if role not in MESSAGE_ROLES:
        raise range_error(fields.path("role"), f"one of {', '.join(MESSAGE_ROLES)}", role)
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
    # An earlier answer's reasoning, sent back as this server gives it (``reasoning``, vLLM's field) or as the
    # older ``reasoning_content``: the chat template sees it as ``reasoning_content``.
    reasoning = None
    if role == "assistant":
        reasoning = fields.string("reasoning")
        reasoning = fields.string("reasoning_content") if reasoning is None else reasoning
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


def _content(fields: Fields, *, required: bool) -> str | None:
    parts = fields.present("content") if required else fields.raw("content")
    if parts is None or isinstance(parts, str):
        return parts
    path = fields.path("content")
    if not isinstance(parts, list):
        raise type_error(path, "a string or an array of content parts", parts)
    texts = []
    for i, part in enumerate(parts):
        part_fields = Fields(part, f"{path}[{i}]")
        part_type = part_fields.required_string("type")
        if part_type != "text":
            message = f"Unsupported '{part_fields.path('type')}': only 'text' content parts are supported, "
            raise unsupported(message + f"got {part_type!r}.", param=part_fields.path("type"))
        texts.append(part_fields.required_string("text"))
    return "\n".join(texts)


def _assistant_tool_calls(fields: Fields) -> list[JSON] | None:
    calls = fields.array("tool_calls")
    if not calls:
        return None
    normalized = []
    for i, item in enumerate(calls):
        call = Fields(item, fields.path(f"tool_calls[{i}]"))
        call_type = call.string("type")
        if call_type not in (None, "function"):
            raise unsupported(f"Unsupported '{call.path('type')}': expected 'function'.", param=call.path("type"))
        function = call.required_nested("function")
        arguments = function.required_string("arguments")
        normalized.append(
            {
                "id": call.required_string("id"),
                "type": "function",
                "function": {"name": function.required_string("name"), "arguments": decoded_arguments(arguments)},
            }
        )
    return normalized


def decoded_arguments(arguments: str) -> JSON | str:
    """A JSON-object argument string as a dict; anything else (models emit bad JSON) stays a string."""
    value = json_in_text(arguments)
    return value if isinstance(value, dict) else arguments


def chat_tools(fields: Fields) -> list[JSON] | None:
    tools = fields.array("tools")
    if tools is None:
        return None
    if not 1 <= len(tools) <= MAX_TOOLS:
        message = f"Invalid 'tools': expected an array of 1 to {MAX_TOOLS} tools, got {len(tools)}."
        raise invalid_request(message, param="tools")
    normalized: list[JSON] = []
    names: set[str] = set()
    for i, item in enumerate(tools):
        tool = Fields(item, f"tools[{i}]")
        if tool.required_string("type") != "function":
            raise unsupported(f"Unsupported '{tool.path('type')}': expected 'function'.", param=tool.path("type"))
        function = tool.required_nested("function")
        name = function.required_string("name")
        if not TOOL_NAME.fullmatch(name):
            raise range_error(function.path("name"), "1 to 64 characters of a-z, A-Z, 0-9, _ or -", name)
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


def chat_tool_choice(fields: Fields, tools: list[JSON] | None) -> ToolChoice:
    value = fields.raw("tool_choice")
    if value is None:
        return "auto" if tools else "none"
    if isinstance(value, str):
        if value not in TOOL_CHOICE_MODES:
            raise range_error("tool_choice", f"one of {', '.join(TOOL_CHOICE_MODES)} or an object", value)
        if value != "none" and tools is None:
            raise invalid_request(f"Invalid 'tool_choice': {value!r} requires 'tools'.", param="tool_choice")
        return value
    if not isinstance(value, dict):
        raise type_error("tool_choice", "a string or an object", value)
    choice = Fields(value, "tool_choice")
    if choice.required_string("type") != "function":
        raise unsupported("Unsupported 'tool_choice.type': expected 'function'.", param="tool_choice.type")
    function = choice.required_nested("function")
    name = function.required_string("name")
    declared = [tool["function"]["name"] for tool in tools or []]
    if name not in declared:
        message = f"Invalid 'tool_choice.function.name': no tool named {name!r} is declared in 'tools'."
        raise invalid_request(message, param="tool_choice.function.name")
    return {"type": "function", "function": {"name": name}}

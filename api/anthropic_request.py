"""Anthropic Messages request bodies (``POST /v1/messages``), validated into the chat form every API shares.

A Messages request becomes a ``ChatRequest`` (``protocol``): the chat template,
the tool-call split, constrained decoding and usage are the same for every
door. What changes on the way:

* ``system`` (a string or text blocks) becomes the first chat message; a
  ``role: "system"`` message inside ``messages`` (Claude Code sends one) stays
  where it stands;
* content blocks: ``text`` joins into the message's text; an assistant's
  ``tool_use`` blocks become its ``tool_calls`` (``input`` as the arguments
  object); a user's ``tool_result`` blocks become ``tool`` messages before the
  user's own text (``is_error`` results start with ``Error: ``);
  an assistant's ``thinking`` blocks (the reasoning this server returned)
  become its ``reasoning_content``, which the chat template places where the
  model expects it (or leaves out); ``redacted_thinking`` blocks are accepted
  and left out of the prompt; ``image`` and ``document`` blocks are refused (the
  model reads text only);
* ``tools`` (``input_schema``) become function tools; ``tool_choice`` ``auto``
  / ``any`` / ``tool`` / ``none`` become ``auto`` / ``required`` / a named
  function / ``none`` (``disable_parallel_tool_use`` keeps one call);
* ``cache_control`` breakpoints (``ttl`` ``5m``, the default, or ``1h``)
  become ``CachePoint`` s: retention contracts for the prompt up to the end of
  the message holding the breakpoint (tools and ``system`` count as the first
  message); a top-level ``cache_control`` covers the whole prompt;
* ``temperature``, ``top_p`` and ``top_k`` are honoured when sent (today's
  SDKs no longer send them; the default is Anthropic's, temperature 1);
* ``max_tokens`` is required; one larger than the room left in the context is
  capped to that room, not refused (the answer then ends with
  ``stop_reason: "max_tokens"``);
* ``metadata.user_id`` names the session when no session header does: Claude
  Code sends a JSON string holding ``session_id`` (older releases
  ``user_..._session_<id>``); any other value is the session id itself.

``output_config.format`` (structured outputs, a JSON schema) is enforced by
constrained decoding, as the chat API's ``response_format``. rayturn's
``priority`` (the call's class, sent through the SDK's ``extra_body``) is read
as every API reads it (``rayturn.api.priority``), and so are vLLM's ``cache_salt`` and ``speculative``
(``rayturn.api.protocol``). ``output_config.effort`` and ``thinking: {"type": "disabled"}`` (effort "none")
reach the chat template as vLLM passes them (``chat_request.with_reasoning_effort``);
``thinking: {"type": "enabled", "budget_tokens": N}`` bounds the reasoning (``thinking_fields``).

Accepted and ignored: the rest of ``thinking``, ``context_management``,
``service_tier``, ``container``, ``mcp_servers`` and unknown top-level fields,
as well as every ``anthropic-beta`` header: the features they turn on either do
not apply to an open-weight model or are rayturn's to decide (caching).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .chat_request import chat_template_kwargs, with_reasoning_effort
from .errors import invalid_request, unsupported
from .json_fields import Fields, body_fields, json_in_text, range_error, type_error
from .priority import body_priority
from .protocol import JSON, CachePoint, ChatRequest, SamplingSpec, ToolChoice, model_field
from .tenants import body_cache_salt
from .thinking_fields import ANTHROPIC_BUDGET, anthropic_budget, anthropic_effort

MAX_TOOLS = 128
MAX_STOP_SEQUENCES = 64
CACHE_TTLS_S = {"5m": 300.0, "1h": 3600.0}
ROLES = ("user", "assistant", "system")
TOOL_CHOICES = ("auto", "any", "tool", "none")
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,128}")
_NO_VISION = ("image", "document")
_SKIPPED_BLOCKS = ("thinking", "redacted_thinking")
_LEGACY_SESSION = re.compile(r"_session_([0-9A-Za-z-]+)$")


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    """A validated Messages request: its chat form and what only the Messages API says."""

    chat: ChatRequest
    max_tokens: int
    # The session ``metadata.user_id`` names, when it names one.
    session_id: str | None = None


def parse_messages_request(body: object, served_model: str) -> MessagesRequest:
    fields = body_fields(body)
    model = model_field(fields, served_model)
    max_tokens = fields.integer("max_tokens", minimum=1)
    if max_tokens is None:
        raise invalid_request("Missing required parameter: 'max_tokens'.", param="max_tokens")
    builder = _Conversation()
    builder.system(fields)
    tools = _tools(fields, builder)
    messages = fields.present("messages")
    if not isinstance(messages, list):
        raise type_error("messages", "an array", messages)
    if not messages:
        raise invalid_request("Invalid 'messages': expected a non-empty array.", param="messages")
    for i, item in enumerate(messages):
        builder.message(Fields(item, f"messages[{i}]"))
    prefilled = _prefilled(builder.messages[-1], f"messages[{len(messages) - 1}]")
    # A top-level ``cache_control`` (automatic caching) puts the breakpoint after the last message.
    builder.whole_prompt(_cache_ttl(fields))
    tool_choice, parallel = _tool_choice(fields, tools)
    temperature = fields.number("temperature", minimum=0.0, maximum=1.0)
    top_p = fields.number("top_p", minimum=0.0, maximum=1.0, exclusive_minimum=True)
    top_k = fields.integer("top_k", minimum=0)
    budget = anthropic_budget(fields)
    sampling = SamplingSpec(
        max_tokens=None,  # capped to the room left once the prompt is known (``max_tokens`` above)
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=top_k or 0,
        stop=_stop_sequences(fields),
        speculative=fields.boolean("speculative"),
        thinking_token_budget=budget,
        thinking_budget_param=None if budget is None else ANTHROPIC_BUDGET,
    )
    chat = ChatRequest(
        model=model,
        messages=builder.messages,
        tools=tools,
        tool_choice=tool_choice,
        sampling=sampling,
        stream=fields.boolean("stream") or False,
        parallel_tool_calls=parallel,
        cache_points=tuple(builder.cache_points),
        response_format=_output_format(fields),
        priority=body_priority(fields),
        continue_final_message=prefilled,
        template_kwargs=with_reasoning_effort(chat_template_kwargs(fields), anthropic_effort(fields)),
        cache_salt=body_cache_salt(fields),
    )
    return MessagesRequest(chat=chat, max_tokens=max_tokens, session_id=_metadata_session(fields))


def _prefilled(final: JSON, path: str) -> bool:
    """Whether the answer continues the final message: an assistant text (a prefill) is continued, not answered
    in a new turn; like Anthropic's API, one that ends in whitespace is refused."""
    content = final.get("content")
    if final["role"] != "assistant" or final.get("tool_calls") or not isinstance(content, str) or not content:
        return False
    if content != content.rstrip():
        message = f"Invalid '{path}.content': the final assistant content cannot end with trailing whitespace."
        raise invalid_request(message, param=f"{path}.content")
    return True


def parse_count_tokens_request(body: object, served_model: str) -> ChatRequest:
    """``/v1/messages/count_tokens``: the same body less ``max_tokens`` and sampling."""
    fields = body_fields(body)
    if fields.raw("max_tokens") is None and isinstance(body, dict):
        body = {**body, "max_tokens": 1}
    return parse_messages_request(body, served_model).chat


class _Conversation:
    """Chat messages built from Anthropic's system, tools and messages, with their cache breakpoints."""

    __slots__ = ("cache_points", "has_system", "messages")

    def __init__(self) -> None:
        self.messages: list[JSON] = []
        self.cache_points: list[CachePoint] = []
        self.has_system = False

    def system(self, fields: Fields) -> None:
        value = fields.raw("system")
        if value is None:
            return
        text, ttls = _text_blocks(value, "system")
        self.messages.append({"role": "system", "content": text})
        self.has_system = True
        self._points(ttls)

    def tool_breakpoint(self, ttl_s: float) -> None:
        # Tools render inside the system turn: a breakpoint there keeps at least what precedes the first message.
        self.cache_points.append(CachePoint(num_messages=1 if self.has_system else 0, ttl_s=ttl_s))

    def message(self, fields: Fields) -> None:
        role = fields.required_string("role")
        if role not in ROLES:
            raise range_error(fields.path("role"), f"one of {', '.join(ROLES)}", role)
        content = fields.present("content")
        path = fields.path("content")
        if role == "system":
            text, ttls = _text_blocks(content, path)
            self.messages.append({"role": "system", "content": text})
            self._points(ttls)
            return
        if isinstance(content, str):
            self.messages.append({"role": role, "content": content})
            return
        if not isinstance(content, list):
            raise type_error(path, "a string or an array of content blocks", content)
        if role == "assistant":
            self._assistant(content, path)
        else:
            self._user(content, path)

    def _assistant(self, blocks: list[object], path: str) -> None:
        texts: list[str] = []
        thoughts: list[str] = []
        calls: list[JSON] = []
        ttls: list[float] = []
        for i, item in enumerate(blocks):
            block = Fields(item, f"{path}[{i}]")
            kind = _block_type(block, ("text", "tool_use", *_SKIPPED_BLOCKS))
            ttls.extend(_cache_ttl(block))
            if kind == "text":
                texts.append(block.required_string("text"))
            elif kind == "thinking":
                thoughts.append(block.string("thinking") or "")
            elif kind == "tool_use":
                arguments = block.present("input")
                if not isinstance(arguments, dict):
                    raise type_error(block.path("input"), "an object", arguments)
                function = {"name": block.required_string("name"), "arguments": arguments}
                calls.append({"id": block.required_string("id"), "type": "function", "function": function})
        message: JSON = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
        if calls:
            message["tool_calls"] = calls
        if any(thoughts):
            message["reasoning_content"] = "\n\n".join(thought for thought in thoughts if thought)
        self.messages.append(message)
        self._points(ttls)

    def _user(self, blocks: list[object], path: str) -> None:
        texts: list[str] = []
        ttls: list[float] = []
        for i, item in enumerate(blocks):
            block = Fields(item, f"{path}[{i}]")
            kind = _block_type(block, ("text", "tool_result"))
            ttls.extend(_cache_ttl(block))
            if kind == "text":
                texts.append(block.required_string("text"))
                continue
            result = block.raw("content")
            output, nested_ttls = ("", []) if result is None else _text_blocks(result, block.path("content"))
            ttls.extend(nested_ttls)
            if block.boolean("is_error"):
                output = f"Error: {output}"
            self.messages.append(
                {"role": "tool", "tool_call_id": block.required_string("tool_use_id"), "content": output}
            )
        if texts or not blocks:
            self.messages.append({"role": "user", "content": "\n".join(texts)})
        self._points(ttls)

    def whole_prompt(self, ttls: list[float]) -> None:
        self._points(ttls)

    def _points(self, ttls: list[float]) -> None:
        if ttls:
            self.cache_points.append(CachePoint(num_messages=len(self.messages), ttl_s=max(ttls)))


def _block_type(block: Fields, allowed: tuple[str, ...]) -> str:
    kind = block.required_string("type")
    if kind in _NO_VISION:
        message = f"Unsupported '{block.path('type')}': {kind!r} blocks are not supported; this model reads text only."
        raise unsupported(message, param=block.path("type"))
    if kind not in allowed:
        raise range_error(block.path("type"), f"one of {', '.join(allowed)}", kind)
    return kind


def _text_blocks(value: object, path: str) -> tuple[str, list[float]]:
    """The text of a string or of an array of text blocks, and the blocks' cache TTLs."""
    if isinstance(value, str):
        return value, []
    if not isinstance(value, list):
        raise type_error(path, "a string or an array of text blocks", value)
    texts: list[str] = []
    ttls: list[float] = []
    for i, item in enumerate(value):
        block = Fields(item, f"{path}[{i}]")
        _block_type(block, ("text",))
        texts.append(block.required_string("text"))
        ttls.extend(_cache_ttl(block))
    return "\n".join(texts), ttls


def _cache_ttl(block: Fields) -> list[float]:
    control = block.nested("cache_control")
    if control is None:
        return []
    kind = control.required_string("type")
    if kind != "ephemeral":
        raise range_error(control.path("type"), "'ephemeral'", kind)
    ttl = control.string("ttl") or "5m"
    if ttl not in CACHE_TTLS_S:
        raise range_error(control.path("ttl"), f"one of {', '.join(CACHE_TTLS_S)}", ttl)
    return [CACHE_TTLS_S[ttl]]


def _tools(fields: Fields, builder: _Conversation) -> list[JSON] | None:
    tools = fields.array("tools")
    if not tools:
        return None
    if len(tools) > MAX_TOOLS:
        message = f"Invalid 'tools': expected at most {MAX_TOOLS} tools, got {len(tools)}."
        raise invalid_request(message, param="tools")
    normalized: list[JSON] = []
    names: set[str] = set()
    for i, item in enumerate(tools):
        tool = Fields(item, f"tools[{i}]")
        kind = tool.string("type")
        if kind not in (None, "custom"):
            message = f"Unsupported '{tool.path('type')}': only client tools (with 'input_schema') are supported, "
            raise unsupported(message + f"got {kind!r}.", param=tool.path("type"))
        name = tool.required_string("name")
        if not _TOOL_NAME.fullmatch(name):
            raise range_error(tool.path("name"), "1 to 128 characters of a-z, A-Z, 0-9, _ or -", name)
        if name in names:
            raise invalid_request(f"Invalid '{tool.path('name')}': duplicate tool {name!r}.", param=tool.path("name"))
        names.add(name)
        schema = tool.present("input_schema")
        if not isinstance(schema, dict):
            raise type_error(tool.path("input_schema"), "an object", schema)
        spec: JSON = {"name": name, "parameters": schema}
        description = tool.string("description")
        if description is not None:
            spec["description"] = description
        normalized.append({"type": "function", "function": spec})
        for ttl_s in _cache_ttl(tool):
            builder.tool_breakpoint(ttl_s)
    return normalized


def _tool_choice(fields: Fields, tools: list[JSON] | None) -> tuple[ToolChoice, bool]:
    choice = fields.nested("tool_choice")
    if choice is None:
        return ("auto" if tools else "none"), True
    kind = choice.required_string("type")
    if kind not in TOOL_CHOICES:
        raise range_error(choice.path("type"), f"one of {', '.join(TOOL_CHOICES)}", kind)
    parallel = not (choice.boolean("disable_parallel_tool_use") or False)
    if kind == "none":
        return "none", parallel
    if tools is None:
        if kind == "auto":
            return "none", parallel
        raise invalid_request(f"Invalid 'tool_choice': {kind!r} requires 'tools'.", param="tool_choice")
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    name = choice.required_string("name")
    if name not in [tool["function"]["name"] for tool in tools]:
        message = f"Invalid 'tool_choice.name': no tool named {name!r} is declared in 'tools'."
        raise invalid_request(message, param="tool_choice.name")
    return {"type": "function", "function": {"name": name}}, parallel


def _stop_sequences(fields: Fields) -> tuple[str, ...]:
    values = fields.array("stop_sequences") or []
    if len(values) > MAX_STOP_SEQUENCES:
        message = f"Invalid 'stop_sequences': expected at most {MAX_STOP_SEQUENCES} sequences, got {len(values)}."
        raise invalid_request(message, param="stop_sequences")
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise type_error(f"stop_sequences[{i}]", "a string", value)
        if not value:
            raise invalid_request(f"Invalid 'stop_sequences[{i}]': must not be empty.", param=f"stop_sequences[{i}]")
    return tuple(values)


def _metadata_session(fields: Fields) -> str | None:
    metadata = fields.nested("metadata")
    if metadata is None:
        return None
    user_id = metadata.string("user_id")
    if not user_id:
        return None
    value = json_in_text(user_id)
    if isinstance(value, dict) and isinstance(value.get("session_id"), str) and value["session_id"]:
        return str(value["session_id"])
    legacy = _LEGACY_SESSION.search(user_id)
    return legacy.group(1) if legacy else user_id


def _output_format(fields: Fields) -> JSON | None:
    """``output_config.format`` (structured outputs): a JSON schema the answer must follow, enforced as the chat
    API's ``response_format`` (``effort``: ``thinking_fields.anthropic_effort``)."""
    config = fields.nested("output_config")
    form = None if config is None else config.nested("format")
    if form is None:
        return None
    kind = form.required_string("type")
    if kind != "json_schema":
        raise range_error(form.path("type"), "'json_schema'", kind)
    schema = form.present("schema")
    if not isinstance(schema, dict):
        raise type_error(form.path("schema"), "an object", schema)
    # ``schema_param``: where the schema sits in this API, for a schema error (``rayturn.api.guides``).
    json_schema = {"name": "output", "schema": schema}
    return {"type": "json_schema", "json_schema": json_schema, "schema_param": form.path("schema")}

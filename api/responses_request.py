"""``POST /v1/responses`` request bodies, validated into ``ResponsesRequest`` (the input items: ``responses_input``).

A Responses call is served as a chat call: ``ResponsesRequest.chat`` builds
the ``ChatRequest`` that the chat template, the decode replica's tool-call
split and the usage counts already serve, with the instructions first, then
the stored conversation a ``previous_response_id`` continues, then this
call's input.

Honoured: ``model``, ``input``, ``instructions``, function ``tools`` (the flat
``{"type": "function", "name", ...}`` shape), ``tool_choice``,
``parallel_tool_calls``, ``max_output_tokens``, ``temperature``, ``top_p``,
``text.format`` (``text``, ``json_object``, ``json_schema``), ``include``'s
``message.output_text.logprobs`` (each answer token's log probability on
the message's ``output_text``, with ``top_logprobs`` alternatives: as
OpenAI, ``top_logprobs`` alone returns none), ``store``,
``previous_response_id``, ``stream``, ``background`` (with ``store``: the
response is computed after the call is answered, ``background_responses``),
vLLM's ``structured_outputs`` (not with a ``text.format`` other than text:
``structured_outputs``), ``prompt_cache_key`` (the session id when no
session header names one), ``prompt_cache_retention`` (how long
the whole prompt stays cached, as the chat API keeps it) and rayturn's
``priority`` (the call's class: ``rayturn.api.priority``), ``speculative``
(speculative decoding for the call: ``rayturn.api.protocol``), vLLM's
``cache_salt`` (``rayturn.api.tenants``) and ``truncation`` (``"auto"``: the
oldest messages of a conversation too long for the context are dropped until
it fits, ``rayturn.api.truncation``; ``"disabled"``, the default: a 400).
vLLM's sampling extensions as its Responses API takes them (``top_k``,
``seed``, ``stop``, ``repetition_penalty``, ``logit_bias``, ``ignore_eos``,
``skip_special_tokens``, ``include_stop_str_in_output``) and the rest the
chat API reads (``protocol.vllm_sampling``: the penalties, ``min_p``,
``min_tokens``, ``stop_token_ids``, ``allowed_token_ids``, ``bad_words``),
each as the chat API honours it; ``n`` other than 1, ``vllm_xargs`` and
``kv_transfer_params`` are a 400.

Accepted, type-checked and echoed without effect: ``reasoning`` and
``include``'s other values (reasoning items come from the model's format, not from these; a value
OpenAI's ``include`` does not take is a 400),
``metadata``, ``service_tier``, ``user`` (the
session id when neither a header nor ``prompt_cache_key`` names one),
``safety_identifier``, ``text.verbosity``, ``stream_options``. The built-in
tools Codex adds on its own (``IGNORED_TOOL_TYPES``) are dropped, so the
model sees only the function tools; any other tool type, a hosted
``tool_choice``, ``conversation`` and ``prompt`` are a 400.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rayturn.engine.sampling_params import MAX_LOGPROBS

from .chat_request import (
    MAX_TOOLS,
    TOOL_CHOICE_MODES,
    TOOL_NAME,
    chat_template_kwargs,
    one_guide,
    reasoning_effort,
    unfiltered_guide,
    with_reasoning_effort,
)
from .errors import invalid_request, unsupported
from .json_fields import Fields, body_fields, range_error, type_error
from .priority import body_priority
from .protocol import (
    JSON,
    MAX_TEMPERATURE,
    PROMPT_CACHE_RETENTION_S,
    CachePoint,
    ChatRequest,
    SamplingSpec,
    ToolChoice,
    model_field,
    vllm_sampling,
)
from .responses_bodies import INCLUDABLE, OUTPUT_LOGPROBS
from .responses_input import input_messages
from .structured_outputs import LEGACY_FIELDS, STRUCTURED_OUTPUTS, structured_output_form
from .tenants import body_cache_salt
from .truncation import MESSAGES, Truncation

# Built-in tools Codex may list next to its function tools: web search, its shell and freeform
# (grammar) tools, image generation, and deferred tool search with the namespaces it loads from.
# Nothing here runs them, and failing every Codex call for them would serve no one.
IGNORED_TOOL_TYPES = (
    "web_search",
    "web_search_preview",
    "local_shell",
    "custom",
    "image_generation",
    "tool_search",
    "namespace",
)
TRUNCATION_MODES = ("auto", "disabled")
VERBOSITIES = ("low", "medium", "high")
# The fields of ``POST /v1/responses/input_tokens`` (OpenAI's, and the template's variables): a prompt's makings.
INPUT_TOKEN_FIELDS: tuple[str, ...] = ("model", "input", "instructions", "previous_response_id", "tools", "tool_choice")
INPUT_TOKEN_FIELDS += ("parallel_tool_calls", "reasoning", "text", "truncation", "conversation", "chat_template_kwargs")
_UNSUPPORTED_FIELDS = {
    "conversation": "conversations are not supported; send 'previous_response_id' or the whole input",
    "prompt": "prompt templates are not supported; send 'input' and 'instructions'",
    **{name: "the Responses API takes 'structured_outputs' (or 'text.format')" for name in LEGACY_FIELDS},
}


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A validated Responses request: this call's input as chat messages, and the settings its answer echoes.

    ``tools`` and ``tool_choice`` are in the chat API's shapes (what the chat
    template and ``ChatRequest.prompt_tools`` take); ``echo`` holds the
    request's settings in Responses' own shapes, as the response body repeats them.
    """

    model: str
    input_messages: tuple[JSON, ...]
    instructions: str | None
    tools: list[JSON] | None
    tool_choice: ToolChoice
    sampling: SamplingSpec
    parallel_tool_calls: bool = True
    response_format: JSON | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    retention_s: float | None = None
    prompt_cache_key: str | None = None
    user: str | None = None
    echo: JSON = field(default_factory=dict)
    # The class the body's ``priority`` names (``rayturn.api.priority``); None: it names none.
    priority: str | None = None
    # vLLM's ``cache_salt`` (``rayturn.api.tenants``); None: the tenant's prefixes.
    cache_salt: str | None = None
    # vLLM's ``chat_template_kwargs`` (``chat_request.chat_template_kwargs``).
    template_kwargs: JSON | None = None

    @property
    def body_session(self) -> tuple[str | None, str]:
        """The body's session id and the field it came from (``HTTPServing.start``'s ``body_session``)."""
        return (self.prompt_cache_key, "prompt_cache_key") if self.prompt_cache_key else (self.user, "user")

    def chat(self, history: Sequence[JSON] = ()) -> ChatRequest:
        """The chat call: the instructions as a system message, then ``history``, then this call's input."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages = [*system, *history, *self.input_messages]
        cache_points = (CachePoint(len(messages), self.retention_s),) if self.retention_s else ()
        return ChatRequest(
            model=self.model,
            messages=messages,
            tools=self.tools,
            tool_choice=self.tool_choice,
            sampling=self.sampling,
            stream=self.stream,
            user=self.user,
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=self.response_format,
            cache_points=cache_points,
            prompt_cache_key=self.prompt_cache_key,
            priority=self.priority,
            template_kwargs=self.template_kwargs,
            cache_salt=self.cache_salt,
        )


def parse_input_tokens_request(body: object, served_model: str) -> ResponsesRequest:
    """A ``POST /v1/responses/input_tokens`` body: the fields that make a response's prompt, read as a response's
    (the others are left out: nothing is generated or stored)."""
    kept = {key: value for key, value in body.items() if key in INPUT_TOKEN_FIELDS} if isinstance(body, dict) else body
    return parse_responses_request(kept, served_model)


def parse_responses_request(body: object, served_model: str) -> ResponsesRequest:
    fields = body_fields(body)
    model = model_field(fields, served_model)
    _reject_unsupported(fields)
    messages = input_messages(fields)
    instructions = fields.string("instructions")
    tools, echoed_tools = _tools(fields)
    tool_choice, echoed_choice = _tool_choice(fields, tools)
    response_format, text = _text(fields)
    # vLLM's structured outputs, as its Responses API takes them (the form only: ``guided_*`` are refused).
    form = fields.nested(STRUCTURED_OUTPUTS)
    guide, guide_param = structured_output_form(form) if form is not None else (None, None)
    one_guide(guide_param, response_format, tools, tool_choice, format_param="text.format")
    temperature = fields.number("temperature", minimum=0.0, maximum=MAX_TEMPERATURE)
    top_p = fields.number("top_p", minimum=0.0, maximum=1.0, exclusive_minimum=True)
    max_output_tokens = fields.integer("max_output_tokens", minimum=1)
    parallel = fields.boolean("parallel_tool_calls")
    parallel_tool_calls = True if parallel is None else parallel
    store = fields.boolean("store") is not False  # OpenAI stores unless told not to
    background = fields.boolean("background") or False
    if background and not store:
        message = "Invalid 'background': a background response is read back from the store; send 'store': true."
        raise invalid_request(message, param="background")
    previous_response_id = fields.string("previous_response_id")
    retention = _choice(fields, "prompt_cache_retention", tuple(PROMPT_CACHE_RETENTION_S))
    prompt_cache_key = fields.string("prompt_cache_key")
    user = fields.string("user")
    truncation = _choice(fields, "truncation", TRUNCATION_MODES) or "disabled"
    top_logprobs = fields.integer("top_logprobs", minimum=0, maximum=MAX_LOGPROBS)
    logprobs = OUTPUT_LOGPROBS in _include(fields)
    n = fields.integer("n", minimum=1)
    if n is not None and n != 1:
        message = f"Invalid 'n': a response has one answer, got {n}; send n > 1 to /v1/chat/completions."
        raise invalid_request(message, param="n")
    sampling = SamplingSpec(
        max_tokens=max_output_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        **vllm_sampling(fields, max_output_tokens, "max_output_tokens"),
        logprobs=logprobs,
        top_logprobs=(top_logprobs or 0) if logprobs else None,
        speculative=fields.boolean("speculative"),
        guide=guide,
        guide_param=guide_param,
        # OpenAI's "auto": the oldest input items go until the conversation fits (``truncation.fit_messages``).
        truncation=Truncation(side=MESSAGES, param="truncation") if truncation == "auto" else None,
    )
    unfiltered_guide(sampling, response_format, tools, tool_choice, format_param="text.format")
    reasoning = _reasoning(fields)
    echo: JSON = {
        "instructions": instructions,
        "tools": echoed_tools,
        "tool_choice": echoed_choice,
        "parallel_tool_calls": parallel_tool_calls,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_output_tokens": max_output_tokens,
        "previous_response_id": previous_response_id,
        "store": store,
        "text": text,
        "reasoning": reasoning,
        "truncation": truncation,
        "metadata": _metadata(fields),
        "prompt_cache_key": prompt_cache_key,
        "prompt_cache_retention": retention,
        "safety_identifier": fields.string("safety_identifier"),
        "user": user,
        # Every call is served the one way there is, whatever tier it asked for.
        "service_tier": "default" if fields.string("service_tier") is not None else None,
        "background": background,
        "top_logprobs": top_logprobs,
    }
    return ResponsesRequest(
        model=model,
        input_messages=tuple(messages),
        instructions=instructions,
        tools=tools,
        tool_choice=tool_choice,
        sampling=sampling,
        parallel_tool_calls=parallel_tool_calls,
        response_format=response_format,
        stream=fields.boolean("stream") or False,
        store=store,
        background=background,
        previous_response_id=previous_response_id,
        retention_s=None if retention is None else PROMPT_CACHE_RETENTION_S[retention],
        prompt_cache_key=prompt_cache_key,
        user=user,
        echo=echo,
        priority=body_priority(fields),
        template_kwargs=with_reasoning_effort(chat_template_kwargs(fields), reasoning["effort"]),
        cache_salt=body_cache_salt(fields),
    )


def _reject_unsupported(fields: Fields) -> None:
    for name, reason in _UNSUPPORTED_FIELDS.items():
        if fields.raw(name) is not None:
            raise unsupported(f"Unsupported '{name}': {reason}.", param=name)


def _tools(fields: Fields) -> tuple[list[JSON] | None, list[JSON]]:
    """The function tools in the chat API's shape, and as the response echoes them; ignored built-ins dropped."""
    tools = fields.array("tools") or []
    if len(tools) > MAX_TOOLS:
        message = f"Invalid 'tools': expected at most {MAX_TOOLS} tools, got {len(tools)}."
        raise invalid_request(message, param="tools")
    chat_tools: list[JSON] = []
    echoed: list[JSON] = []
    for i, item in enumerate(tools):
        tool = Fields(item, f"tools[{i}]")
        tool_type = tool.required_string("type")
        if tool_type in IGNORED_TOOL_TYPES:
            continue
        if tool_type != "function":
            param = tool.path("type")
            message = f"Unsupported '{param}': {tool_type!r} tools are not supported; only function tools are."
            raise unsupported(message, param=param)
        name = tool.required_string("name")
        if not TOOL_NAME.fullmatch(name):
            raise range_error(tool.path("name"), "1 to 64 characters of a-z, A-Z, 0-9, _ or -", name)
        if any(spec["function"]["name"] == name for spec in chat_tools):
            raise invalid_request(f"Invalid '{tool.path('name')}': duplicate tool {name!r}.", param=tool.path("name"))
        spec: JSON = {"name": name}
        description = tool.string("description")
        if description is not None:
            spec["description"] = description
        if tool.nested("parameters") is not None:
            spec["parameters"] = tool.raw("parameters")
        strict = tool.boolean("strict")
        if strict is not None:
            spec["strict"] = strict
        chat_tools.append({"type": "function", "function": spec})
        echoed.append({"type": "function", "description": None, "parameters": None, "strict": None, **spec})
    return chat_tools or None, echoed


def _tool_choice(fields: Fields, tools: list[JSON] | None) -> tuple[ToolChoice, str | JSON]:
    """The choice in the chat API's shape (``none`` when no tools are left), and as the response echoes it."""
    value = fields.raw("tool_choice")
    if value is None:
        return ("auto" if tools else "none"), "auto"
    if isinstance(value, str):
        if value not in TOOL_CHOICE_MODES:
            raise range_error("tool_choice", f"one of {', '.join(TOOL_CHOICE_MODES)} or an object", value)
        if value == "required" and not tools:
            raise invalid_request("Invalid 'tool_choice': 'required' requires function 'tools'.", param="tool_choice")
        return (value if tools else "none"), value
    if not isinstance(value, dict):
        raise type_error("tool_choice", "a string or an object", value)
    choice = Fields(value, "tool_choice")
    choice_type = choice.required_string("type")
    if choice_type != "function":
        message = f"Unsupported 'tool_choice.type': only 'function' choices are supported, got {choice_type!r}."
        raise unsupported(message, param="tool_choice.type")
    name = choice.required_string("name")
    if name not in [tool["function"]["name"] for tool in tools or []]:
        message = f"Invalid 'tool_choice.name': no function tool named {name!r} is declared in 'tools'."
        raise invalid_request(message, param="tool_choice.name")
    return {"type": "function", "function": {"name": name}}, {"type": "function", "name": name}


def _text(fields: Fields) -> tuple[JSON | None, JSON]:
    """``text.format`` as the chat API's ``response_format`` (None for plain text), and ``text`` as echoed."""
    text = fields.nested("text")
    echoed: JSON = {"format": {"type": "text"}}
    if text is None:
        return None, echoed
    verbosity = _choice(text, "verbosity", VERBOSITIES)
    if verbosity is not None:
        echoed["verbosity"] = verbosity
    form = text.nested("format")
    form_type = "text" if form is None else form.required_string("type")
    if form is None or form_type == "text":
        return None, echoed
    if form_type == "json_object":
        echoed["format"] = {"type": "json_object"}
        return {"type": "json_object"}, echoed
    if form_type != "json_schema":
        expected = "one of text, json_object, json_schema"
        raise range_error(form.path("type"), expected, form_type)
    json_schema: JSON = {"name": form.required_string("name")}
    form.required_nested("schema")
    json_schema["schema"] = form.raw("schema")
    for key, value in (("description", form.string("description")), ("strict", form.boolean("strict"))):
        if value is not None:
            json_schema[key] = value
    echoed["format"] = {"type": "json_schema", **json_schema}
    # ``schema_param``: where the schema sits in this API, for a schema error (``rayturn.api.guides``).
    return {"type": "json_schema", "json_schema": json_schema, "schema_param": form.path("schema")}, echoed


def _reasoning(fields: Fields) -> JSON:
    """``reasoning``: its ``effort`` reaches the chat template (``chat_request.with_reasoning_effort``)."""
    reasoning = fields.nested("reasoning")
    if reasoning is None:
        return {"effort": None, "summary": None}
    return {"effort": reasoning_effort(reasoning, "effort"), "summary": reasoning.string("summary")}


def _metadata(fields: Fields) -> dict[str, str]:
    metadata = fields.nested("metadata")
    if metadata is None:
        return {}
    value: dict[str, Any] = fields.raw("metadata")
    for key, entry in value.items():
        if not isinstance(entry, str):
            raise type_error(metadata.path(key), "a string", entry)
    return dict(value)


def _include(fields: Fields) -> list[str]:
    include = fields.array("include") or []
    for i, entry in enumerate(include):
        if not isinstance(entry, str):
            raise type_error(f"include[{i}]", "a string", entry)
        if entry not in INCLUDABLE:
            raise range_error(f"include[{i}]", f"one of {', '.join(INCLUDABLE)}", entry)
    return include


def _choice(fields: Fields, key: str, allowed: Sequence[str]) -> str | None:
    value = fields.string(key)
    if value is not None and value not in allowed:
        raise range_error(fields.path(key), f"one of {', '.join(allowed)}", value)
    return value

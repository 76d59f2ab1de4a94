"""``GenerateRequest`` messages, validated into the forms every API shares (fields: ``protos/rayturn.proto``).

A request whose input is ``messages`` becomes a ``ChatRequest`` (``protocol``),
the chat form the OpenAI, Anthropic and Responses APIs build too, so the chat
template, forced tool calls (``guides``) and the tool-call split are one code
path for every door. What changes on the way:

* ``tools`` become OpenAI function tools; ``parameters_json`` is parsed once,
  here, into the schema object the template renders and guides enforce;
* ``tool_choice`` ``MODE_AUTO`` / ``MODE_NONE`` / ``MODE_REQUIRED`` /
  ``function_name`` become ``auto`` / ``none`` / ``required`` / a named
  function; unset is ``auto`` with tools, ``none`` without;
* an assistant message's ``tool_calls`` take the chat form, their
  ``arguments`` decoded into an object when they hold one (as HTTP does);
  ``developer`` becomes ``system``.

``text`` and ``token_ids`` inputs become a ``RawPrompt``: no template, so no
tools. ``sampling.structured_output`` is read as the HTTP APIs read vLLM's
``structured_outputs`` (``structured_outputs``). Every error is a 400
(INVALID_ARGUMENT) whose message quotes the field's path in the proto
(``tools[1].parameters_json``, ``messages.messages[2].tool_call_id``,
``sampling.top_logprobs``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rayturn.engine.guided import Guide
from rayturn.engine.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from rayturn.protos import rayturn_pb2 as pb

from .chat_request import (
    MAX_TOOLS,
    MESSAGE_ROLES,
    TOOL_NAME,
    chat_template_kwargs,
    decoded_arguments,
    one_guide,
    unfiltered_guide,
)
from .errors import invalid_request
from .json_fields import Fields, json_object, range_error
from .protocol import JSON, MAX_N, ChatRequest, SamplingSpec, ToolChoice
from .sampling_fields import checked_bad_words
from .structured_outputs import CONSTRAINTS, structured_output_form
from .tenants import cache_salt_value
from .truncation import checked_truncation

_MODES = {
    pb.ToolChoice.MODE_AUTO: "auto",
    pb.ToolChoice.MODE_NONE: "none",
    pb.ToolChoice.MODE_REQUIRED: "required",
}


@dataclass(frozen=True, slots=True)
class RawPrompt:
    """A request whose prompt is raw text (tokenized by the server) or token ids (passed through)."""

    prompt: str | list[int]
    sampling: SamplingSpec
    cache_salt: str | None = None  # ``GenerateRequest.cache_salt`` (``rayturn.api.tenants``)

    @property
    def param(self) -> str:
        """The request field that holds the prompt, for errors."""
        return "text" if isinstance(self.prompt, str) else "token_ids"


def parse_generate_request(request: pb.GenerateRequest, served_model: str) -> ChatRequest | RawPrompt:
    """The request's shared form; a 400 naming the field when some field is bad."""
    if request.model and request.model != served_model:
        message = f"Invalid 'model': {request.model!r} is not served here; this cluster serves {served_model!r}."
        raise invalid_request(message, param="model")
    sampling = _sampling(request.sampling)
    cache_salt = cache_salt_value(request.cache_salt or None)  # empty: none, as every unset string field
    kind = request.WhichOneof("input")
    if kind != "messages":
        _chat_only(request)
        unfiltered_guide(sampling, None, None, "none", "sampling.")
    if kind == "text":
        if not request.text:
            raise invalid_request("Invalid 'text': the prompt must not be empty.", param="text")
        return RawPrompt(prompt=request.text, sampling=sampling, cache_salt=cache_salt)
    if kind == "token_ids":
        return RawPrompt(prompt=list(request.token_ids.ids), sampling=sampling, cache_salt=cache_salt)
    if kind is None:
        raise invalid_request("Invalid 'input': set one of text, token_ids, messages.", param="input")
    tools = _tools(request.tools)
    tool_choice = _tool_choice(request, tools)
    one_guide(sampling.guide_param, None, tools, tool_choice)
    unfiltered_guide(sampling, None, tools, tool_choice, "sampling.")
    return ChatRequest(
        model=served_model,
        messages=_messages(request.messages),
        tools=tools,
        tool_choice=tool_choice,
        sampling=sampling,
        stream=True,
        parallel_tool_calls=request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True,
        template_kwargs=_template_kwargs(request.chat_template_kwargs_json),
        cache_salt=cache_salt,
    )


def _template_kwargs(text: str) -> JSON | None:
    """``chat_template_kwargs_json``: JSON text of an object, read as HTTP reads ``chat_template_kwargs``."""
    if not text:
        return None
    param = "chat_template_kwargs_json"
    value = json_object(param, text, "JSON text of an object")
    return chat_template_kwargs(Fields({param: value}, ""), param)


def _chat_only(request: pb.GenerateRequest) -> None:
    """Tools and template variables reach the model through the chat template, which only ``messages`` input goes
    through."""
    for name, given in (
        ("tools", bool(request.tools)),
        ("tool_choice", request.HasField("tool_choice")),
        ("parallel_tool_calls", request.HasField("parallel_tool_calls")),
        ("chat_template_kwargs_json", bool(request.chat_template_kwargs_json)),
        ("sampling.thinking_token_budget", request.sampling.HasField("thinking_token_budget")),
    ):
        if given:
            message = f"Invalid '{name}': it needs 'messages' input (the chat template is what reads it)."
            raise invalid_request(message, param=name)


def _messages(conversation: pb.Messages) -> list[JSON]:
    if not conversation.messages:
        raise invalid_request("Invalid 'messages.messages': expected at least one message.", param="messages")
    return [_message(message, f"messages.messages[{i}]") for i, message in enumerate(conversation.messages)]


def _message(message: pb.ChatMessage, path: str) -> JSON:
    role = message.role
    if role not in MESSAGE_ROLES:
        raise range_error(f"{path}.role", f"one of {', '.join(MESSAGE_ROLES)}", role)
    if message.tool_calls and role != "assistant":
        raise invalid_request(f"Invalid '{path}.tool_calls': only assistant messages make tool calls.", param=path)
    chat: JSON = {"role": "system" if role == "developer" else role}
    if message.content or not message.tool_calls:
        chat["content"] = message.content
    if message.tool_calls:
        chat["tool_calls"] = [_tool_call(call, f"{path}.tool_calls[{i}]") for i, call in enumerate(message.tool_calls)]
    if message.name:
        chat["name"] = message.name
    if role == "tool":
        if not message.tool_call_id:
            message_text = f"Invalid '{path}.tool_call_id': a tool message names the tool call it answers."
            raise invalid_request(message_text, param=f"{path}.tool_call_id")
        chat["tool_call_id"] = message.tool_call_id
    return chat


def _tool_call(call: pb.ToolCall, path: str) -> JSON:
    for name, value in (("id", call.id), ("name", call.name)):
        if not value:
            raise invalid_request(f"Invalid '{path}.{name}': must not be empty.", param=f"{path}.{name}")
    function = {"name": call.name, "arguments": decoded_arguments(call.arguments)}
    return {"id": call.id, "type": "function", "function": function}


def _tools(declared: Sequence[pb.Tool]) -> list[JSON] | None:
    if not declared:
        return None
    if len(declared) > MAX_TOOLS:
        message = f"Invalid 'tools': expected at most {MAX_TOOLS} tools, got {len(declared)}."
        raise invalid_request(message, param="tools")
    normalized: list[JSON] = []
    names: set[str] = set()
    for i, tool in enumerate(declared):
        path = f"tools[{i}]"
        if not TOOL_NAME.fullmatch(tool.name):
            raise range_error(f"{path}.name", "1 to 64 characters of a-z, A-Z, 0-9, _ or -", tool.name)
        if tool.name in names:
            raise invalid_request(f"Invalid '{path}.name': duplicate tool {tool.name!r}.", param=f"{path}.name")
        names.add(tool.name)
        function: JSON = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        if tool.parameters_json:
            function["parameters"] = json_object(
                f"{path}.parameters_json", tool.parameters_json, "a JSON schema object"
            )
        normalized.append({"type": "function", "function": function})
    return normalized


def _tool_choice(request: pb.GenerateRequest, tools: list[JSON] | None) -> ToolChoice:
    choice = request.tool_choice
    form = choice.WhichOneof("choice") if request.HasField("tool_choice") else None
    if form == "function_name":
        declared = [tool["function"]["name"] for tool in tools or []]
        if choice.function_name not in declared:
            message = f"Invalid 'tool_choice.function_name': no tool named {choice.function_name!r} is in 'tools'."
            raise invalid_request(message, param="tool_choice.function_name")
        return {"type": "function", "function": {"name": choice.function_name}}
    mode = _MODES.get(choice.mode) if form == "mode" else None
    if form == "mode" and mode is None and choice.mode != pb.ToolChoice.MODE_UNSPECIFIED:
        raise range_error("tool_choice.mode", "one of MODE_AUTO, MODE_NONE, MODE_REQUIRED", choice.mode)
    if mode is None:
        return "auto" if tools else "none"
    if mode != "none" and tools is None:
        message = f"Invalid 'tool_choice.mode': {pb.ToolChoice.Mode.Name(choice.mode)} requires 'tools'."
        raise invalid_request(message, param="tool_choice.mode")
    return mode


def _sampling(options: pb.SamplingOptions) -> SamplingSpec:
    """Sampling as asked; every bound the engine would refuse is refused here, naming the proto field."""
    max_tokens = options.max_tokens if options.HasField("max_tokens") else None
    if max_tokens is not None and max_tokens < 1:
        raise range_error("sampling.max_tokens", "an integer >= 1", max_tokens)
    temperature = options.temperature if options.HasField("temperature") else 1.0
    if not (math.isfinite(temperature) and temperature >= 0):
        raise range_error("sampling.temperature", "a number >= 0", temperature)
    top_p = options.top_p if options.HasField("top_p") else 1.0
    if not 0 < top_p <= 1:
        raise range_error("sampling.top_p", "a number in (0, 1]", top_p)
    top_k = options.top_k if options.HasField("top_k") else 0
    if top_k < -1:
        raise range_error("sampling.top_k", "an integer >= -1 (-1: no limit)", top_k)
    if not 0 <= options.n <= MAX_N:
        raise range_error("sampling.n", f"an integer in [0, {MAX_N}] (0: 1)", options.n)
    if len(options.stop) > MAX_STOP_STRINGS:
        message = f"Invalid 'sampling.stop': expected at most {MAX_STOP_STRINGS} sequences, got {len(options.stop)}."
        raise invalid_request(message, param="sampling.stop")
    if len(options.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        count = len(options.stop_token_ids)
        message = f"Invalid 'sampling.stop_token_ids': expected at most {MAX_STOP_TOKEN_IDS} token ids, got {count}."
        raise invalid_request(message, param="sampling.stop_token_ids")
    for i, stop in enumerate(options.stop):
        if not stop:
            path = f"sampling.stop[{i}]"
            raise invalid_request(f"Invalid '{path}': stop sequences must not be empty.", param=path)
    for i, token_id in enumerate(options.stop_token_ids):
        if token_id < 0:
            raise range_error(f"sampling.stop_token_ids[{i}]", "a non-negative token id", token_id)
    if not 0 <= options.top_logprobs <= MAX_LOGPROBS:
        raise range_error("sampling.top_logprobs", f"an integer in [0, {MAX_LOGPROBS}]", options.top_logprobs)
    if options.top_logprobs and not options.logprobs:
        message = "Invalid 'sampling.top_logprobs': requires 'sampling.logprobs' to be true."
        raise invalid_request(message, param="sampling.top_logprobs")
    repetition_penalty = options.repetition_penalty if options.HasField("repetition_penalty") else 1.0
    if not (math.isfinite(repetition_penalty) and repetition_penalty > 0):
        raise range_error("sampling.repetition_penalty", "a number > 0", repetition_penalty)
    min_p = options.min_p if options.HasField("min_p") else 0.0
    if not 0 <= min_p <= 1:
        raise range_error("sampling.min_p", "a number in [0, 1]", min_p)
    penalties: dict[str, float] = {}
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(options, name) if options.HasField(name) else 0.0
        if not -MAX_PENALTY <= value <= MAX_PENALTY:  # NaN fails too
            raise range_error(f"sampling.{name}", f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]", value)
        penalties[name] = value
    if len(options.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
        count = len(options.logit_bias)
        message = f"Invalid 'sampling.logit_bias': expected at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {count}."
        raise invalid_request(message, param="sampling.logit_bias")
    for token_id, bias in options.logit_bias.items():
        if token_id < 0:
            raise range_error("sampling.logit_bias", "non-negative token ids as keys", token_id)
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            bounds = f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
            raise range_error(f"sampling.logit_bias[{token_id}]", f"a number in {bounds}", bias)
    if options.min_tokens < 0 or (max_tokens is not None and options.min_tokens > max_tokens):
        bound = f"in [0, {max_tokens}] (max_tokens)" if max_tokens is not None else ">= 0"
        raise range_error("sampling.min_tokens", f"an integer {bound}", options.min_tokens)
    guide, guide_param = _structured_output(options) or (None, None)
    budget = _thinking_budget(options)
    side = options.truncation_side or None  # empty: left
    keep = options.truncate_prompt_tokens if options.HasField("truncate_prompt_tokens") else None
    allowed = tuple(options.allowed_token_ids) or None
    if allowed is not None and len(allowed) > MAX_ALLOWED_TOKEN_IDS:
        raise range_error("sampling.allowed_token_ids", f"at most {MAX_ALLOWED_TOKEN_IDS} token ids", len(allowed))
    if allowed is not None and min(allowed) < 0:
        raise range_error("sampling.allowed_token_ids", "non-negative token ids", min(allowed))
    return SamplingSpec(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=options.seed if options.HasField("seed") else None,
        stop=tuple(options.stop),
        stop_token_ids=tuple(options.stop_token_ids),
        n=options.n or 1,
        logprobs=options.logprobs,
        top_logprobs=options.top_logprobs if options.logprobs else None,
        ignore_eos=options.ignore_eos,
        repetition_penalty=repetition_penalty,
        frequency_penalty=penalties["frequency_penalty"],
        presence_penalty=penalties["presence_penalty"],
        logit_bias=tuple(sorted(options.logit_bias.items())),
        min_p=min_p,
        min_tokens=options.min_tokens,
        speculative=options.speculative if options.HasField("speculative") else None,
        guide=guide,
        guide_param=guide_param,
        thinking_token_budget=budget,
        thinking_budget_param=None if budget is None else "thinking_token_budget",
        truncation=checked_truncation(keep, side, "sampling."),
        allowed_token_ids=allowed,
        bad_words=checked_bad_words(list(options.bad_words), "sampling.bad_words"),
    )


def _thinking_budget(options: pb.SamplingOptions) -> int | None:
    """``sampling.thinking_token_budget``, read as the HTTP field: >= 0, or -1 (as unset) for no bound."""
    budget = options.thinking_token_budget if options.HasField("thinking_token_budget") else -1
    if budget < -1:
        raise range_error("sampling.thinking_token_budget", "an integer >= 0, or -1 for no bound", budget)
    return None if budget == -1 else budget


def _structured_output(options: pb.SamplingOptions) -> tuple[Guide, str] | None:
    """``sampling.structured_output`` read as the HTTP APIs read ``structured_outputs`` (errors name its path)."""
    if not options.HasField("structured_output"):
        return None
    form, where = options.structured_output, "sampling.structured_output"
    kind = form.WhichOneof("constraint")
    if kind is None:
        raise invalid_request(f"Invalid '{where}': set one of {', '.join(CONSTRAINTS)}.", param=where)
    value = list(form.choice.values) if kind == "choice" else getattr(form, kind)
    closed = form.disable_additional_properties
    return structured_output_form(Fields({kind: value, "disable_additional_properties": closed}, where))

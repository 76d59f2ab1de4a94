"""The OpenAI HTTP API at its edge: request bodies in, response bodies out.

Everything here is pure: JSON-decoded bodies are validated into frozen
request objects, and engine results are turned into plain dicts in the exact
shapes of OpenAI's chat completions, completions and models endpoints. The
HTTP server owns transport, authentication and the engine; this module owns
the wire format.

Supported request fields (any other top-level field is ignored, since OpenAI
clients routinely send extras such as ``metadata`` or ``store``):

* chat completions and completions: ``model`` (missing or empty: the served
  model; the other APIs too),
  ``max_tokens``, ``temperature``, ``top_p``, ``n``, ``stop``, ``seed``,
  ``stream``, ``stream_options.include_usage`` (and vLLM's ``continuous_usage_stats``), ``user``;
  ``frequency_penalty``, ``presence_penalty`` (in [-2, 2]) and ``logit_bias``
  (token ids, as strings, to numbers in [-100, 100]; at most 1,024); vLLM's
  extensions ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
  ``stop_token_ids``, ``ignore_eos``, ``include_stop_str_in_output``,
  ``skip_special_tokens``, ``return_tokens_as_token_ids``, ``return_token_ids``,
  ``allowed_token_ids`` and ``bad_words`` (``sampling_fields``),
  ``truncate_prompt_tokens`` and ``truncation_side`` (``truncation``); vLLM's structured
  outputs (``structured_outputs``: ``json``, ``regex``, ``choice``, ``grammar``,
  ``json_object``; and the earlier ``guided_json``, ``guided_regex``,
  ``guided_choice``, ``guided_grammar``), enforced by constrained decoding
  (``structured_outputs``). vLLM's other extensions
  (``sampling_fields.UNSUPPORTED_AT_DEFAULT``: beam search, ``length_penalty``, ...)
  are refused unless they hold their "off" value.
* every API here (Anthropic Messages and Responses too): vLLM's
  ``cache_salt`` (the call's cached prefix is shared only with calls of its
  tenant that name the same salt: ``rayturn.api.tenants``), ``priority``, the
  call's class (a name, or vLLM's integer: ``rayturn.api.priority``), and
  ``speculative`` (a boolean: speculative decoding on or off for the call;
  absent or null: the server's ``model.speculative.enabled``). Every engine
  can draft (``rayturn.engine.speculative`` keeps no state that only an
  enabled server builds), so ``true`` works on a server whose default is off.
  The answer is the same either way; only its speed differs. Calls that
  cannot be verified exactly (``n`` > 1, a guide, a repetition, frequency or
  presence penalty, a logit bias) decode without drafts whatever they ask.
* ``/v1/chat/completions``: ``messages`` (text content only),
  ``max_completion_tokens`` (wins over ``max_tokens``), ``logprobs``,
  ``top_logprobs``, ``tools``, ``tool_choice`` (``required`` and a named
  function are enforced by constrained decoding), ``parallel_tool_calls``,
  ``response_format`` (``text``, ``json_object``, ``json_schema``: enforced
  too), ``prompt_cache_key`` (the session id) and ``prompt_cache_retention``
  (``in_memory``, ``24h``: a retention contract for the prompt).
* ``/v1/completions`` (``completion_request``): ``prompt`` (a string, a list
  of token ids, or a list of either), ``echo``, ``logprobs`` (an integer),
  ``prompt_logprobs``, ``suffix`` only empty, ``best_of`` only equal to ``n``.

Usage, in every API's own shape, carries rayturn's ``energy``: the call's
joules, their meter and its session's total (``rayturn.api.energy``); the
OpenAI-shaped ones also count the cached prompt tokens loaded from the KV
store (``kv_store_tokens``).

A supported field with a bad value is a 400 whose ``param`` is the field's
dotted path (``messages[2].content``) and whose message quotes that path; a
field this server recognises but cannot honour (images, penalties) is a 400
too, rather than being silently ignored.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rayturn.engine.guided import Guide
from rayturn.engine.sampling_params import MAX_PENALTY, SamplingParams

from .errors import context_length_exceeded, invalid_request, model_not_found
from .json_fields import INT64_MAX, INT64_MIN, Fields, range_error
from .sampling_fields import (
    allowed_token_ids,
    bad_word_ids,
    bad_words,
    logit_bias,
    reject_unsupported,
    stop_sequences,
    stop_token_ids,
)
from .structured_outputs import structured_output
from .truncation import Truncation, prompt_truncation

MAX_N = 16
MAX_TEMPERATURE = 2.0
MAX_REPETITION_PENALTY = 10.0
# Logits are divided by the temperature and by the repetition penalty; below this either one overflows them
# to infinity (a temperature of 1e-300 is valid JSON). A smaller temperature is greedy, as vLLM treats it; a
# smaller penalty acts as this one, whose effect is already total.
MIN_LOGIT_DIVISOR = 1e-5
_ENGINE_FIELD = re.compile(r"^SamplingParams\.(\w+) ")

JSON = dict[str, Any]
ToolChoice = str | JSON


# OpenAI's ``prompt_cache_retention`` values, as the seconds a prompt is kept cached: "in_memory" keeps it
# five to ten minutes there (rayturn: ten), "24h" a day.
PROMPT_CACHE_RETENTION_S = {"in_memory": 600.0, "24h": 86400.0}


def prompt_cache_points(fields: Fields, num_messages: int) -> tuple[CachePoint, ...]:
    """OpenAI's ``prompt_cache_retention``: a retention contract for the whole prompt."""
    retention = fields.string("prompt_cache_retention")
    if retention is None:
        return ()
    if retention not in PROMPT_CACHE_RETENTION_S:
        raise range_error("prompt_cache_retention", f"one of {', '.join(PROMPT_CACHE_RETENTION_S)}", retention)
    return (CachePoint(num_messages=num_messages, ttl_s=PROMPT_CACHE_RETENTION_S[retention]),)


@dataclass(frozen=True, slots=True)
class CachePoint:
    """A client's cache breakpoint: keep the prompt up to the end of ``messages[:num_messages]`` (the chat
    messages as the template sees them, tools included) cached for ``ttl_s`` seconds."""

    num_messages: int
    ttl_s: float


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
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # ``logit_bias`` as (token id, bias) pairs sorted by id.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's sampling extensions, honoured as vLLM does.
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    # The body's ``speculative``: speculative decoding on or off for this call; None: the server's default.
    speculative: bool | None = None
    # vLLM's structured outputs (``structured_outputs``, ``guided_*``): the guide, and the field that asked it.
    guide: Guide | None = None
    guide_param: str | None = None
    # The most tokens the answer's reasoning may take (vLLM's ``thinking_token_budget``, Anthropic's
    # ``thinking.budget_tokens``: ``api.thinking_fields``), and the field that set it; None: no bound.
    thinking_token_budget: int | None = None
    thinking_budget_param: str | None = None
    # vLLM's ``allowed_token_ids`` (None: every token) and ``bad_words`` (words; tokenized with the prompt).
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    # How to cut a prompt too long to keep whole (``rayturn.api.truncation``); None: it is refused.
    truncation: Truncation | None = None


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
    continuous_usage: bool = False  # vLLM's ``stream_options.continuous_usage_stats``: usage so far in every chunk
    user: str | None = None
    parallel_tool_calls: bool = True
    # ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {...}}``: the answer's required form.
    response_format: JSON | None = None
    # Prefixes the client asked to keep cached (Anthropic ``cache_control``, OpenAI ``prompt_cache_retention``).
    cache_points: tuple[CachePoint, ...] = ()
    # OpenAI's ``prompt_cache_key``: what groups calls that share a prefix; rayturn's session id for them.
    prompt_cache_key: str | None = None
    # vLLM's ``return_tokens_as_token_ids``: logprobs name tokens ``token_id:N``.
    return_tokens_as_token_ids: bool = False
    # vLLM's ``return_token_ids``: the answer carries the prompt's token ids and each choice's.
    return_token_ids: bool = False
    # The class the body's ``priority`` names (``rayturn.api.priority``); None: it names none.
    priority: str | None = None
    # The prompt ends inside the final (assistant) message, for the model to continue (Anthropic's prefill).
    continue_final_message: bool = False
    # vLLM's ``chat_template_kwargs``: more variables for the chat template (``enable_thinking``, ...).
    template_kwargs: JSON | None = None
    # vLLM's ``include_reasoning``: false leaves the reasoning the server split off out of a chat answer.
    include_reasoning: bool = True
    # vLLM's ``cache_salt``: the call's prefix is shared only with its tenant's calls naming the same salt.
    cache_salt: str | None = None

    @property
    def prompt_tools(self) -> list[JSON] | None:
        """The tools to show the model: none for ``tool_choice="none"``, only the named one for a named choice.

        ``"required"`` and a named choice are enforced: decoding is constrained to a call of these tools
        (``guides``).
        """
        return shown_tools(self.tools, self.tool_choice)


def shown_tools(tools: list[JSON] | None, tool_choice: ToolChoice) -> list[JSON] | None:
    """The tools a chat's prompt shows for its ``tool_choice`` (``ChatRequest.prompt_tools``)."""
    if tools is None or tool_choice == "none":
        return None
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        return [tool for tool in tools if tool["function"]["name"] == name]
    return tools


def to_sampling_params(
    spec: SamplingSpec,
    *,
    default_max_tokens: int,
    prompt_tokens: int,
    max_model_len: int,
    prompt_param: str = "messages",
    max_tokens_param: str = "max_tokens",
    vocab_size: int | None = None,
    encode: Callable[[str], list[int]] | None = None,
) -> SamplingParams:
    """Engine settings once the prompt length is known.

    Without ``max_tokens`` a request may fill the rest of the context, capped
    at ``default_max_tokens``. ``prompt_param`` is the field blamed when the
    prompt alone is too long (``"prompt"`` for completions), ``max_tokens_param``
    the one blamed when the answer would not fit (``"max_output_tokens"`` for Responses). Stop token ids the
    vocabulary (``vocab_size``, when given) lacks are refused here, not on the decode replica. ``encode`` (text to
    token ids, no special tokens) tokenizes ``bad_words``; without it a spec naming some is refused.
    """
    if spec.bad_words and encode is None:
        raise invalid_request("Invalid 'bad_words': this call cannot take them.", param="bad_words")
    if vocab_size is not None:
        named = {
            "stop_token_ids": spec.stop_token_ids,
            "logit_bias": [t for t, _ in spec.logit_bias],
            "allowed_token_ids": spec.allowed_token_ids or (),
        }
        for param, token_ids in named.items():
            bad = [t for t in token_ids if t >= vocab_size]
            if bad:
                message = f"Invalid '{param}': token ids out of vocabulary [0, {vocab_size}): {bad[:5]}."
                raise invalid_request(message, param=param)
    if prompt_tokens >= max_model_len:
        raise context_length_exceeded(prompt_tokens, max_model_len, param=prompt_param)
    room_tokens = max_model_len - prompt_tokens
    if spec.max_tokens is None:
        max_tokens = min(default_max_tokens, room_tokens)
    elif spec.max_tokens > room_tokens:
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + spec.max_tokens} tokens ({prompt_tokens} in the '{prompt_param}', "
            f"{spec.max_tokens} in '{max_tokens_param}'). Please reduce the length of the '{prompt_param}' or "
            f"'{max_tokens_param}'."
        )
        raise invalid_request(message, param=max_tokens_param, code="context_length_exceeded")
    else:
        max_tokens = spec.max_tokens
    temperature = 0.0 if 0 < spec.temperature < MIN_LOGIT_DIVISOR else spec.temperature
    penalty = spec.repetition_penalty
    repetition_penalty = MIN_LOGIT_DIVISOR if 0 < penalty < MIN_LOGIT_DIVISOR else penalty
    try:
        return SamplingParams(
            n=spec.n,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=spec.top_p,
            top_k=spec.top_k,
            seed=spec.seed,
            stop=spec.stop,
            stop_token_ids=spec.stop_token_ids,
            ignore_eos=spec.ignore_eos,
            logprobs=(spec.top_logprobs or 0) if spec.logprobs else None,
            repetition_penalty=repetition_penalty,
            frequency_penalty=spec.frequency_penalty,
            presence_penalty=spec.presence_penalty,
            logit_bias=spec.logit_bias,
            allowed_token_ids=spec.allowed_token_ids,
            bad_words=bad_word_ids(spec.bad_words, encode) if spec.bad_words and encode is not None else (),
            min_p=spec.min_p,
            min_tokens=spec.min_tokens,
            include_stop_str_in_output=spec.include_stop_str_in_output,
            skip_special_tokens=spec.skip_special_tokens,
            prompt_logprobs=spec.prompt_logprobs,
            speculative=spec.speculative,
            guide=spec.guide,
        )
    except ValueError as error:
        match = _ENGINE_FIELD.match(str(error))
        field_name = match.group(1) if match else None
        raise invalid_request(f"Invalid '{field_name}': {error}", param=field_name) from error


def model_field(fields: Fields, served_model: str) -> str:
    """The ``model`` field; missing, null or empty selects the served model (as vLLM does: load generators
    that cannot discover the id send ``""``)."""
    model = fields.string("model")
    if not model:
        return served_model
    if model != served_model:
        raise model_not_found(model, served_model)
    return model


def sampling_spec(
    fields: Fields,
    *,
    max_tokens: int | None,
    logprobs: bool,
    top_logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> SamplingSpec:
    """The sampling fields every OpenAI-shaped API shares, vLLM's extensions included; a field this server
    knows but cannot honour is a 400 naming it (``reject_unsupported``), never silently ignored."""
    temperature = fields.number("temperature", minimum=0.0, maximum=MAX_TEMPERATURE)
    top_p = fields.number("top_p", minimum=0.0, maximum=1.0, exclusive_minimum=True)
    extensions = vllm_sampling(fields, max_tokens)
    guide, guide_param = structured_output(fields) or (None, None)
    budget = fields.integer("thinking_token_budget", minimum=-1)  # -1: no bound, as vLLM reads it
    budget = None if budget == -1 else budget
    return SamplingSpec(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        n=fields.integer("n", minimum=1, maximum=MAX_N) or 1,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs,
        speculative=fields.boolean("speculative"),
        guide=guide,
        guide_param=guide_param,
        thinking_token_budget=budget,
        thinking_budget_param=None if budget is None else "thinking_token_budget",
        truncation=prompt_truncation(fields),
        **extensions,
    )


def vllm_sampling(fields: Fields, max_tokens: int | None, max_tokens_param: str = "max_tokens") -> dict[str, Any]:
    """The ``SamplingSpec`` fields of vLLM's sampling extensions and OpenAI's penalties, read alike by every
    OpenAI-shaped API (the Responses API too, as vLLM's takes them); ``reject_unsupported``'s fields are a 400."""
    reject_unsupported(fields)
    frequency_penalty = fields.number("frequency_penalty", minimum=-MAX_PENALTY, maximum=MAX_PENALTY)
    presence_penalty = fields.number("presence_penalty", minimum=-MAX_PENALTY, maximum=MAX_PENALTY)
    repetition_penalty = fields.number(
        "repetition_penalty", minimum=0.0, maximum=MAX_REPETITION_PENALTY, exclusive_minimum=True
    )
    min_tokens = fields.integer("min_tokens", minimum=0) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        message = f"Invalid 'min_tokens': must be at most {max_tokens_param} ({max_tokens}), got {min_tokens}."
        raise invalid_request(message, param="min_tokens")
    skip_special_tokens = fields.boolean("skip_special_tokens")
    top_k = fields.integer("top_k", minimum=-1)
    return {
        "top_k": 0 if top_k is None else top_k,
        "seed": fields.integer("seed", minimum=INT64_MIN, maximum=INT64_MAX),
        "stop": stop_sequences(fields),
        "stop_token_ids": stop_token_ids(fields),
        "ignore_eos": fields.boolean("ignore_eos") or False,
        "repetition_penalty": 1.0 if repetition_penalty is None else repetition_penalty,
        "frequency_penalty": frequency_penalty or 0.0,
        "presence_penalty": presence_penalty or 0.0,
        "logit_bias": logit_bias(fields),
        "allowed_token_ids": allowed_token_ids(fields),
        "bad_words": bad_words(fields),
        "min_p": fields.number("min_p", minimum=0.0, maximum=1.0) or 0.0,
        "min_tokens": min_tokens,
        "include_stop_str_in_output": fields.boolean("include_stop_str_in_output") or False,
        "skip_special_tokens": True if skip_special_tokens is None else skip_special_tokens,
    }


def stream_usage(fields: Fields, stream: bool) -> tuple[bool, bool]:
    """``stream_options``: the final usage chunk, and usage so far in every chunk (vLLM's
    ``continuous_usage_stats``, which, as in vLLM, takes effect only with ``include_usage``)."""
    options = fields.nested("stream_options")
    if options is None:
        return False, False
    if not stream:
        message = "Invalid 'stream_options': only allowed when 'stream' is true."
        raise invalid_request(message, param="stream_options")
    include, continuous = options.boolean("include_usage") or False, options.boolean("continuous_usage_stats")
    return include, include and bool(continuous)

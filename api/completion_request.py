"""``/v1/completions`` request bodies, validated into ``CompletionRequest`` (shared fields: ``protocol``).

A body holds one prompt or a batch: a string, a list of token ids, or a list
of strings or of token-id lists (what log-likelihood evaluation tools send).
Each prompt is answered with ``n`` choices, indexed ``prompt_index * n + i``
as OpenAI and vLLM do. ``echo`` puts the prompt in front of each answer (and,
with ``logprobs``, the prompt tokens' logprobs in front of the answer's);
with ``echo`` a ``max_tokens`` of 0 scores the prompt without generating.
"""

from __future__ import annotations

from dataclasses import dataclass

from rayturn.engine.sampling_params import MAX_LOGPROBS

from .chat_request import unfiltered_guide
from .errors import invalid_request, unsupported
from .json_fields import Fields, body_fields, is_integer, range_error, type_error
from .priority import body_priority
from .protocol import SamplingSpec, model_field, sampling_spec, stream_usage
from .tenants import body_cache_salt

# A batch this long is already a job for many requests; each prompt is a call of its own.
MAX_PROMPTS = 256

Prompt = str | tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """A validated completions request: its prompts (text or token ids) and how to answer each."""

    model: str
    prompts: tuple[Prompt, ...]
    sampling: SamplingSpec
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's ``stream_options.continuous_usage_stats``: usage so far in every chunk
    user: str | None = None
    echo: bool = False
    return_tokens_as_token_ids: bool = False
    # vLLM's ``return_token_ids``: each choice carries its prompt's token ids and its own.
    return_token_ids: bool = False
    # vLLM's ``prompt_logprobs`` asked for: each choice carries the prompt's scores in vLLM's form.
    return_prompt_logprobs: bool = False
    # The class the body's ``priority`` names (``rayturn.api.priority``); None: it names none.
    priority: str | None = None
    # vLLM's ``cache_salt`` (``rayturn.api.tenants``); None: the tenant's prefixes.
    cache_salt: str | None = None

    @property
    def generates(self) -> bool:
        """False for ``echo`` with ``max_tokens`` 0: the prompt is scored, nothing is generated."""
        return self.sampling.max_tokens != 0

    def param(self, index: int) -> str:
        """The field to blame for prompt ``index``."""
        return "prompt" if len(self.prompts) == 1 else f"prompt[{index}]"


def parse_completion_request(body: object, served_model: str) -> CompletionRequest:
    fields = body_fields(body)
    model = model_field(fields, served_model)
    prompts = _prompts(fields)
    echo = fields.boolean("echo") or False
    if fields.string("suffix"):
        raise unsupported("Unsupported 'suffix': insertion after a suffix is not supported.", param="suffix")
    logprobs = fields.integer("logprobs", minimum=0, maximum=MAX_LOGPROBS)
    prompt_logprobs = fields.integer("prompt_logprobs", minimum=0, maximum=MAX_LOGPROBS)
    return_prompt_logprobs = prompt_logprobs is not None
    if echo and logprobs is not None:
        # The echoed prompt's tokens carry logprobs too, with as many alternatives as the answer's.
        prompt_logprobs = logprobs if prompt_logprobs is None else max(logprobs, prompt_logprobs)
    max_tokens = fields.integer("max_tokens", minimum=0 if echo else 1)
    sampling = sampling_spec(
        fields,
        max_tokens=max_tokens,
        logprobs=logprobs is not None,
        top_logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )
    unfiltered_guide(sampling, None, None, "none")
    if sampling.thinking_token_budget is not None:
        message = (
            "Unsupported 'thinking_token_budget': only chat answers are split into reasoning; use /v1/chat/completions."
        )
        raise unsupported(message, param="thinking_token_budget")
    best_of = fields.integer("best_of", minimum=1)
    if best_of is not None and best_of != sampling.n:
        raise unsupported(f"Unsupported 'best_of': only best_of == n ({sampling.n}) is supported.", param="best_of")
    stream = fields.boolean("stream") or False
    include_usage, continuous_usage = stream_usage(fields, stream)
    return CompletionRequest(
        model=model,
        prompts=prompts,
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        user=fields.string("user"),
        echo=echo,
        return_tokens_as_token_ids=fields.boolean("return_tokens_as_token_ids") or False,
        return_token_ids=fields.boolean("return_token_ids") or False,
        return_prompt_logprobs=return_prompt_logprobs,
        priority=body_priority(fields),
        cache_salt=body_cache_salt(fields),
    )


def _prompts(fields: Fields) -> tuple[Prompt, ...]:
    prompt = fields.present("prompt")
    if isinstance(prompt, str):
        return (_text(prompt, "prompt"),)
    if not isinstance(prompt, list):
        raise type_error("prompt", "a string, an array of token ids, or an array of strings or token-id arrays", prompt)
    if not prompt:
        raise invalid_request("Invalid 'prompt': the prompt must not be empty.", param="prompt")
    if is_integer(prompt[0]):  # one prompt of token ids
        return (_token_ids(prompt, "prompt"),)
    if len(prompt) > MAX_PROMPTS:
        message = f"Invalid 'prompt': at most {MAX_PROMPTS} prompts per request, got {len(prompt)}."
        raise invalid_request(message, param="prompt")
    prompts: list[Prompt] = []
    for index, entry in enumerate(prompt):
        param = f"prompt[{index}]"
        if isinstance(entry, str):
            prompts.append(_text(entry, param))
        elif isinstance(entry, list):
            prompts.append(_token_ids(entry, param))
        else:
            raise type_error(param, "a string or an array of token ids", entry)
    return tuple(prompts)


def _text(prompt: str, param: str) -> str:
    if not prompt:
        raise invalid_request(f"Invalid '{param}': the prompt must not be empty.", param=param)
    return prompt


def _token_ids(prompt: list[object], param: str) -> tuple[int, ...]:
    if not prompt:
        raise invalid_request(f"Invalid '{param}': the prompt must not be empty.", param=param)
    for index, token_id in enumerate(prompt):
        if not is_integer(token_id) or token_id < 0:  # type: ignore[operator]
            raise range_error(f"{param}[{index}]", "a non-negative integer token id", token_id)
    return tuple(int(token_id) for token_id in prompt)  # type: ignore[call-overload]

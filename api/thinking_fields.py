"""What a request says about the model's thinking, and what a chat call's answer does with it.

- vLLM's ``thinking_token_budget`` (chat completions, read with the sampling
  fields; gRPC's ``sampling.thinking_token_budget``): the most tokens the
  answer's reasoning may take; -1 or null is no bound. It bounds the reasoning the server's
  reasoning parser splits off (``rayturn serve --reasoning-parser``), so
  without one it is a 400 naming it, as in vLLM.
- Anthropic's ``thinking``: ``{"type": "enabled", "budget_tokens": N}`` is the
  same budget; ``{"type": "disabled"}`` is effort "none" (``anthropic_effort``).
  Claude Code sends a budget with every thinking call, so where the server has
  no reasoning parser it is left unused rather than refused.

``chat_reasoning`` settles a chat call: the format its answer's reasoning is
split in (``rayturn.engine.reasoning.answer_reasoning``) and its sampling with
the guide waiting for the reasoning's end and the budget in force.
"""

from __future__ import annotations

from rayturn.engine.reasoning import answer_reasoning, reasoning_params
from rayturn.engine.sampling_params import SamplingParams

from .chat_request import REASONING_EFFORTS
from .errors import invalid_request
from .json_fields import Fields, type_error
from .protocol import ChatRequest

VLLM_BUDGET = "thinking_token_budget"
ANTHROPIC_BUDGET = "thinking.budget_tokens"


def anthropic_budget(fields: Fields) -> int | None:
    """``thinking.budget_tokens`` of ``thinking: {"type": "enabled"}``; None for any other ``thinking``."""
    thinking = fields.nested("thinking")
    if thinking is None or thinking.raw("type") != "enabled":
        return None
    budget = thinking.integer("budget_tokens", minimum=0)
    if budget is None:
        raise type_error(ANTHROPIC_BUDGET, "an integer", None)
    return budget


def anthropic_effort(fields: Fields) -> str | None:
    """Effort "none" when ``thinking`` is disabled, else ``output_config.effort`` (Claude Code sends one every
    call); an effort of a later Claude Code than this server knows is left out, so the agent keeps working."""
    thinking, config = fields.raw("thinking"), fields.raw("output_config")
    if isinstance(thinking, dict) and thinking.get("type") == "disabled":
        return "none"
    effort = config.get("effort") if isinstance(config, dict) else None
    return effort if effort in REASONING_EFFORTS else None


def chat_reasoning(parser: str | None, chat: ChatRequest, params: SamplingParams) -> tuple[str | None, SamplingParams]:
    """The format a chat call's answer's reasoning is split in (None: it is not), and ``params`` for that answer.

    A budget bounds the reasoning the server's reasoning parser (``parser``) splits off: vLLM's field without
    one is a 400; with thinking turned off for the call, there is no reasoning to bound."""
    sampling = chat.sampling
    if sampling.thinking_token_budget is not None and parser is None and sampling.thinking_budget_param == VLLM_BUDGET:
        message = (
            f"Invalid '{VLLM_BUDGET}': it bounds a thinking model's reasoning, and this server splits none off; "
            "start it with --reasoning-parser (model.reasoning_parser)."
        )
        raise invalid_request(message, param=VLLM_BUDGET)
    reasoning = answer_reasoning(parser, chat.template_kwargs)
    return reasoning, reasoning_params(params, reasoning, sampling.thinking_token_budget)

"""Reasoning apart from the answer, for models that think in ``<think>...</think>`` (vLLM's reasoning parsers).

``REASONING_PARSERS`` names each format, as ``vllm serve --reasoning-parser``
does:

- ``qwen3``: the answer opens in reasoning (the model writes ``<think>``, or the
  template already did), which ``</think>`` ends; a ``<tool_call>`` ends it too.
  With the template variable ``enable_thinking`` false the model does not
  think, and the answer is not split (Qwen3, QwQ);
- ``deepseek_r1``: the answer opens in reasoning, which ``</think>`` ends
  (DeepSeek-R1, whose templates may open the ``<think>`` themselves).

An answer that never ends its reasoning is all reasoning, as vLLM reads it.
Qwen3 drops every ``<think>`` inside the reasoning, DeepSeek-R1 only the
first (later ones are its text), as vLLM's parsers do. What follows the reasoning
goes to the model's tool-call parser, so a call written inside the reasoning
is never taken for one. A guided answer (a JSON schema, a forced tool call)
thinks first: its guide waits for the end of the reasoning, as vLLM's
structured outputs do; and a token budget on the reasoning forces its end
once spent (``reasoning_params``, ``thinking.py``).

``ThinkingSplit`` is the split, a ``tool_call_parser.ToolCallParser``'s
``split`` in front of the tool-call format's own: it decides only what no
continuation can change, so a streamed answer splits as the whole one does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from rayturn.registry import Registry

from .thinking import ThinkingBudget
from .tool_call_parser import Piece, Reasoning, Split, ToolCallParser, partial_tag_len

if TYPE_CHECKING:
    from .sampling_params import SamplingParams

THINK_START = "<think>"
THINK_END = "</think>"
QWEN3_CALL_START = "<tool_call>"


@dataclass(frozen=True, slots=True)
class ThinkFormat:
    """One format's reasoning: the tags around it, the text that ends it without its tag (a call's opening),
    whether every opening tag inside it is dropped (else only the first), and whether the template variable
    ``enable_thinking`` false means the model does not think."""

    start: str = THINK_START
    end: str = THINK_END
    also_ends_at: str | None = None
    drops_every_start: bool = False
    follows_enable_thinking: bool = False


REASONING_PARSERS: Registry[ThinkFormat] = Registry("reasoning parser")
REASONING_PARSERS.register(
    "qwen3", lambda: ThinkFormat(also_ends_at=QWEN3_CALL_START, drops_every_start=True, follows_enable_thinking=True)
)
REASONING_PARSERS.register("deepseek_r1", ThinkFormat)


def answer_reasoning(parser: str | None, template_kwargs: Mapping[str, Any] | None) -> str | None:
    """The reasoning format a chat call's answer is split by: the server's ``parser``, unless the format follows
    ``enable_thinking`` and the template variables turn thinking off; None: not split."""
    if parser is None:
        return None
    if REASONING_PARSERS.create(parser).follows_enable_thinking and not (template_kwargs or {}).get(
        "enable_thinking", True
    ):
        return None
    return parser


def reasoning_params(params: SamplingParams, reasoning: str | None, budget: int | None = None) -> SamplingParams:
    """``params`` for an answer that opens in reasoning in format ``reasoning`` (None: one that does not, unchanged):
    its guide, if any, waits for the reasoning's end (``Guide.after``), so the model thinks freely and then answers
    under the guide; ``budget``: the most tokens the reasoning may take before its end is forced."""
    if reasoning is None:
        return params
    end = REASONING_PARSERS.create(reasoning).end
    if params.guide is not None:
        params = replace(params, guide=replace(params.guide, after=end))
    if budget is not None:
        params = replace(params, thinking_budget=ThinkingBudget(budget, end))
    return params


class ThinkingSplit:
    """The split of an answer that opens in reasoning: the reasoning as ``Reasoning`` pieces, then the rest
    as the tool-call format's parser (``answer``) splits it."""

    __slots__ = ("_answering", "_ends", "_started", "answer", "format")

    def __init__(self, think_format: ThinkFormat, answer: ToolCallParser) -> None:
        self.format = think_format
        self.answer = answer
        self._answering = False  # the reasoning has ended: what is held goes to ``answer``
        self._started = False  # an opening tag was dropped (a format that drops only the first has no more to drop)
        # The texts that end the reasoning, each with whether it is the format's own closing tag (dropped).
        self._ends = [(think_format.end, True)]
        if think_format.also_ends_at is not None:
            self._ends.append((think_format.also_ends_at, False))

    def split(self, held: str, *, final: bool) -> Split:
        if self._answering:
            return self.answer.split(held, final=final)
        found = [(at, dropped) for tag, dropped in self._ends if (at := held.find(tag)) != -1]
        if not found:
            kept = 0 if final else max(partial_tag_len(held, tag) for tag in self._tags())
            decided = len(held) - kept
            return Split(self._reasoning(held[:decided]), decided)
        end_char, dropped = min(found)
        self._answering = True
        after = end_char + (len(self.format.end) if dropped else 0)
        rest = self.answer.split(held[after:], final=final)
        return Split(self._reasoning(held[:end_char]) + rest.pieces, after + rest.decided_chars, rest.wait_for)

    def _tags(self) -> list[str]:
        dropping = self.format.drops_every_start or not self._started
        return ([self.format.start] if dropping else []) + [tag for tag, _ in self._ends]

    def _reasoning(self, text: str) -> tuple[Piece, ...]:
        if self.format.drops_every_start:
            text = text.replace(self.format.start, "")
        elif not self._started and self.format.start in text:
            text = text.replace(self.format.start, "", 1)
            self._started = True
        return (Reasoning(text),) if text else ()

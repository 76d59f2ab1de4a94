"""A token budget on an answer's reasoning (vLLM's ``thinking_token_budget``): past it, the reasoning is ended.

An answer that opens in reasoning (a thinking model's, ``reasoning.py``)
thinks until it writes the reasoning's end (``</think>``). With a budget of
``tokens``, once the answer holds that many tokens and the end has not shown
in its text, the engine forces the end's tokens, one per step (every other
token masked), and the model answers from there. The count starts at the
answer's first token; an answer that ends its reasoning within the budget is
left alone. A fork keeps its parent's count; tokens made elsewhere (a prefill
replica's first token) are watched on arrival like the engine's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ThinkingBudget:
    """At most ``tokens`` tokens of reasoning, which ``end`` (text) ends."""

    tokens: int
    end: str

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, int) or isinstance(self.tokens, bool) or self.tokens < 0:
            raise ValueError(f"ThinkingBudget.tokens must be an integer >= 0, got {self.tokens!r}")
        if not isinstance(self.end, str) or not self.end:
            raise ValueError(f"ThinkingBudget.end must be a non-empty string, got {self.end!r}")


def newly_shows(text: str, start_char: int, wanted: str) -> bool:
    """Whether ``text`` (new from ``start_char``) holds ``wanted`` in a match that ends in its new part or later
    (one that may have begun before it)."""
    return text.find(wanted, max(0, start_char - len(wanted) + 1)) != -1


class ThinkingState:
    """One sequence's reasoning under its budget: whether it has ended, and the end's tokens to force."""

    __slots__ = ("budget", "end_ids", "ended")

    def __init__(self, budget: ThinkingBudget, end_ids: Sequence[int]) -> None:
        if not end_ids:
            raise ValueError(f"the reasoning's end {budget.end!r} encodes to no tokens")
        self.budget = budget
        self.end_ids = tuple(end_ids)
        self.ended = False

    def forced_token(self, num_output_tokens: int) -> int | None:
        """The token the next step must take (the end's next one, the budget spent), or None: the model's."""
        if self.ended or num_output_tokens < self.budget.tokens:
            return None
        index = num_output_tokens - self.budget.tokens
        return self.end_ids[index] if index < len(self.end_ids) else None

    def watch(self, text: str, start_char: int) -> None:
        """The output's text so far (new from ``start_char``): the reasoning has ended once it shows the end."""
        self.ended = self.ended or newly_shows(text, start_char, self.budget.end)

    def fork(self) -> ThinkingState:
        child = ThinkingState(self.budget, self.end_ids)
        child.ended = self.ended
        return child

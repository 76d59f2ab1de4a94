"""The per-step energy model: what running a set of requests in one engine step costs.

A step that runs the requests ``S`` costs::

    v(S) = fixed_j + token_j * max(knee_tokens, T(S)) + sum over i in S of own_i        (S not empty)
    own_i = request_j + context_j * c_i + attention_j * a_i + page_move_j * p_i
    v({}) = 0

with ``t_i`` the request's new tokens (``T`` their sum over ``S``), ``c_i``
the tokens whose KV it reads (its context and its new tokens), ``a_i`` the
tokens its new tokens attend to (summed over them), ``p_i`` the KV pages it
loads or saves. ``fixed_j`` is what a step costs whatever runs (launches,
scheduling). The ``max`` is the roofline of the dense layers: their weights
are read once per step whatever the batch, so up to ``knee_tokens`` new
tokens ride on that read (memory bound) and only past it does each token pay
its own arithmetic (compute bound). Each request also pays its own: a
sequence's bookkeeping (sampling, stop checks), reading its KV cache once (a
long-context decode is memory bound on it), the attention arithmetic (what
a prefill chunk pays), and its page moves. The fixed cost and the knee make
a request's cost depend on who it runs with, so splitting a step by Shapley
values of ``v`` differs from splitting it by tokens: a decode beside a long
prefill chunk costs little, a decode among decodes shares the weights' read.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import NamedTuple, Self

import numpy as np


class _RequestWorkFields(NamedTuple):
    request_id: str
    new_tokens: int
    # The tokens whose KV the request reads: its context and its new tokens.
    context_tokens: int
    # Summed over the new tokens: how many tokens each one attends to (itself included).
    attended_tokens: int
    pages_moved: int = 0


class RequestWork(_RequestWorkFields):
    """What one request (or one of its sequences) did in one step. A named tuple, not a dataclass: the engine
    makes one per sequence per step, and a frozen dataclass took five times as long to build."""

    __slots__ = ()

    def __new__(
        cls, request_id: str, new_tokens: int, context_tokens: int, attended_tokens: int, pages_moved: int = 0
    ) -> Self:
        if new_tokens < 1:
            raise ValueError(f"a request in a step has at least one new token, got {new_tokens}")
        if context_tokens < 0 or attended_tokens < 0 or pages_moved < 0:
            raise ValueError(
                "context_tokens, attended_tokens and pages_moved must be >= 0: "
                f"{context_tokens}, {attended_tokens}, {pages_moved}"
            )
        return tuple.__new__(cls, (request_id, new_tokens, context_tokens, attended_tokens, pages_moved))

    @classmethod
    def chunk(cls, request_id: str, computed_tokens: int, new_tokens: int, pages_moved: int = 0) -> RequestWork:
        """``new_tokens`` tokens after ``computed_tokens`` already computed ones (causal: token k sees k before it)."""
        attended = new_tokens * computed_tokens + new_tokens * (new_tokens + 1) // 2
        return cls(request_id, new_tokens, computed_tokens + new_tokens, attended, pages_moved)


@dataclass(frozen=True, slots=True)
class CostCoefficients:
    """The model's parameters, in joules (see the module docstring)."""

    fixed_j: float
    token_j: float
    knee_tokens: int
    request_j: float
    context_j: float
    attention_j: float
    page_move_j: float

    def __post_init__(self) -> None:
        if min(self.fixed_j, self.token_j, self.request_j, self.context_j, self.attention_j, self.page_move_j) < 0:
            raise ValueError(f"cost coefficients must be >= 0: {self}")
        if self.knee_tokens < 1:
            raise ValueError(f"knee_tokens must be >= 1, got {self.knee_tokens}")

    def cost_j(self, works: Seq[RequestWork]) -> float:
        """``v(S)`` for the requests ``works``."""
        if not works:
            return 0.0
        total_tokens = sum(work.new_tokens for work in works)
        return (
            self.fixed_j
            + self.token_j * max(self.knee_tokens, total_tokens)
            + sum(self.own_cost_j(work) for work in works)
        )

    def own_cost_j(self, work: RequestWork) -> float:
        """The additive part of a request's cost: its bookkeeping, KV read, attention and page moves."""
        return (
            self.request_j
            + self.context_j * work.context_tokens
            + self.attention_j * work.attended_tokens
            + self.page_move_j * work.pages_moved
        )

    def dense_cost_j(self, total_tokens: np.ndarray) -> np.ndarray:
        """The dense layers' cost of coalitions with these token totals (0 tokens: the empty coalition, 0 J)."""
        return np.where(total_tokens > 0, self.token_j * np.maximum(self.knee_tokens, total_tokens), 0.0)

    def with_parameters(self, parameters: Seq[float], knee_tokens: int) -> CostCoefficients:
        """The coefficients fitted in the order of ``PARAMETERS`` at ``knee_tokens``."""
        fixed_j, token_j, request_j, context_j, attention_j, page_move_j = (max(float(p), 0.0) for p in parameters)
        return CostCoefficients(fixed_j, token_j, knee_tokens, request_j, context_j, attention_j, page_move_j)


# The linear parameters, in the order of the calibration's regressors (``step_totals``).
PARAMETERS = ("fixed_j", "token_j", "request_j", "context_j", "attention_j", "page_move_j")


def step_totals(works: Seq[RequestWork]) -> tuple[int, int, int, int, int]:
    """The step's new tokens, requests, KV tokens read, tokens attended and pages moved."""
    new_tokens = context_tokens = attended_tokens = pages_moved = 0
    for work in works:  # one pass: this runs every engine step
        new_tokens += work.new_tokens
        context_tokens += work.context_tokens
        attended_tokens += work.attended_tokens
        pages_moved += work.pages_moved
    return new_tokens, len(works), context_tokens, attended_tokens, pages_moved

"""Splitting one step's energy among its requests: Shapley values of the cost model, and by tokens.

The Shapley value of request ``i`` is its marginal cost ``v(S + i) - v(S)``
averaged over every order in which the step's requests could have joined.
The cost model (``cost_model.py``) splits into parts whose values are known
in closed form, and one that is not:

- bookkeeping, KV reads, attention and page moves are each request's own:
  each pays exactly its own;
- the fixed cost is shared by any non-empty step: ``fixed_j / n`` each;
- the dense layers, ``token_j * max(knee, T(S))``, depend on the coalition
  only through its token total. A step of at most ``knee`` tokens shares the
  weights' read evenly; one whose every request has ``knee`` tokens or more
  is additive; one whose requests all have the same token count splits it
  evenly. Otherwise requests with the same token count are
  interchangeable, so the exact value enumerates how many of each kind
  joined before (a decode batch with two prefill chunks: ``(n_decodes + 1) *
  2 * 2`` coalitions, not ``2^n``), remembered per composition (a decode
  batch's recurs from step to step). When a step has more such coalitions than
  ``max_exact_coalitions``, the value is estimated from
  ``num_permutations`` random join orders and their reverses; each order's
  marginals add up to the step's cost, so the estimate does too.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np

from .cost_model import CostCoefficients, RequestWork

MAX_EXACT_COALITIONS = 1024
NUM_PERMUTATIONS = 32
MAX_ENUMERATED_PLAYERS = 16
MAX_EXACT_PLAYERS = 4096
# log(k!) for k = 0 .. MAX_EXACT_PLAYERS.
_LOG_FACTORIAL = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, MAX_EXACT_PLAYERS + 1)))])


@dataclass(frozen=True, slots=True)
class Split:
    """Each request's share of a step, in joules of the model, in the order of the works; exact or sampled."""

    values_j: list[float]
    exact: bool


def shapley_split(
    works: Seq[RequestWork],
    coefficients: CostCoefficients,
    rng: np.random.Generator,
    max_exact_coalitions: int = MAX_EXACT_COALITIONS,
    num_permutations: int = NUM_PERMUTATIONS,
) -> Split:
    """The Shapley values of ``coefficients.cost_j`` over ``works``; they sum to ``cost_j(works)``.

    The closed forms run in plain Python: most steps take them, and they must cost little next to the step.
    """
    num_players = len(works)
    if num_players == 1:  # alone in its step: it pays all of it
        return Split([coefficients.cost_j(works)], exact=True)
    fixed_share_j = coefficients.fixed_j / num_players if num_players else 0.0
    own_j = [coefficients.own_cost_j(work) + fixed_share_j for work in works]
    tokens = [work.new_tokens for work in works]
    knee, token_j = coefficients.knee_tokens, coefficients.token_j
    if not works:
        return Split([], exact=True)
    if sum(tokens) <= knee:  # every coalition is memory bound: the weights' read is shared evenly
        return Split([own + token_j * knee / num_players for own in own_j], exact=True)
    if min(tokens) >= knee:  # every coalition is compute bound: each pays its own tokens
        return Split([own + token_j * count for own, count in zip(own_j, tokens)], exact=True)
    by_kind = Counter(tokens)
    if len(by_kind) == 1:  # every request alike: they share the dense layers evenly
        dense_share_j = token_j * max(knee, sum(tokens)) / num_players
        return Split([own + dense_share_j for own in own_j], exact=True)
    kinds = tuple(sorted(by_kind))
    counts = tuple(by_kind[kind] for kind in kinds)
    num_coalitions = math.prod(count + 1 for count in counts)
    if num_coalitions <= max_exact_coalitions and num_players <= MAX_EXACT_PLAYERS:
        share_of_kind = dict(zip(kinds, _dense_by_kind_cached(kinds, counts, coefficients)))
        return Split([own + share_of_kind[count] for own, count in zip(own_j, tokens)], exact=True)
    dense_j = _dense_sampled(np.array(tokens), coefficients, rng, num_permutations)
    return Split((np.array(own_j) + dense_j).tolist(), exact=False)


def proportional_split(works: Seq[RequestWork], total_j: float) -> list[float]:
    """``total_j`` split by new tokens: the baseline the Shapley split is measured against."""
    total_tokens = sum(work.new_tokens for work in works)
    return [total_j * work.new_tokens / total_tokens for work in works]


def exact_shapley(value: Callable[[Seq[int]], float], num_players: int) -> np.ndarray:
    """The Shapley values of any coalition function by enumerating all ``2^n`` coalitions (small ``n`` only).

    ``value`` takes the players of a coalition (indices, ascending) and returns its cost.
    """
    if num_players > MAX_ENUMERATED_PLAYERS:
        raise ValueError(f"enumerating {num_players} players is too many (at most {MAX_ENUMERATED_PLAYERS})")
    players = range(num_players)
    costs = np.array([value([i for i in players if mask >> i & 1]) for mask in range(1 << num_players)])
    sizes = np.array([mask.bit_count() for mask in range(1 << num_players)])
    weights = np.array(
        [math.factorial(k) * math.factorial(num_players - 1 - k) for k in range(num_players)], dtype=np.float64
    ) / math.factorial(num_players)
    values = np.zeros(num_players)
    masks = np.arange(1 << num_players)
    for i in players:
        without = masks[(masks >> i & 1) == 0]
        values[i] = float(np.sum(weights[sizes[without]] * (costs[without | 1 << i] - costs[without])))
    return values


@functools.lru_cache(maxsize=4096)
def _dense_by_kind_cached(
    kinds: tuple[int, ...], counts: tuple[int, ...], coefficients: CostCoefficients
) -> tuple[float, ...]:
    """``_dense_by_kind`` remembered: a decode batch's composition recurs from step to step until it changes."""
    return tuple(_dense_by_kind(np.array(kinds), np.array(counts), coefficients).tolist())


def _dense_by_kind(kinds: np.ndarray, counts: np.ndarray, coefficients: CostCoefficients) -> np.ndarray:
    """The exact Shapley value of the dense part for a request of each kind (token count), all kinds at once.

    For a request of kind ``j`` the others are ``counts - e_j``; a coalition of
    them that joined before it is a count ``c_l`` per kind, reached in
    ``prod_l C(others_l, c_l)`` ways, each of Shapley weight ``k! (n-1-k)! / n!``.
    """
    num_players = int(counts.sum())
    coalitions = np.indices(tuple(int(count) + 1 for count in counts)).reshape(len(kinds), -1)
    sizes = coalitions.sum(axis=0)
    totals = kinds @ coalitions
    others = counts[None, :] - np.eye(len(kinds), dtype=counts.dtype)  # (request kind, kind)
    possible = (coalitions[None] <= others[:, :, None]).all(axis=1)  # (request kind, coalition)
    left_out = np.maximum(others[:, :, None] - coalitions[None], 0)
    log_ways = (
        _LOG_FACTORIAL[others].sum(axis=1)[:, None]
        - _LOG_FACTORIAL[coalitions].sum(axis=0)[None, :]
        - _LOG_FACTORIAL[left_out].sum(axis=1)
    )
    before = np.minimum(sizes, num_players - 1)
    log_order = _LOG_FACTORIAL[before] + _LOG_FACTORIAL[num_players - 1 - before] - _LOG_FACTORIAL[num_players]
    marginal = coefficients.dense_cost_j(totals[None, :] + kinds[:, None]) - coefficients.dense_cost_j(totals)[None, :]
    return np.where(possible, np.exp(log_ways + log_order[None, :]) * marginal, 0.0).sum(axis=1)


def _dense_sampled(
    tokens: np.ndarray, coefficients: CostCoefficients, rng: np.random.Generator, num_permutations: int
) -> np.ndarray:
    """The dense part's Shapley values estimated from random join orders and their reverses."""
    orders = np.argsort(rng.random((num_permutations, len(tokens))), axis=1)
    orders = np.concatenate([orders, orders[:, ::-1]])
    joined = tokens[orders]
    after = np.cumsum(joined, axis=1)
    marginal = coefficients.dense_cost_j(after) - coefficients.dense_cost_j(after - joined)
    return np.bincount(orders.ravel(), weights=marginal.ravel(), minlength=len(tokens)) / len(orders)

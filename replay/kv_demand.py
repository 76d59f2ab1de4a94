"""How much KV a replay's sessions need, and how many device pages a decode replica gets for it."""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from rayturn.replay.plans import ConversationPlan

# Auto device pages: the sessions' KV demand is this many decode pools (the goal is at least 2; a margin over it).
DEMAND_OVER_CAPACITY = 2.5


def _pages(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def kv_demand_pages(plans: Sequence[ConversationPlan], page_size: int) -> int:
    """Each session's (sub-agents too) largest context in pages, the shared prefix counted once."""
    total = _pages(max((plan.prefix_tokens for plan in plans), default=0), page_size)
    for plan in plans:
        for agent in plan.agents:
            longest = max((len(c.token_ids) + c.max_tokens for c in agent.calls), default=plan.prefix_tokens)
            total += _pages(longest - plan.prefix_tokens, page_size)
    return total


def busiest_pages(plans: Sequence[ConversationPlan], page_size: int, concurrency: int) -> int:
    """Pages the running sequences need at the busiest moment: the ``concurrency`` largest per-conversation peaks.

    A conversation's peak is the most context (beyond the shared prefix) its
    calls hold at once on the trace's clock; the shared prefix counts once.
    """
    peaks = []
    for plan in plans:
        calls = [c for agent in plan.agents for c in agent.calls]
        own_pages = [_pages(len(c.token_ids) + c.max_tokens - plan.prefix_tokens, page_size) for c in calls]
        peak = 0
        for call in calls:
            running = (
                pages
                for c, pages in zip(calls, own_pages)
                if c is call or c.trace_arrival_s <= call.trace_arrival_s < c.trace_end_s
            )
            peak = max(peak, sum(running))
        peaks.append(peak)
    prefix = _pages(max((plan.prefix_tokens for plan in plans), default=0), page_size)
    return prefix + sum(heapq.nlargest(concurrency, peaks))


def auto_device_pages(demand_pages: int, busiest: int, decode_replicas: int) -> int:
    """Pages per decode replica: the sessions' demand ``DEMAND_OVER_CAPACITY`` times the pool's, but never fewer
    than a replica's share of the busiest moment (the router spreads sessions; a replica that gets more preempts)."""
    share = math.ceil(busiest / decode_replicas)
    return max(share, math.floor(demand_pages / (DEMAND_OVER_CAPACITY * decode_replicas)))

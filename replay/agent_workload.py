"""The agent-sessions workload: scripted coding-agent sessions, a pure function of the shape and the seed.

Each session is one agent: a user turn is a burst of LLM calls, each prompt the
previous one plus the agent's answer (a tool call) and the tool's result, with
a tool gap between calls and a longer think gap before the next user message.
Every session starts from the same system + tool prefix, so calls reuse KV
within a session and across sessions. Sessions run concurrently, each one
waiting for its call to finish before its next gap (closed loop), and name
themselves in the ``x-session-id`` header.

The shape follows ``../shared/traces/README.md`` (real Claude Code sessions;
whole public set unless noted):

- shared prefix: ``tool_tokens + system_tokens``, ~15k tokens (9.6k-17.6k in
  the 40 stored conversations);
- calls per user turn: mean 6.8, p90 17 -> lognormal, median 6, sigma 0.7
  (mean 7.7, p90 15), cut to 5-20 (quick: 2-4);
- answer: output p50 216 tokens (stored sample p90 ~3.5x p50: sigma 1.0);
- tool result: new prompt tokens per call p50 ~730, of which the answer is
  ~216, so median 514 (stored sample p90 ~6x p50: sigma 1.4);
- tool gap before a tool-result call: p50 9 s, p90 72 s (sigma 1.62), cut at
  120 s; think gap before a user message: p50 127 s, 30% over 5 min
  (sigma 1.64), cut at 600 s; sessions start spread over one median think gap;
- a prompt that would pass 80% of the context is compacted first: the history
  becomes the prefix plus a 2,000-token summary (an assumption; compaction is
  not visible in the traces).

Scaling (both reported in the JSON): token counts x ``token_scale`` =
0.8 x context / 104k (the traces' prompt p50 lands at 80% of the model's
context: ``tiny``, 4,096 tokens -> ~1/32, the README's 64-token block -> 2
tokens); seconds x ``time_scale`` (default 1/100, quick 1/200). The agent's
answers in the history are scripted, not the model's output, so both systems
see byte-identical prompts for a seed; calls are greedy with ``ignore_eos``,
so every call streams exactly ``max_tokens`` tokens.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Lognormal:
    """A trace quantity drawn lognormally: its median, its log-space sigma, cut at ``cap``."""

    median: float
    sigma: float
    cap: float = math.inf

    def draw(self, rng: random.Random) -> float:
        return min(rng.lognormvariate(math.log(self.median), self.sigma), self.cap)


# Trace shape in real tokens and seconds (see the module docstring).
SHARED_PREFIX_TOKENS = 15_000
PROMPT_P50_TOKENS = 104_000
SUMMARY_TOKENS = 2_000
CALLS_PER_TURN = Lognormal(6, 0.7)
ANSWER_TOKENS = Lognormal(216, 1.0, cap=8 * 216)
TOOL_RESULT_TOKENS = Lognormal(514, 1.4, cap=8 * 514)  # user messages are drawn alike
TOOL_GAP_S = Lognormal(9.0, 1.62, cap=120.0)
THINK_GAP_S = Lognormal(127.0, 1.64, cap=600.0)
CONTEXT_FILL = 0.8  # compact before a prompt passes this share of the context

TOOLS = ("read_file", "grep", "bash", "edit_file", "list_dir")
WORDS = ("def", "class", "return", "self", "import", "from", "if", "else", "for", "in", "None", "path", "x", "y")
# ChatML framing around one message, in byte tokens (role markers, role name, newlines, tool-call tags), rounded up.
MESSAGE_OVERHEAD_TOKENS = 48
WARMUP_LONG_TOKENS = 640  # past the default disaggregation threshold (512): the prefill replica warms up too


@dataclass(frozen=True, slots=True)
class Shape:
    """How many sessions, turns and calls; token counts in real units, scaled by ``token_scale``."""

    num_sessions: int
    turns_per_session: int
    calls_per_turn: tuple[int, int]
    max_tokens: int
    token_scale: float
    time_scale: float
    context_tokens: int

    def tokens(self, real_tokens: float) -> int:
        return max(1, round(real_tokens * self.token_scale))

    @property
    def prompt_budget_tokens(self) -> int:
        return int(CONTEXT_FILL * self.context_tokens) - self.max_tokens


@dataclass(frozen=True, slots=True)
class Call:
    session_id: str  # "": a call of no session (a warm-up), sent without a session header
    turn: int
    gap_s: float  # idle time before the call: a tool running, or the user thinking
    messages: tuple[Message, ...]
    prompt_tokens: int  # estimated; the server's count is in the usage


def default_token_scale(context_tokens: int) -> float:
    return CONTEXT_FILL * context_tokens / PROMPT_P50_TOKENS


def estimate_tokens(messages: Sequence[Message]) -> int:
    """An upper bound of the prompt's byte tokens under the ChatML template."""
    total = 0
    for message in messages:
        total += MESSAGE_OVERHEAD_TOKENS + len((message.get("content") or "").encode())
        for tool_call in message.get("tool_calls", ()):
            function = tool_call["function"]
            total += len(function["name"]) + len(function["arguments"].encode())
    return total


def _text(rng: random.Random, num_tokens: int) -> str:
    """ASCII text of exactly ``num_tokens`` bytes (one byte token each)."""
    words: list[str] = []
    length = 0
    while length < num_tokens:
        words.append(rng.choice(WORDS))
        length += len(words[-1]) + 1
    return " ".join(words)[:num_tokens]


def system_prompt(shape: Shape, seed: int) -> Message:
    rng = random.Random(f"{seed}-system")
    return {"role": "system", "content": _text(rng, shape.tokens(SHARED_PREFIX_TOKENS))}


def make_session(shape: Shape, seed: int, index: int, system: Message) -> list[Call]:
    """One session's calls; the seed and index alone fix it (not the number of sessions)."""
    rng = random.Random(f"{seed}-session-{index}")
    session_id = f"agent-{seed}-{index}"
    history: list[Message] = [system]
    calls: list[Call] = []
    gap_s = rng.uniform(0, THINK_GAP_S.median * shape.time_scale)
    for turn in range(shape.turns_per_session):
        history.append({"role": "user", "content": _text(rng, shape.tokens(TOOL_RESULT_TOKENS.draw(rng)))})
        low, high = shape.calls_per_turn
        num_calls = min(max(round(CALLS_PER_TURN.draw(rng)), low), high)
        for step in range(num_calls):
            if step or turn:
                gap_s = (TOOL_GAP_S if step else THINK_GAP_S).draw(rng) * shape.time_scale
            if estimate_tokens(history) > shape.prompt_budget_tokens:
                summary = {"role": "user", "content": _text(rng, shape.tokens(SUMMARY_TOKENS))}
                pending = history[-2:] if history[-1]["role"] == "tool" else history[-1:]  # keep a call's pair
                history = [system, summary, *pending]
                if estimate_tokens(history) > shape.prompt_budget_tokens:
                    raise ValueError(
                        f"a {shape.context_tokens}-token context cannot hold the shared prefix, a summary and "
                        "one call's new messages: use a longer context or a smaller --token-scale"
                    )
            calls.append(Call(session_id, turn, gap_s, tuple(history), estimate_tokens(history)))
            answer = _text(rng, shape.tokens(ANSWER_TOKENS.draw(rng)))
            if step == num_calls - 1:
                history.append({"role": "assistant", "content": answer})
                continue
            call_id = f"call_{index}_{len(calls)}"
            function = {"name": rng.choice(TOOLS), "arguments": json.dumps({"arg": answer})}
            tool_call = {"id": call_id, "type": "function", "function": function}
            history.append({"role": "assistant", "tool_calls": [tool_call]})
            result = _text(rng, shape.tokens(TOOL_RESULT_TOKENS.draw(rng)))
            history.append({"role": "tool", "tool_call_id": call_id, "content": result})
    return calls


def make_workload(shape: Shape, seed: int) -> list[list[Call]]:
    system = system_prompt(shape, seed)
    return [make_session(shape, seed, index, system) for index in range(shape.num_sessions)]


def warmup_calls(shape: Shape, seed: int, count: int) -> list[Call]:
    """Unrelated prompts (no workload page in them): short ones, and one long enough for the prefill pool.

    They name no session (an empty ``session_id``: sent without a session header). A warm-up call is no agent
    session, but a replica counts a session it saw as one it follows for minutes, and rayturn's router places
    each new session on the replica following the fewest: warm-ups sent as sessions (five, an odd number)
    could tip the real sessions' placement to 5 and 3 on two replicas, where 4 and 4 was due."""
    rng = random.Random(f"{seed}-warmup")
    lengths = [32] * count + [min(WARMUP_LONG_TOKENS, shape.prompt_budget_tokens)]
    calls = []
    for length in lengths:
        messages = ({"role": "user", "content": _text(rng, length)},)
        calls.append(Call("", 0, 0.0, messages, estimate_tokens(messages)))
    return calls

"""What a call produced, folded from its steps as they pass: each completion's output, and the call's counts."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rayturn.engine.energy import joined_meter_names
from rayturn.engine.sequence import TokenLogprob
from rayturn.engine.tool_calls import ParsedToolCalls, ToolCallDelta
from rayturn.messages import Step

from .bodies import usage
from .energy import energy_usage


@dataclass
class CompletionState:
    """One completion's accumulated output, for non-streaming answers and usage."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    # The decode replica's split of the text into prose and tool calls (calls that offered tools).
    tool_parse: list[ToolCallDelta] = field(default_factory=list)

    @property
    def reasoning(self) -> str:
        """The model's reasoning as the replica split it apart ("" when it did not, or there was none)."""
        return "".join(piece.reasoning for piece in self.tool_parse)

    def parsed_tool_calls(self) -> ParsedToolCalls | None:
        """The whole text's prose, tool calls and reasoning as the replica split it, or None when it did not."""
        if not self.tool_parse:
            return None
        content = "".join(piece.content for piece in self.tool_parse)
        calls = tuple(call for piece in self.tool_parse for call in piece.tool_calls)
        return ParsedToolCalls(content=content or None, tool_calls=calls, reasoning=self.reasoning or None)


@dataclass
class CallResult:
    completions: dict[int, CompletionState]
    request_id: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    loaded_tokens: int = 0
    path: str = "local"
    replica_id: str | None = None
    session: Mapping[str, Any] | None = None  # the decode replica's view of the session at arrival
    # Each prompt token's logprob (the first None), for a call that asked for them.
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    # Joules of this send of the call so far (its replicas' attribution), and of earlier sends (a call resumed
    # after its decode replica died); the meter that measured them.
    attempt_energy_j: float = 0.0
    earlier_energy_j: float = 0.0
    energy_meter: str | None = None
    # Set once the ingress has settled the call's energy (``energy.EnergyAccounts``): its session's total then.
    energy_settled: bool = False
    session_energy_j: float | None = None
    # How many tokens the tokenizer makes of a text (without special tokens): counts the answers' reasoning.
    count_tokens: Callable[[str], int] | None = None
    # The format the answers' reasoning is split off in (the Call's ``reasoning``); None: none is.
    reasoning: str | None = None
    # The prompt's token ids as the call was sent (vLLM's ``return_token_ids`` shows them).
    prompt_token_ids: tuple[int, ...] = ()

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions.values())

    @property
    def reasoning_tokens(self) -> int | None:
        """Tokens of the completions' reasoning (where the model's format marks it apart: harmony's analysis
        channel), or None when no answer was split into reasoning and the rest.

        The reasoning's text as the tokenizer encodes it, at most each completion's own length; the format's
        markers around it (a channel's header, its end tag) are not counted.
        """
        split = [state for state in self.completions.values() if state.tool_parse]
        if not split or self.count_tokens is None:
            return None
        count = self.count_tokens
        return sum(min(count(text), len(state.token_ids)) for state in split if (text := state.reasoning))

    @property
    def energy_j(self) -> float:
        return self.earlier_energy_j + self.attempt_energy_j

    def energy(self) -> dict[str, Any]:
        return energy_usage(self.energy_j, self.energy_meter, self.session_energy_j)

    def usage(self) -> dict[str, Any]:
        tokens = usage(
            self.prompt_tokens, self.completion_tokens, self.cached_tokens, self.loaded_tokens, self.reasoning_tokens
        )
        return {**tokens, "energy": self.energy()}

    def send_again(self) -> None:
        """The call goes to another replica: what this send spent is kept, the next one counts from zero."""
        self.earlier_energy_j += self.attempt_energy_j
        self.attempt_energy_j = 0.0

    def fold(self, step: Step) -> None:
        """One step of the decode pool: its prompt's counts, where it ran, and its completions' deltas."""
        self.prompt_tokens = step.prompt_tokens
        self.cached_tokens = step.cached_tokens
        self.loaded_tokens = step.loaded_tokens
        self.path = step.path
        self.replica_id = step.replica_id
        self.attempt_energy_j = step.energy_j
        self.energy_meter = joined_meter_names(self.energy_meter, step.energy_meter)
        if step.prompt_logprobs is not None:
            self.prompt_logprobs = step.prompt_logprobs
        if step.session is not None:
            self.session = step.session
        for delta in step.deltas:
            state = self.completions.setdefault(delta.index, CompletionState())
            state.token_ids.extend(delta.token_ids)
            state.text += delta.text
            if delta.logprobs:
                state.logprobs.extend(delta.logprobs)
            state.finish_reason = delta.finish_reason
            state.stop_reason = delta.stop_reason
            state.tool_parse.extend(delta.tool_parse)

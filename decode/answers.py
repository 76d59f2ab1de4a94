"""A call's answers as they grow: per-step deltas, and the split of their text into prose and tool calls.

The engine reports each completion's whole output so far; ``AnswerTracker``
sends only what is new since the last step (``Delta``). For a call whose
answer is split (``Call.tools``: it offered tools, or the model's format marks
up every answer) it also runs the model's tool-call parser (a
``rayturn.engine.tool_calls.ToolCallStream`` of its format) over each
completion's text as it arrives, so the ingress formats the calls without
parsing them again, and the session planner learns whether the answer called
a tool (the agent will be back in seconds) from the same parse. A call
resumed after its replica died (``Call.resume``) starts from what the dead
replica had sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rayturn.engine import RequestOutput
from rayturn.engine.outputs import CompletionOutput
from rayturn.engine.tool_calls import DEFAULT_TOOL_CALL_PARSER, ToolCallDelta, ToolCallStream
from rayturn.messages import Call, Delta, ResumePoint


@dataclass(slots=True)
class _Sent:
    """What one completion has sent so far."""

    tokens: int = 0
    chars: int = 0
    logprobs: int = 0
    finished: bool = False
    tool_calls: ToolCallStream | None = None


@dataclass(slots=True)
class AnswerTracker:
    tools: bool
    tool_call_parser: str = DEFAULT_TOOL_CALL_PARSER  # the format the model's answers call tools in
    # The offered tools, for formats that type argument values by the tool's schema (the Call's ``tool_specs``).
    tool_specs: tuple[Mapping[str, Any], ...] = ()
    # The answer opens in reasoning in this format (the Call's ``reasoning``); None: no reasoning to split off.
    reasoning: str | None = None
    _sent: dict[int, _Sent] = field(default_factory=dict)

    @classmethod
    def for_call(cls, call: Call, tool_call_parser: str) -> AnswerTracker:
        """The tracker of ``call``'s answers, split (as the call says) in the replica's tool-call format."""
        return cls(call.tools, tool_call_parser, call.tool_specs, call.reasoning)

    def deltas(self, output: RequestOutput) -> tuple[Delta, ...]:
        """What each completion gained since the last call: new token ids, text, logprobs, finish reason."""
        return tuple(delta for c in output.completions if (delta := self._delta(c)) is not None)

    def resume(self, point: ResumePoint) -> None:
        """Completion 0 already streamed ``point`` from a replica that died: send only what comes after it.

        The tool-call split takes the streamed pieces as the dead replica did, so it holds what that one held.
        """
        sent = self._sent_for(0)
        if sent.tool_calls is not None:
            for piece in point.text_pieces:
                sent.tool_calls.push(piece)
        sent.tokens, sent.chars = len(point.token_ids), len(point.text)
        sent.logprobs = len(point.logprobs) if point.logprobs is not None else 0

    def called_tools(self, index: int = 0) -> bool:
        """Whether completion ``index`` has called a tool (only a call that offered tools can)."""
        sent = self._sent.get(index)
        return sent is not None and sent.tool_calls is not None and bool(sent.tool_calls.tool_calls)

    def _sent_for(self, index: int) -> _Sent:
        sent = self._sent.get(index)
        if sent is None:
            tools = list(self.tool_specs) or None
            tool_calls = ToolCallStream(self.tool_call_parser, tools, reasoning=self.reasoning) if self.tools else None
            sent = self._sent[index] = _Sent(tool_calls=tool_calls)
        return sent

    def _delta(self, completion: CompletionOutput) -> Delta | None:
        sent = self._sent_for(completion.index)
        finished = completion.finish_reason is not None
        new_tokens = completion.token_ids[sent.tokens :]
        new_text = completion.text[sent.chars :]
        if sent.finished or (not new_tokens and not new_text and not finished):
            return None
        all_logprobs = completion.logprobs
        tool_parse: tuple[ToolCallDelta, ...] = ()
        if sent.tool_calls is not None:
            pushed = sent.tool_calls.push(new_text)
            tool_parse = (pushed, sent.tool_calls.finish()) if finished else (pushed,)
        sent.tokens, sent.chars, sent.finished = len(completion.token_ids), len(completion.text), finished
        new_logprobs = tuple(all_logprobs[sent.logprobs :]) if all_logprobs is not None else None
        sent.logprobs = len(all_logprobs) if all_logprobs is not None else 0
        return Delta(
            index=completion.index,
            token_ids=tuple(new_tokens),
            text=new_text,
            logprobs=new_logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            tool_parse=tool_parse,
        )

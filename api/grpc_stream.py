"""A call's deltas as ``GenerateResponse`` messages: prose and tool calls apart, logprob alternatives, usage last.

Delta --> text         the delta's text; for a call that offered tools only its prose: the decode
                       replica's split of it (``Delta.tool_parse``, the model's tool-call parser), so
                       nothing is parsed twice and the split is the one HTTP streams
      --> tool_calls   the calls that split completed, each whole (after the first, none when the
                       request said ``parallel_tool_calls: false``)
      --> logprobs     each token's logprob; with ``top_logprobs`` its alternatives, with their text
                       and exact bytes
      --> prompt ids   on the stream's first message, the prompt's token ids, when the request asked
      --> finish       ``tool_calls`` once the completion called a tool, else the engine's reason; the
                       message that ends the last completion carries the request's usage,
                       its energy too (settled by the pipeline on the call's last step)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rayturn.engine.sequence import TokenLogprob
from rayturn.engine.tool_calls import ToolCall
from rayturn.messages import Delta
from rayturn.protos import rayturn_pb2 as pb

from .pipeline import CallResult

TOOL_CALLS_FINISH = "tool_calls"


class GrpcStream:
    """Turns one call's deltas into the messages of its ``Generate`` stream, in order."""

    __slots__ = (
        "_num_calls",
        "_num_finished",
        "_parallel_tool_calls",
        "_prompt_token_ids",
        "_token_bytes",
        "_token_text",
        "_tools",
        "n",
    )

    def __init__(
        self,
        *,
        n: int,
        tools: bool,
        parallel_tool_calls: bool = True,
        token_text: Callable[[int], str],
        token_bytes: Callable[[int], bytes] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> None:
        self.n = n
        self._tools = tools  # the call offered tools: its deltas carry the replica's split
        self._parallel_tool_calls = parallel_tool_calls
        self._token_text = token_text
        self._token_bytes = token_bytes  # set when the request asked for top_logprobs
        self._num_calls: dict[int, int] = {}
        self._num_finished = 0
        self._prompt_token_ids = prompt_token_ids  # sent with the first message, when asked for

    def response(self, delta: Delta, result: CallResult) -> pb.GenerateResponse:
        response = pb.GenerateResponse(index=delta.index, token_ids=delta.token_ids)
        if self._prompt_token_ids is not None:
            response.prompt_token_ids.extend(self._prompt_token_ids)
            self._prompt_token_ids = None
        if self._tools:
            response.text = "".join(piece.content for piece in delta.tool_parse)
            response.reasoning = "".join(piece.reasoning for piece in delta.tool_parse)
            calls = self._kept(delta.index, [call for piece in delta.tool_parse for call in piece.tool_calls])
            response.tool_calls.extend(pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls)
        else:
            response.text = delta.text
        if delta.logprobs:
            self._logprobs(response.logprobs, delta.logprobs)
        if delta.finish_reason is not None:
            called = self._num_calls.get(delta.index, 0) > 0
            response.finish_reason = TOOL_CALLS_FINISH if called else delta.finish_reason
            self._num_finished += 1
            if self._num_finished == self.n:  # the stream's last message: every completion is done
                response.usage.prompt_tokens = result.prompt_tokens
                response.usage.completion_tokens = result.completion_tokens
                response.usage.cached_tokens = result.cached_tokens
                response.usage.kv_store_tokens = result.loaded_tokens
                response.usage.reasoning_tokens = result.reasoning_tokens or 0
                response.usage.energy.joules = result.energy_j
                response.usage.energy.meter = result.energy_meter or ""
                if result.session_energy_j is not None:
                    response.usage.energy.session_joules = result.session_energy_j
        return response

    def _kept(self, index: int, calls: Sequence[ToolCall]) -> Sequence[ToolCall]:
        """``calls`` less those past a completion's first when parallel tool calls are off."""
        made = self._num_calls.get(index, 0)
        kept = calls if self._parallel_tool_calls else calls[: max(1 - made, 0)]
        self._num_calls[index] = made + len(kept)
        return kept

    def _logprobs(self, logprobs: pb.Logprobs, entries: Sequence[TokenLogprob]) -> None:
        logprobs.token_logprobs.extend(entry.logprob for entry in entries)
        token_bytes = self._token_bytes
        if token_bytes is None:
            return
        for entry in entries:
            logprobs.top_logprobs.add().alternatives.extend(
                pb.TokenLogprob(
                    token_id=token_id,
                    text=self._token_text(token_id),
                    logprob=logprob,
                    token_bytes=token_bytes(token_id),
                )
                for token_id, logprob in entry.top
            )

"""A streamed response: one completion's text deltas as Responses events, numbered in the order they go out.

    start()   --> response.created, response.in_progress
    reasoning --> [the open message closes] [output_item.added (reasoning), content_part.added]
                  reasoning_text.delta ...
    prose    --> [the open reasoning closes: reasoning_text.done, content_part.done, output_item.done]
                 [output_item.added (message), content_part.added] output_text.delta ...
    a call   --> [the open message or reasoning closes] output_item.added (function_call),
                 function_call_arguments.delta, function_call_arguments.done, output_item.done
    finish() --> [the open message or reasoning closes: output_text.done, content_part.done, output_item.done]
                 response.completed | response.incomplete, carrying the whole response and its usage
    fail()   --> response.failed, carrying the items finished so far and the error

An answer with neither prose nor calls (reasoning aside) still ends with one (empty) message,
as its non-streamed body has. Asked for (``score``), the tokens' log probabilities go out with the
next text delta, and those of tokens left when a message closes with its ``output_text.done``: a
message holds those of every token up to its end, reasoning and call tokens included, as the
non-streamed message holds all of them. The text is split into prose and tool calls
as ``streaming.ChatStreamState`` splits it: by the decode replica when it
did (``Delta.tool_parse``), here otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from rayturn.engine.tool_calls import (
    DEFAULT_TOOL_CALL_PARSER,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    random_tool_call_id,
)

from .protocol import JSON
from .responses_bodies import (
    ResponseFrame,
    delta_logprobs,
    function_call_item,
    function_call_item_id,
    message_item,
    message_item_id,
    output_text_part,
    reasoning_item,
    reasoning_item_id,
    reasoning_text_part,
    response_status,
)


def sse_event(event: JSON) -> str:
    """One server-sent event named by the event's ``type``, its data the event as compact JSON."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n"


class ResponsesStream:
    """The events of one streamed response; ``output`` holds its finished items, ``response`` its last body."""

    def __init__(
        self,
        frame: ResponseFrame,
        *,
        parse_tools: bool,
        parallel_tool_calls: bool = True,
        id_factory: Callable[[], str] = random_tool_call_id,
        parser: str = DEFAULT_TOOL_CALL_PARSER,
        reasoning: str | None = None,
    ) -> None:
        self._frame = frame
        self._parser = ToolCallStream(parser, id_factory=id_factory, reasoning=reasoning) if parse_tools else None
        self._parallel_tool_calls = parallel_tool_calls
        self._sequence_number = 0
        self._num_calls = 0
        self._message_id: str | None = None  # the message item open now, if any
        self._text = ""
        self._logprobs: list[JSON] = []  # the open message's tokens' log probabilities
        self._unsent: list[JSON] = []  # those of tokens since the last text delta
        self._reasoning_id: str | None = None  # the reasoning item open now, if any
        self._reasoning = ""
        self.output: list[JSON] = []
        self.response: JSON = frame.body("in_progress", [])

    def start(self) -> list[JSON]:
        return [
            self._event("response.created", response=self.response),
            self._event("response.in_progress", response=self.response),
        ]

    def score(self, logprobs: Sequence[JSON]) -> None:
        """The log probabilities of the tokens whose text is pushed next (``bodies.chat_logprobs``'s shape)."""
        self._unsent += logprobs

    def push(self, text: str, parsed: ToolCallDelta | None = None) -> list[JSON]:
        """The events for a text delta; ``parsed``: the replica's split of ``text``."""
        if self._parser is None:
            return self._prose(text)
        return self._piece(parsed if parsed is not None else self._parser.push(text))

    def finish(self, engine_finish_reason: str | None, usage: JSON, parsed: ToolCallDelta | None = None) -> list[JSON]:
        """The closing events; ``parsed``: the replica's decision on the text it held back."""
        events = []
        if self._parser is not None:
            events += self._piece(parsed if parsed is not None else self._parser.finish())
        status = response_status(engine_finish_reason)
        if self._reasoning_id is not None:
            events += self._close_reasoning(status)
        if self._message_id is None and all(item["type"] == "reasoning" for item in self.output):
            events += self._open_message()
        if self._message_id is not None:
            events += self._close_message(status)
        self.response = self._frame.body(status, self.output, usage)
        events.append(self._event(f"response.{status}", response=self.response))
        return events

    def fail(self, error: JSON) -> JSON:
        """The event that ends a stream whose call failed after it started."""
        self.response = self._frame.body("failed", self.output, error=error)
        return self._event("response.failed", response=self.response)

    def _piece(self, piece: ToolCallDelta) -> list[JSON]:
        events = self._reasoning_text(piece.reasoning) + self._prose(piece.content)
        for call in piece.tool_calls:
            if self._num_calls and not self._parallel_tool_calls:
                break  # surplus calls under parallel_tool_calls=false are dropped, as the chat API drops them
            events += self._call(call)
        return events

    def _reasoning_text(self, text: str) -> list[JSON]:
        if not text:
            return []
        events = self._close_message("completed") if self._message_id is not None else []
        if self._reasoning_id is None:
            self._reasoning_id, self._reasoning = reasoning_item_id(), ""
            item = reasoning_item(self._reasoning_id, None, "in_progress")
            events += [
                self._event("response.output_item.added", output_index=len(self.output), item=item),
                self._event("response.content_part.added", **self._reasoning_position(), part=reasoning_text_part("")),
            ]
        self._reasoning += text
        events.append(self._event("response.reasoning_text.delta", **self._reasoning_position(), delta=text))
        return events

    def _close_reasoning(self, status: str) -> list[JSON]:
        assert self._reasoning_id is not None
        position = self._reasoning_position()
        item = reasoning_item(self._reasoning_id, self._reasoning, status)
        self._reasoning_id = None
        events = [
            self._event("response.reasoning_text.done", **position, text=self._reasoning),
            self._event("response.content_part.done", **position, part=reasoning_text_part(self._reasoning)),
            self._event("response.output_item.done", output_index=len(self.output), item=item),
        ]
        self.output.append(item)
        return events

    def _prose(self, text: str) -> list[JSON]:
        if not text:
            return []
        events = self._close_reasoning("completed") if self._reasoning_id is not None else []
        events += self._open_message() if self._message_id is None else []
        self._text += text
        logprobs, self._unsent = self._unsent, []
        self._logprobs += logprobs
        position = self._text_position()
        events.append(
            self._event("response.output_text.delta", **position, delta=text, logprobs=delta_logprobs(logprobs))
        )
        return events

    def _open_message(self) -> list[JSON]:
        self._message_id, self._text, self._logprobs = message_item_id(), "", []
        item = message_item(self._message_id, None, "in_progress")
        return [
            self._event("response.output_item.added", output_index=len(self.output), item=item),
            self._event("response.content_part.added", **self._text_position(), part=output_text_part("")),
        ]

    def _close_message(self, status: str) -> list[JSON]:
        assert self._message_id is not None
        position = self._text_position()
        logprobs, self._unsent = self._logprobs + self._unsent, []
        item = message_item(self._message_id, self._text, status, logprobs)
        self._message_id = None
        events = [
            self._event("response.output_text.done", **position, text=self._text, logprobs=delta_logprobs(logprobs)),
            self._event("response.content_part.done", **position, part=output_text_part(self._text, logprobs)),
            self._event("response.output_item.done", output_index=len(self.output), item=item),
        ]
        self.output.append(item)
        return events

    def _call(self, call: ToolCall) -> list[JSON]:
        events = self._close_message("completed") if self._message_id is not None else []
        events += self._close_reasoning("completed") if self._reasoning_id is not None else []
        self._num_calls += 1
        item_id, index = function_call_item_id(), len(self.output)
        item = function_call_item(item_id, call, "completed")
        position = {"item_id": item_id, "output_index": index}
        events += [
            self._event(
                "response.output_item.added",
                output_index=index,
                item=function_call_item(item_id, call, "in_progress", arguments=""),
            ),
            self._event("response.function_call_arguments.delta", **position, delta=call.arguments),
            self._event("response.function_call_arguments.done", **position, name=call.name, arguments=call.arguments),
            self._event("response.output_item.done", output_index=index, item=item),
        ]
        self.output.append(item)
        return events

    def _text_position(self) -> JSON:
        return {"item_id": self._message_id, "output_index": len(self.output), "content_index": 0}

    def _reasoning_position(self) -> JSON:
        return {"item_id": self._reasoning_id, "output_index": len(self.output), "content_index": 0}

    def _event(self, event_type: str, **fields: object) -> JSON:
        event = {"type": event_type, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return event

"""The agent-sessions client: every session closed loop against a cluster, each call timed as it streams."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rayturn.replay.agent_workload import Call
from rayturn.replay.harness import Progress


@dataclass(frozen=True, slots=True)
class CallSample:
    session_id: str
    ok: bool
    ttft_s: float = 0.0
    itl_s: tuple[float, ...] = ()
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    replica: str | None = None  # the decode replica, when the server names it
    error: str = ""
    start_s: float = 0.0  # when the call was sent (``time.perf_counter``)

    def token_times(self) -> list[float]:
        """When each streamed token arrived (``time.perf_counter``), rebuilt from the start, TTFT and ITLs."""
        times = [self.start_s + self.ttft_s]
        for gap in self.itl_s:
            times.append(times[-1] + gap)
        return times


async def timed_call(client: Any, model: str, call: Call, max_tokens: int) -> CallSample:
    start = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=list(call.messages),
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            extra_headers={"x-session-id": call.session_id} if call.session_id else None,
        )
        replica = stream.response.headers.get("x-rayturn-replica")
        token_times: list[float] = []
        end = start
        usage = None
        async for chunk in stream:
            end = time.perf_counter()
            usage = chunk.usage or usage
            if any(choice.delta.content or choice.delta.tool_calls for choice in chunk.choices):
                token_times.append(end)
    except Exception as err:  # a failed call is counted; the session goes on, as an agent would retry
        return CallSample(call.session_id, ok=False, error=f"{type(err).__name__}: {err}")
    if usage is None:
        return CallSample(call.session_id, ok=False, error="no usage in the stream")
    details = usage.prompt_tokens_details
    return CallSample(
        call.session_id,
        ok=True,
        ttft_s=(token_times[0] if token_times else end) - start,  # no text at all: the finish chunk
        itl_s=tuple(b - a for a, b in itertools.pairwise(token_times)),
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=(details.cached_tokens or 0) if details else 0,
        completion_tokens=usage.completion_tokens,
        replica=replica,
        start_s=start,
    )


async def drive(
    url: str, sessions: Sequence[Sequence[Call]], max_tokens: int, label: str | None = None
) -> tuple[list[CallSample], float]:
    """Run every session concurrently, closed loop; returns the samples and the wall time."""
    import openai

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="rayturn", max_retries=0, timeout=300) as client:
        model = (await client.models.list()).data[0].id
        progress = Progress(label, sum(len(calls) for calls in sessions)) if label else None

        async def session(calls: Sequence[Call]) -> list[CallSample]:
            samples = []
            for call in calls:
                await asyncio.sleep(call.gap_s)
                samples.append(await timed_call(client, model, call, max_tokens))
                if progress is not None:
                    progress.advance()
            return samples

        start = time.perf_counter()
        per_session = await asyncio.gather(*(session(calls) for calls in sessions))
        return [sample for samples in per_session for sample in samples], time.perf_counter() - start

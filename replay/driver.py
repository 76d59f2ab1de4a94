"""Driving one cluster with a replay workload: closed-loop agents, timed streaming calls, warm-up.

Each conversation's main agent sends its calls in order, each after the
previous answer plus the scaled gap; sub-agents start after their parent call
and the parent's later calls wait for them. ``concurrency`` conversations run
at once (the next starts when one ends) until the workload or the time limit
runs out. A failed call is recorded, not raised: an agent would go on.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import sys
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rayturn.api.session import AFTER_HEADER, CALL_HEADER, SESSION_HEADER, SESSION_STATE_HEADER
from rayturn.replay.harness import Progress
from rayturn.replay.plans import AgentPlan, CallKind, ConversationPlan, PlannedCall
from rayturn.replay.probes import prefill_paths
from rayturn.replay.records import CallRecord, parse_session_header
from rayturn.replay.synthesis import TokenSynthesizer

WARMUP_PROMPT_TOKENS = (640, 64)  # one past the default disaggregation threshold (512): the prefill pool warms too

Sent = tuple[CallKind, tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class SystemRun:
    records: list[CallRecord]
    sent: list[Sent]
    wall_s: float
    prefill_paths: dict[str, int] | None = None  # calls by prefill path (local | disaggregated), when reported
    cluster_start_s: float | None = None
    announcements: dict[str, int] | None = None  # announced user turns by the session's state on arrival


# -- driving one cluster ------------------------------------------------------


async def timed_call(client: Any, model: str, call: PlannedCall) -> CallRecord:
    """Send one call, streaming; a failure is recorded, not raised (an agent would go on)."""
    headers = {SESSION_HEADER: call.session_id, CALL_HEADER: call.call_header, AFTER_HEADER: call.after_header}
    start = time.perf_counter()
    try:
        raw = await client.completions.with_raw_response.create(
            model=model,
            prompt=list(call.token_ids),
            max_tokens=call.max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            extra_headers=headers,
        )
        session_header = raw.headers.get(SESSION_STATE_HEADER)
        token_times: list[float] = []
        usage = None
        async for chunk in raw.parse():
            if chunk.choices:
                token_times.append(time.perf_counter())
            usage = chunk.usage or usage
    except Exception as err:
        return CallRecord(call.conversation_id, call.index, call.kind, ok=False, error=f"{type(err).__name__}: {err}")
    if usage is None or not token_times:
        return CallRecord(call.conversation_id, call.index, call.kind, ok=False, error="no tokens or no usage")
    details = usage.prompt_tokens_details
    try:
        session, header_error = parse_session_header(session_header), ""
    except ValueError as err:
        session, header_error = None, str(err)
    return CallRecord(
        call.conversation_id,
        call.index,
        call.kind,
        ok=True,
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=(details.cached_tokens or 0) if details else 0,
        store_tokens=(getattr(details, "kv_store_tokens", None) or 0) if details else 0,
        ttft_s=token_times[0] - start,
        itl_s=tuple(b - a for a, b in itertools.pairwise(token_times)),
        session=session,
        error=header_error,
    )


async def pause(gap_s: float, deadline: float) -> bool:
    """Sleep out a gap, or until the deadline; whether a call may still go out."""
    await asyncio.sleep(max(0.0, min(gap_s, deadline - time.perf_counter())))
    return time.perf_counter() < deadline


Send = Callable[[PlannedCall], Any]


async def run_agent(calls: Sequence[PlannedCall], send: Send, deadline: float) -> None:
    for call in calls:
        if not await pause(call.gap_s, deadline):
            return
        await send(call)


@dataclass(frozen=True, slots=True)
class Announcer:
    """Announces a main agent's next user turn ``lead_s`` (wall) before it goes out, as a client does
    when its user starts typing."""

    lead_s: float
    announce: Send


async def run_conversation(
    plan: ConversationPlan, send: Send, deadline: float, announcer: Announcer | None = None
) -> None:
    """The main agent closed loop; each sub-agent starts after its parent call, and the calls after it wait for it."""
    main_done = [asyncio.Event() for _ in plan.main.calls]
    sub_done = [asyncio.Event() for _ in plan.subagents]

    async def subagent(index: int, agent: AgentPlan) -> None:
        try:
            if agent.parent_call is not None:
                await main_done[agent.parent_call].wait()
            await run_agent(agent.calls, send, deadline)
        finally:
            sub_done[index].set()

    tasks = [asyncio.create_task(subagent(i, agent)) for i, agent in enumerate(plan.subagents)]
    try:
        for n, call in enumerate(plan.main.calls):
            for index in call.waits_for_subagents:
                await sub_done[index].wait()
            gap_s = call.gap_s
            if announcer is not None and call.kind == "cross":
                lead_s = min(announcer.lead_s, gap_s)
                if not await pause(gap_s - lead_s, deadline):
                    break
                await announcer.announce(call)
                gap_s = lead_s
            if not await pause(gap_s, deadline):
                break
            await send(call)
            main_done[n].set()
    finally:
        for event in main_done:  # a stopped main agent releases the sub-agents waiting on it
            event.set()
        await asyncio.gather(*tasks)


@dataclass(frozen=True, slots=True)
class Drive:
    """How to send a workload: conversations at once, the time limit, the vocabulary and seed of warm-up prompts."""

    concurrency: int
    max_duration_s: float | None
    vocabulary: Sequence[int]
    seed: int
    # Announce each user turn this long (wall) before its call (``POST /v1/sessions/{id}/prewarm``); None: never.
    announce_lead_s: float | None = None


async def replay(url: str, plans: Sequence[ConversationPlan], drive: Drive, label: str) -> SystemRun:
    import openai

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="rayturn", max_retries=0, timeout=300) as client:
        model = (await client.models.list()).data[0].id
        await warm_up(client, model, plans, drive)
        records: list[CallRecord] = []
        sent: list[Sent] = []
        paths_before = prefill_paths(url)
        progress = Progress(label, sum(plan.num_calls for plan in plans))

        async def send(call: PlannedCall) -> None:
            sent.append((call.kind, call.token_ids))
            records.append(await timed_call(client, model, call))
            progress.advance()

        announced: list[str] = []  # the session's state when each announcement arrived
        announcing: set[asyncio.Task[None]] = set()

        async def post_announcement(session_id: str) -> None:
            path = f"/sessions/{urllib.parse.quote(session_id, safe='/')}/prewarm"
            try:
                answer: Any = await client.post(path, cast_to=object)  # the JSON body, parsed
                announced.append(str(answer["state"]))
            except Exception:  # an announcement is a hint: its failure only costs the prewarm
                announced.append("error")

        async def announce(call: PlannedCall) -> None:
            # Sent beside the typing, as a client would: the call's timing does not wait for the answer.
            task = asyncio.create_task(post_announcement(call.session_id))
            announcing.add(task)
            task.add_done_callback(announcing.discard)

        announcer = None if drive.announce_lead_s is None else Announcer(drive.announce_lead_s, announce)
        start = time.perf_counter()
        deadline = math.inf if drive.max_duration_s is None else start + drive.max_duration_s
        pending = iter(plans)

        async def worker() -> None:
            for plan in pending:  # one shared iterator: the next conversation starts when one ends
                if time.perf_counter() >= deadline:
                    return
                await run_conversation(plan, send, deadline, announcer)

        await asyncio.gather(*(worker() for _ in range(drive.concurrency)))
        await asyncio.gather(*announcing)
        wall_s = time.perf_counter() - start
        if progress.done < progress.total:
            sys.stderr.write("\n")
        paths_after = prefill_paths(url)
        paths = None
        if paths_before is not None and paths_after is not None:
            paths = {path: int(n - paths_before.get(path, 0)) for path, n in paths_after.items()}
        states = {state: announced.count(state) for state in sorted(set(announced))}
        return SystemRun(records, sent, wall_s, paths, announcements=states if announcer else None)


async def warm_up(client: Any, model: str, plans: Sequence[ConversationPlan], drive: Drive) -> None:
    """Unrelated prompts first, all at once, so the first replayed calls do not pay for warm-up."""
    longest = max((len(c.token_ids) for plan in plans for agent in plan.agents for c in agent.calls), default=64)
    synthesizer = TokenSynthesizer(drive.vocabulary, seed=drive.seed + 1)
    calls = [
        PlannedCall("warmup", i, f"replay-warmup-{i}", "first", "user", "user",
                    synthesizer.fresh("warmup", i, min(tokens, longest)), 4, 0.0)
        for i, tokens in enumerate(WARMUP_PROMPT_TOKENS)
    ]  # fmt: skip
    await asyncio.gather(*(timed_call(client, model, call) for call in calls))

"""The decode server: one engine per replica, continuous batching across all its calls.

A call arrives already routed here (the router weighs this replica's cached
pages, load and the session). The replica then decides how to fill the
prompt's KV (conditional disaggregation):

- it counts the prompt's pages it holds and, after those, the pages the KV
  store holds; what remains must be computed;
- below ``disaggregation_threshold_tokens`` (or without a prefill pool) it
  computes the rest itself, after loading the store's pages;
- otherwise a prefill replica computes the prompt, publishes its pages to
  the store and returns the first token; this replica loads the pages
  straight into its cache and decodes on from that token (``n`` > 1 and
  seeded calls take only the pages and sample every first token here,
  after forking: ``continues_first``); unless the pool is busier than this
  replica, or failing (``remote_prefill``): then it computes the prompt itself.

Failures around a call::

    remote prefill --fails or times out--> prefilled here; the pool is left alone for a while (``remote_prefill``)
    a call resumed after its replica died (``Call.resume``) --> prefilled here from the store's pages,
        decoding on after the tokens already streamed (``rayturn.api.resume`` decides when)
    Serve retires this replica --> ``__del__``: engine stopped, sessions' pages handed to other segments
    this replica is killed ------> nothing runs: pages published to the store (every prompt's once it is
        computed, every answer's at its finish) outlive it only on other segments (``kvstore.replicas``)

Calls arrive as ``rayturn.messages.Call`` (tokens, sampling, tenant salt,
session, the prompt's page hashes as the ingress computed them, the session
life-cycle hints, whether the call offered tools); ``generate`` yields one
``Step`` per engine step: the completions' deltas (``answers``), the
prompt's cache counts, the prefill ``path`` taken and the ``replica_id``
that serves the call (Serve's id, the one the router ranks; None outside
Serve), so callers can see where their session landed; the first step of a
call of a session also carries ``session``, the KV-residency planner's view
of it at arrival (``rayturn.decode.lifecycle``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from contextlib import aclosing
from typing import Any

import ray

from rayturn.engine import LLMEngine, RequestOutput
from rayturn.engine.async_engine import AsyncEngine
from rayturn.engine.energy import joined_meter_names
from rayturn.engine.kv_connector import StoreConnector
from rayturn.engine.sampling_params import SamplingParams
from rayturn.engine.sequence import TokenLogprob
from rayturn.engine.tool_calls import parser_for_chat_template
from rayturn.kvstore import KVStoreClient, join_store
from rayturn.kvstore.settings import StoreMembership
from rayturn.messages import Call, PrefillAnswer, PrefillPath, PrewarmAnswer, RefusalLog, SessionAnnouncement, Step
from rayturn.router.replica_logs import follow_serve_logging
from rayturn.router.replica_metrics import CallClock, PromptSources, ReplicaMetrics
from rayturn.router.replica_stats import routing_report
from rayturn.router.request_router import serve_replica_id

from .admission import Admission, AdmissionLimits, call_class
from .answers import AnswerTracker
from .idle_work import DeferredJob, IdleWork
from .lifecycle.planner import SessionPlanner
from .lifecycle.settings import LifecycleSettings
from .remote_prefill import RemotePrefill

logger = logging.getLogger(__name__)


# A prompt missing fewer tokens than this computes them instead of asking the
# store: a store round trip (~1-2 ms) costs more than computing a few pages,
# and the newest pages of a growing agent prompt are rarely stored anywhere.
STORE_LOOKUP_MIN_TOKENS = 256

# In idle windows a decode replica asks the KV master for a metadata snapshot this often (if it
# keeps one); the master writes at most one per SNAPSHOT_MIN_INTERVAL_S, whoever asks.
IDLE_SNAPSHOT_EVERY_S = 5.0
SNAPSHOT_MIN_INTERVAL_S = 2.0

# A retiring replica hands its sessions' pages to the store for at most this long (Serve's
# ``graceful_shutdown_timeout_s``, 20 s by default, bounds the whole shutdown).
HAND_OFF_TIMEOUT_S = 10.0


def connect_engine(
    model: str, engine_kwargs: Mapping[str, Any], kvstore: StoreMembership | None
) -> tuple[AsyncEngine, KVStoreClient | None]:
    """The replica's engine and its KV store client: joined to the store when ``kvstore`` is given."""
    client = connector = None
    if kvstore is not None:
        client = join_store(kvstore)
        connector = StoreConnector(client, replicas=kvstore.store.replicas)
    # Finished sequences publish their pages in the background: decoding never waits on the store.
    engine = LLMEngine.from_pretrained(
        model,
        kv_connector=connector,
        kv_save="async",
        kv_load_min_tokens=STORE_LOOKUP_MIN_TOKENS,
        **dict(engine_kwargs),
    )
    return AsyncEngine(engine), client


def output_prefix_of(
    call: Call, first: PrefillAnswer | None
) -> tuple[tuple[int, ...], tuple[TokenLogprob, ...] | None]:
    """The output a call's sequence starts with: what it streamed before its last replica died, else the
    prefill replica's first token, else nothing."""
    if call.resume is not None:
        return call.resume.token_ids, call.resume.logprobs
    if first is not None:
        return first.token_ids, first.logprobs
    return (), None


def call_energy(output: RequestOutput, first: PrefillAnswer | None) -> tuple[float, str | None]:
    """The joules this replica's engine attributed to a call so far, plus the prefill replica's share when it
    computed the prompt; and the meters that measured them."""
    if first is None:
        return output.energy_j or 0.0, output.energy_meter
    return (output.energy_j or 0.0) + first.energy_j, joined_meter_names(output.energy_meter, first.energy_meter)


def continues_first(call: Call) -> bool:
    """Whether a disaggregated call goes on from the prefill replica's first token. n > 1 forks after the first
    token, and seeded sampling draws every token from one generator per completion: both take only the prefill
    replica's pages and sample every first token here (the prompt's last partial page computed here too)."""
    return call.params.n == 1 and (call.params.greedy or call.params.seed is None)


def _prompt_sources(output: RequestOutput | None) -> PromptSources | None:
    """Where this replica's engine found a call's prompt KV (a disaggregated call's: all loaded from the store)."""
    if output is None:
        return None
    return PromptSources(len(output.prompt_token_ids), output.num_cached_prompt_tokens, output.num_loaded_prompt_tokens)


def _counted(answered: bool = True) -> None:
    """A prompt this replica did not count as a long one prefilled here."""


def shut_down_replica(engine: AsyncEngine | None, kv_client: KVStoreClient | None) -> None:
    """Stop the engine thread, hand the sessions' pages to the rest of the KV store, then leave it.

    Serve calls a replica's ``__del__`` when it stops the replica (scale-down,
    redeploy, shutdown) and kills the process right after, before ``atexit``
    hooks run. Leaving the store here makes the master forget the segment at
    once (instead of handing out its pages until the heartbeat times out) and
    unlinks the segment's shared memory, which would otherwise stay in
    /dev/shm until another replica on the node sweeps it. Once the master has
    forgotten the segment, and before it goes, the sessions this replica
    served put their cached pages again, so they land on other segments and
    the sessions' next calls on other replicas load them instead of
    recomputing (for up to ``HAND_OFF_TIMEOUT_S``, within Serve's
    ``graceful_shutdown_timeout_s``).
    """
    if engine is not None:
        engine.shutdown(timeout_s=1.0)
    if kv_client is not None:
        kv_client.close(hand_off=functools.partial(_hand_off, engine) if engine is not None else None)


def _hand_off(engine: AsyncEngine) -> None:
    started_s = time.perf_counter()
    num_pages = engine.hand_off_sessions(HAND_OFF_TIMEOUT_S)
    logger.info("handed %d session pages to the KV store in %.2f s", num_pages, time.perf_counter() - started_s)


class DecodeServer:
    """Ray Serve deployment body for the decode pool (the cluster wraps it with pool options)."""

    def __init__(
        self,
        model: str,
        engine_kwargs: Mapping[str, Any],
        kvstore: StoreMembership | None = None,
        prefill: Any = None,
        disaggregation_threshold_tokens: int = 512,
        lifecycle: LifecycleSettings | None = None,
        tool_call_parser: str | None = None,
        admission: AdmissionLimits | None = None,
        balance_prefill: bool = True,
    ) -> None:
        follow_serve_logging()  # first: the engine says at start which backend it chose
        settings = lifecycle or LifecycleSettings()
        self.replica_id = serve_replica_id()
        RefusalLog.install()  # a refused call is a line in the log, not a traceback
        self.metrics = ReplicaMetrics("decode", self.replica_id)
        self.admission = Admission(admission or AdmissionLimits(), self.replica_id)
        self.engine, self.kv_client = connect_engine(model, engine_kwargs, kvstore)
        template = self.engine.tokenizer.chat_template  # read once: the tool-call format it teaches, unless set
        self.tool_call_parser = tool_call_parser or parser_for_chat_template(template.source if template else "")
        self.planner = (
            SessionPlanner(
                self.engine,
                settings,
                bytes_per_page=self.engine.bytes_per_page,
                has_store=self.engine.has_store,
            )
            if settings.enabled
            else None
        )
        self.idle_work: IdleWork | None = None
        self._idle_work_task: asyncio.Task[None] | None = None
        if self.planner is not None and self.kv_client is not None:
            self.idle_work = IdleWork(self.planner.next_activity_s)
            self.idle_work.add(
                DeferredJob(
                    "kv-snapshot", self._snapshot_store, IDLE_SNAPSHOT_EVERY_S, duration_s=0.1, max_delay_s=60.0
                )
            )
        self.threshold = disaggregation_threshold_tokens
        self.started_at = time.time()
        self.counters = {"requests": 0, "disaggregated": 0, "local_prefill": 0, "failed_prefill": 0, "resumed": 0}
        # The prefill pool (a Serve handle), or None.
        self.remote = RemotePrefill(prefill, self.counters, balance=balance_prefill) if prefill is not None else None
        logger.info("decode replica ready: backend %s, tool calls %s", self.engine.backend_name, self.tool_call_parser)

    async def _uncached_tokens(self, call: Call) -> int:
        """Prompt tokens neither this replica nor the KV store holds (an estimate for the routing decision).

        Runs beside the engine thread rather than on it (a call there would
        wait for the current step): the prefix-cache lookups only read, and a
        page evicted a moment later just means a few more tokens to compute.
        """
        engine = self.engine
        if call.prompt_tokens < self.threshold:
            return call.prompt_tokens
        hashes, local = engine.prefix_residency(call.prompt_token_ids, call.cache_salt, call.page_hashes)
        uncached = call.prompt_tokens - local * engine.page_size
        if uncached < self.threshold or not engine.has_store or local == len(hashes):
            return uncached  # short enough, whatever the store holds
        try:
            in_store = await asyncio.to_thread(engine.store_prefix_pages, hashes[local:], call.cache_salt)
        except Exception as err:
            logger.warning("KV store lookup failed: %s", err)
            return uncached
        return uncached - in_store * engine.page_size

    def _can_disaggregate(self, params: SamplingParams) -> bool:
        # Prompt logprobs come from computing every prompt position here.
        return self.remote is not None and self.remote.open and params.prompt_logprobs is None

    async def _snapshot_store(self) -> None:
        assert self.kv_client is not None
        await asyncio.to_thread(self.kv_client.master.call, "snapshot_now", SNAPSHOT_MIN_INTERVAL_S)

    async def generate(self, call: Call) -> AsyncIterator[Step]:
        # A call past its class's share of the replica is refused here, before any work (``admission``); a call
        # resumed after its replica died was admitted once already and goes on.
        with self.admission.admitted(call_class(call), resumed=call.resume is not None):
            async with aclosing(self._generate(call)) as steps:
                async for step in steps:
                    yield step

    async def _generate(self, call: Call) -> AsyncGenerator[Step, None]:
        self.counters["requests"] += 1
        if self.idle_work is not None and self._idle_work_task is None:
            self._idle_work_task = asyncio.get_running_loop().create_task(self.idle_work.run_forever())
        session_id = call.session_id if self.planner is not None else None
        report = self.planner.arrive(session_id, call.call) if self.planner and session_id else None
        answers = AnswerTracker.for_call(call, self.tool_call_parser)
        if call.resume is not None:
            self.counters["resumed"] += 1
            answers.resume(call.resume)
        last: RequestOutput | None = None
        prompt_logprobs_sent = False
        clock = CallClock()
        here: Callable[[bool], None] = _counted  # ends the count of a long prompt prefilled here
        try:
            first, here = await self._prefill(call)
            path: PrefillPath = "local" if first is None else "disaggregated"
            output_prefix, output_prefix_logprobs = output_prefix_of(call, first if continues_first(call) else None)
            async for output in self.engine.generate(
                call.prompt_token_ids,
                call.params,
                call.request_id,
                cache_salt=call.cache_salt,
                output_prefix=output_prefix,
                output_prefix_logprobs=output_prefix_logprobs,
                session_id=session_id,
                page_hashes=call.page_hashes,
                retention=call.retention,
                continues_turn=call.continues_turn,
                priority=call.priority,
            ):
                last = output
                here(True)  # a long prompt prefilled here has its first token: out of this replica's queue
                deltas = answers.deltas(output)
                if deltas:
                    clock.step()
                    # A prefill replica computed what it did not find cached; this replica then
                    # loaded all of it from the store: the cache served only what the prefill found.
                    if first is not None:
                        cached, loaded = first.cached_tokens, first.loaded_tokens
                    else:
                        cached, loaded = output.num_cached_prompt_tokens, output.num_loaded_prompt_tokens
                    energy_j, energy_meter = call_energy(output, first)
                    yield Step(
                        deltas=deltas,
                        prompt_tokens=len(output.prompt_token_ids),
                        cached_tokens=cached,
                        loaded_tokens=loaded,
                        finished=output.finished,
                        path=path,
                        replica_id=self.replica_id,
                        session=report,
                        prompt_logprobs=None if prompt_logprobs_sent else output.prompt_logprobs,
                        energy_j=energy_j,
                        energy_meter=energy_meter,
                    )
                    report = None
                    prompt_logprobs_sent = prompt_logprobs_sent or output.prompt_logprobs is not None
        finally:
            here(False)
            self.metrics.finish_call(clock, _prompt_sources(last))
            if self.planner is not None and session_id:
                self._finish_session(session_id, call, last, answers)

    async def _prefill(self, call: Call) -> tuple[PrefillAnswer | None, Callable[[bool], None]]:
        """Conditional disaggregation (``remote_prefill``): the prefill replica's answer when the prefill pool computed
        the prompt, else None (always for a resumed call: its output has begun); and what ends the count of a long
        prompt this replica prefills itself."""
        remote = self.remote
        if call.resume is None and remote is not None and self._can_disaggregate(call.params):
            uncached = await self._uncached_tokens(call)
            if uncached >= self.threshold:
                answer = await remote.prefill(call, uncached)
                if answer is not None:
                    return answer, _counted
                self.counters["local_prefill"] += 1
                return None, remote.started_here(uncached)
        self.counters["local_prefill"] += 1
        return None, _counted

    def _finish_session(self, session_id: str, call: Call, last: RequestOutput | None, answers: AnswerTracker) -> None:
        assert self.planner is not None
        if last is None or not last.finished:  # failed or cancelled: no answer, so no turn ended
            self.planner.abandon(session_id)
            return
        finish_reason = output_tokens = None
        if last.completions:
            first = last.completions[0]
            finish_reason, output_tokens = first.finish_reason, len(first.token_ids)
            if answers.called_tools(first.index):
                finish_reason = "tool_calls"
        self.planner.finish(
            session_id,
            finish_reason,
            call.after,
            prompt_tokens=call.prompt_tokens,
            output_tokens=output_tokens or 0,
        )

    async def prewarm(self, announcement: SessionAnnouncement) -> PrewarmAnswer:
        """A session's next call is announced (``SessionPlanner.composing``; the announcement routes to the
        replica that saw the session last). Returns its state here and this replica."""
        session_id = announcement.session_id
        state = self.planner.composing(session_id)["state"] if self.planner is not None else "disabled"
        return PrewarmAnswer(state=state, replica_id=self.replica_id)

    async def record_routing_stats(self) -> dict[str, Any]:
        # On the replica's event loop, beside the planner that owns the session table.
        sessions = self.planner.followed_sessions() if self.planner is not None else {}
        engine_stats = self.engine.stats()
        self.metrics.publish(engine_stats, self.planner.stats() if self.planner is not None else None)
        return routing_report(engine_stats, self.replica_id, sessions, kv_store=self.engine.has_store)

    def check_health(self) -> None:
        """Serve's periodic probe (and the ingress's ``/health``): a replica whose engine thread died fails it,
        and Serve replaces the replica."""
        if not self.engine.healthy:
            raise RuntimeError("the decode replica's engine has stopped")

    async def health(self) -> dict[str, Any]:
        return {
            "status": "ok" if self.engine.healthy else "failed",
            "role": "decode",
            "replica_id": self.replica_id,
            "node_id": ray.get_runtime_context().get_node_id(),
            "backend": self.engine.backend_name,
            "device": self.engine.device,
            "model_id": self.engine.model_id,
            "kv_store": self.engine.has_store,
            "lifecycle": self.planner.stats() if self.planner is not None else None,
            "idle_work": self.idle_work.stats() if self.idle_work is not None else None,
            "uptime_s": round(time.time() - self.started_at, 1),
            **self.counters,
            "refused_new_turns": self.admission.num_refused,
            "calls_by_priority": self.admission.calls_by_priority(),
            **{k: v for k, v in self.engine.stats().items() if k != "cached_page_hashes"},
        }

    def __del__(self) -> None:
        shut_down_replica(getattr(self, "engine", None), getattr(self, "kv_client", None))

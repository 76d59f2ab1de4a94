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
  straight into its cache and decodes on from that token.

Requests are plain dicts (they cross Ray as such; see ``ServeRequest``):
``request_id``, ``prompt_token_ids``, ``params`` (engine ``SamplingParams``),
``cache_salt``, the routing hints ``session_id``, ``page_hashes``,
``prompt_tokens``, and the session life-cycle hints ``call`` / ``after``
(``rayturn.router.session.LifecycleHints``) and ``tools`` (the call offered
tools, so an answer holding tool calls means the agent will be back).
``generate`` yields one dict per engine step: the completions' deltas, the
prompt's cache counts, the prefill ``path`` taken and the ``replica_id`` that
serves the call (Serve's id, the one the router ranks; None outside Serve),
so callers can see where their session landed; the first step of a call of a
session also carries ``session``, the KV-residency planner's view of it at
arrival (``rayturn.decode.lifecycle``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any, TypedDict

import ray
from ray import serve
from ray.serve.exceptions import RayServeException

from rayturn.engine import LLMEngine, RequestOutput
from rayturn.engine.async_engine import AsyncEngine
from rayturn.engine.kv_connector import StoreConnector
from rayturn.engine.sampling_params import SamplingParams
from rayturn.engine.tool_calls import parse_tool_calls
from rayturn.kvstore import KVStoreClient, join_store
from rayturn.messages import CallKind, NextStep

from .idle_work import DeferredJob, IdleWork
from .lifecycle import LifecycleSettings, SessionPlanner

logger = logging.getLogger(__name__)


# A prompt missing fewer tokens than this computes them instead of asking the
# store: a store round trip (~1-2 ms) costs more than computing a few pages,
# and the newest pages of a growing agent prompt are rarely stored anywhere.
STORE_LOOKUP_MIN_TOKENS = 256

# In idle windows a decode replica asks the KV master for a metadata snapshot this often (if it
# keeps one); the master writes at most one per SNAPSHOT_MIN_INTERVAL_S, whoever asks.
IDLE_SNAPSHOT_EVERY_S = 5.0
SNAPSHOT_MIN_INTERVAL_S = 2.0


class ServeRequest(TypedDict):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str
    session_id: str | None
    page_hashes: list[str]
    prompt_tokens: int
    call: CallKind | None
    after: NextStep | None
    tools: bool


def connect_engine(
    model: str, engine_kwargs: Mapping[str, Any], kvstore: Mapping[str, Any] | None
) -> tuple[AsyncEngine, KVStoreClient | None]:
    """The replica's engine and its KV store client: joined to the store when ``kvstore`` settings are given.

    ``kvstore``: ``rayturn.kvstore.join_store`` settings plus ``"replicas"`` (copies per page).
    """
    client = connector = None
    if kvstore is not None:
        client = join_store(kvstore)
        connector = StoreConnector(client, replicas=int(kvstore.get("replicas", 1)))
    # Finished sequences publish their pages in the background: decoding never waits on the store.
    engine = LLMEngine.from_pretrained(
        model,
        kv_connector=connector,
        kv_save="async",
        kv_load_min_tokens=STORE_LOOKUP_MIN_TOKENS,
        **dict(engine_kwargs),
    )
    return AsyncEngine(engine), client


def shut_down_replica(engine: AsyncEngine | None, kv_client: KVStoreClient | None) -> None:
    """Stop the engine thread, then leave the KV store.

    Serve calls a replica's ``__del__`` when it stops the replica (scale-down,
    redeploy, shutdown) and kills the process right after, before ``atexit``
    hooks run. Leaving the store here makes the master forget the segment at
    once (instead of handing out its pages until the heartbeat times out) and
    unlinks the segment's shared memory, which would otherwise stay in
    /dev/shm until another replica on the node sweeps it.
    """
    if engine is not None:
        engine.shutdown(timeout_s=1.0)
    if kv_client is not None:
        kv_client.close()


def completion_deltas(output: RequestOutput, sent: dict[int, tuple[int, int, int, bool]]) -> list[dict[str, Any]]:
    """What each completion gained since the last call: new token ids, text, logprobs, finish reason.

    ``sent`` maps completion index -> (tokens, text chars, logprobs, finished) already sent; it is updated.
    """
    deltas = []
    for completion in output.completions:
        tokens, chars, num_logprobs, done = sent.get(completion.index, (0, 0, 0, False))
        finished = completion.finish_reason is not None
        new_tokens = completion.token_ids[tokens:]
        new_text = completion.text[chars:]
        if done or (not new_tokens and not new_text and not finished):
            continue
        all_logprobs = completion.logprobs
        deltas.append(
            {
                "index": completion.index,
                "token_ids": list(new_tokens),
                "text": new_text,
                "logprobs": list(all_logprobs[num_logprobs:]) if all_logprobs is not None else None,
                "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason,
            }
        )
        sent[completion.index] = (
            len(completion.token_ids),
            len(completion.text),
            len(all_logprobs) if all_logprobs is not None else 0,
            finished,
        )
    return deltas


def serve_replica_id() -> str | None:
    """This process's Serve replica id (what routers rank replicas by), or None outside a replica."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except RayServeException:
        return None


class DecodeServer:
    """Ray Serve deployment body for the decode pool (the cluster wraps it with pool options)."""

    def __init__(
        self,
        model: str,
        engine_kwargs: Mapping[str, Any],
        kvstore: Mapping[str, Any] | None = None,
        prefill: Any = None,
        disaggregation_threshold_tokens: int = 512,
        lifecycle: Mapping[str, Any] | None = None,
    ) -> None:
        settings = LifecycleSettings.from_mapping(lifecycle)
        self.engine, self.kv_client = connect_engine(model, engine_kwargs, kvstore)
        engine = self.engine.engine
        self.planner = (
            SessionPlanner(
                self.engine,
                settings,
                bytes_per_page=engine.runner.kv_cache[0].nbytes,
                has_store=engine.kv_connector is not None,
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
        self.prefill = prefill  # a Serve handle to the prefill pool, or None
        self.threshold = disaggregation_threshold_tokens
        self.replica_id = serve_replica_id()
        self.started_at = time.time()
        self.counters = {"requests": 0, "disaggregated": 0, "local_prefill": 0, "failed_prefill": 0}
        logger.info("decode replica ready: backend %s", self.engine.engine.backend.name)

    async def _uncached_tokens(self, request: ServeRequest) -> int:
        """Prompt tokens neither this replica nor the KV store holds (an estimate for the routing decision).

        Runs beside the engine thread rather than on it (a call there would
        wait for the current step): the prefix-cache lookups only read, and a
        page evicted a moment later just means a few more tokens to compute.
        """
        token_ids = request["prompt_token_ids"]
        engine = self.engine.engine
        if len(token_ids) < self.threshold:
            return len(token_ids)
        hashes, local = engine.prefix_residency(token_ids, request["cache_salt"])
        uncached = len(token_ids) - local * engine.page_size
        connector = engine.kv_connector
        if uncached < self.threshold or connector is None or local == len(hashes):
            return uncached  # short enough, whatever the store holds
        try:
            in_store = await asyncio.to_thread(connector.longest_prefix, hashes[local:], request["cache_salt"])
        except Exception as err:
            logger.warning("KV store lookup failed: %s", err)
            return uncached
        return uncached - in_store * engine.page_size

    def _can_disaggregate(self, params: SamplingParams) -> bool:
        # n > 1 forks after the first token on one replica; seeded sampling
        # must draw every token from one generator to stay reproducible.
        return self.prefill is not None and params.n == 1 and (params.greedy or params.seed is None)

    async def _snapshot_store(self) -> None:
        assert self.kv_client is not None
        await asyncio.to_thread(self.kv_client.master.call, "snapshot_now", SNAPSHOT_MIN_INTERVAL_S)

    async def generate(self, request: ServeRequest) -> AsyncIterator[dict[str, Any]]:
        self.counters["requests"] += 1
        if self.idle_work is not None and self._idle_work_task is None:
            self._idle_work_task = asyncio.get_running_loop().create_task(self.idle_work.run_forever())
        session_id = request.get("session_id") if self.planner is not None else None
        report = self.planner.arrive(session_id, request.get("call")) if self.planner and session_id else None
        last: RequestOutput | None = None
        try:
            prefix, prefix_logprobs, remote = await self._prefill(request)
            path = "local" if remote is None else "disaggregated"
            sent: dict[int, tuple[int, int, int, bool]] = {}
            async for output in self.engine.generate(
                request["prompt_token_ids"],
                request["params"],
                request["request_id"],
                cache_salt=request["cache_salt"],
                output_prefix=prefix,
                output_prefix_logprobs=prefix_logprobs,
                session_id=session_id,
            ):
                last = output
                deltas = completion_deltas(output, sent)
                if deltas:
                    # A prefill replica computed what it did not find cached; this replica then
                    # loaded all of it from the store: the cache served only what the prefill found.
                    cached, loaded = remote or (output.num_cached_prompt_tokens, output.num_loaded_prompt_tokens)
                    step = {
                        "deltas": deltas,
                        "prompt_tokens": len(output.prompt_token_ids),
                        "cached_tokens": cached,
                        "loaded_tokens": loaded,
                        "finished": output.finished,
                        "path": path,
                        "replica_id": self.replica_id,
                    }
                    if report is not None:
                        step["session"], report = report, None
                    yield step
        finally:
            if self.planner is not None and session_id:
                self._finish_session(session_id, request, last)

    async def _prefill(self, request: ServeRequest) -> tuple[list[int], Any, tuple[int, int] | None]:
        """Conditional disaggregation: the first tokens, their logprobs and the prefill replica's (cached,
        loaded-from-store) prompt tokens when the prefill pool computed the prompt; else nothing."""
        if self._can_disaggregate(request["params"]) and await self._uncached_tokens(request) >= self.threshold:
            try:
                first = await self.prefill.prefill.remote(request)
                self.counters["disaggregated"] += 1
                return first["token_ids"], first["logprobs"], (first["cached_tokens"], first["loaded_tokens"])
            except Exception as err:  # the prefill pool failing must not fail the call
                self.counters["failed_prefill"] += 1
                logger.warning("remote prefill failed, prefilling locally: %s", err)
        self.counters["local_prefill"] += 1
        return [], None, None

    def _finish_session(self, session_id: str, request: ServeRequest, last: RequestOutput | None) -> None:
        assert self.planner is not None
        if last is None or not last.finished:  # failed or cancelled: no answer, so no turn ended
            self.planner.abandon(session_id)
            return
        finish_reason = output_tokens = None
        if last.completions:
            first = last.completions[0]
            finish_reason, output_tokens = first.finish_reason, len(first.token_ids)
            if request.get("tools") and parse_tool_calls(first.text).tool_calls:
                finish_reason = "tool_calls"
        self.planner.finish(
            session_id,
            finish_reason,
            request.get("after"),
            prompt_tokens=len(request["prompt_token_ids"]),
            output_tokens=output_tokens or 0,
        )

    async def prewarm(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """A session's next call is announced (``SessionPlanner.composing``); ``request`` carries
        ``session_id`` (and routes to the replica that saw the session last). Returns its state here
        and this replica."""
        session_id = request["session_id"]
        state = self.planner.composing(session_id)["state"] if self.planner is not None else "disabled"
        return {"state": state, "replica_id": self.replica_id}

    async def record_routing_stats(self) -> dict[str, Any]:
        # On the replica's event loop, beside the planner that owns the session table.
        stats = self.engine.stats()
        if self.planner is not None:
            stats["sessions"] = self.planner.followed_sessions()
        return stats

    def check_health(self) -> None:
        """Serve's periodic probe (and the ingress's ``/health``): a replica whose engine thread died fails it,
        and Serve replaces the replica."""
        if not self.engine.healthy:
            raise RuntimeError("the decode replica's engine has stopped")

    async def health(self) -> dict[str, Any]:
        engine = self.engine.engine
        return {
            "status": "ok" if self.engine.healthy else "failed",
            "role": "decode",
            "replica_id": self.replica_id,
            "node_id": ray.get_runtime_context().get_node_id(),
            "backend": engine.backend.name,
            "device": str(engine.device),
            "model_id": engine.model_id,
            "kv_store": engine.kv_connector is not None,
            "lifecycle": self.planner.stats() if self.planner is not None else None,
            "idle_work": self.idle_work.stats() if self.idle_work is not None else None,
            "uptime_s": round(time.time() - self.started_at, 1),
            **self.counters,
            **{k: v for k, v in self.engine.stats().items() if k != "cached_page_hashes"},
        }

    def __del__(self) -> None:
        shut_down_replica(getattr(self, "engine", None), getattr(self, "kv_client", None))

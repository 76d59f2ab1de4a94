"""The prefill server: computes prompts, publishes their KV pages, returns the first token.

A decode replica calls ``prefill(call)`` when a prompt's uncached part is
long (see ``rayturn.decode.server``). The replica reuses the prefix pages it
holds, loads the ones the KV store holds, computes the rest with chunked
prefill (batched with other replicas' prompts), samples the first token, and
— before answering — writes every full page of the prompt into its host
segment and registers it with the store's master, so the decode replica can
pull them straight into its cache. A call's retention contract pins its
prefix here and soft-pins the pages in the store (``engine/prefix_pins.py``).
The engine computes the prompts it holds in the order of their calls' classes
(``rayturn.engine.priority``), as a decode replica's engine does.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

import ray

from rayturn.engine import LLMEngine, RequestOutput
from rayturn.engine.async_engine import AsyncEngine
from rayturn.engine.kv_connector import StoreConnector
from rayturn.kvstore import join_store
from rayturn.kvstore.settings import StoreMembership
from rayturn.messages import Call, PrefillAnswer, RefusalLog
from rayturn.router.replica_logs import follow_serve_logging
from rayturn.router.replica_metrics import CallClock, PromptSources, ReplicaMetrics
from rayturn.router.replica_stats import routing_report
from rayturn.router.request_router import serve_replica_id

logger = logging.getLogger(__name__)


class PrefillServer:
    """Ray Serve deployment body for the prefill pool (the cluster wraps it with pool options)."""

    def __init__(self, model: str, engine_kwargs: Mapping[str, Any], kvstore: StoreMembership | None) -> None:
        follow_serve_logging()  # first: the engine says at start which backend it chose
        if kvstore is None:
            raise ValueError("a prefill server needs the KV store: its pages are its only output")
        self.kv_client = join_store(kvstore)
        connector = StoreConnector(self.kv_client, replicas=kvstore.store.replicas)
        self.engine = AsyncEngine(LLMEngine.from_pretrained(model, kv_connector=connector, **dict(engine_kwargs)))
        self.replica_id = serve_replica_id()
        RefusalLog.install()  # a refused call is a line in the log, not a traceback
        self.metrics = ReplicaMetrics("prefill", self.replica_id)
        self.started_at = time.time()
        self.counters = {"requests": 0, "prompt_tokens": 0, "computed_tokens": 0}
        logger.info("prefill replica ready: backend %s", self.engine.backend_name)

    async def prefill(self, call: Call) -> PrefillAnswer:
        """Compute ``call``'s prompt; returns the first token (and its logprobs) and cache counts, once every full
        page of the prompt is in the store (keyed by the call's page hashes)."""
        params = dataclasses.replace(call.params, max_tokens=1, n=1)
        final: RequestOutput | None = None
        clock = CallClock()
        async for output in self.engine.generate(
            call.prompt_token_ids,
            params,
            f"prefill-{call.request_id}",
            cache_salt=call.cache_salt,
            page_hashes=call.page_hashes,
            retention=call.retention,
            continues_turn=call.continues_turn,
            priority=call.priority,
        ):
            final = output
        assert final is not None and final.finished
        clock.step()
        self.metrics.finish_call(
            clock,
            PromptSources(len(final.prompt_token_ids), final.num_cached_prompt_tokens, final.num_loaded_prompt_tokens),
        )
        completion = final.completions[0]
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += len(final.prompt_token_ids)
        self.counters["computed_tokens"] += len(final.prompt_token_ids) - final.num_cached_prompt_tokens
        return PrefillAnswer(
            token_ids=tuple(completion.token_ids),
            logprobs=tuple(completion.logprobs) if completion.logprobs is not None else None,
            cached_tokens=final.num_cached_prompt_tokens,
            loaded_tokens=final.num_loaded_prompt_tokens,
            energy_j=final.energy_j or 0.0,
            energy_meter=final.energy_meter,
        )

    def record_routing_stats(self) -> dict[str, Any]:
        engine_stats = self.engine.stats()
        self.metrics.publish(engine_stats)
        return routing_report(engine_stats, self.replica_id)

    def check_health(self) -> None:
        """Serve's periodic probe (and the ingress's ``/health``): a replica whose engine thread died fails it,
        and Serve replaces the replica."""
        if not self.engine.healthy:
            raise RuntimeError("the prefill replica's engine has stopped")

    async def health(self) -> dict[str, Any]:
        return {
            "status": "ok" if self.engine.healthy else "failed",
            "role": "prefill",
            "node_id": ray.get_runtime_context().get_node_id(),
            "backend": self.engine.backend_name,
            "device": self.engine.device,
            "model_id": self.engine.model_id,
            "uptime_s": round(time.time() - self.started_at, 1),
            **self.counters,
            **{k: v for k, v in self.engine.stats().items() if k != "cached_page_hashes"},
        }

    def __del__(self) -> None:
        # Stop the engine, then leave the KV store (see ``shut_down_replica`` in the decode server).
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout_s=1.0)
        kv_client = getattr(self, "kv_client", None)
        if kv_client is not None:
            kv_client.close()

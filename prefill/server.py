"""The prefill server: computes prompts, publishes their KV pages, returns the first token.

A decode replica calls ``prefill(request)`` when a prompt's uncached part is
long (see ``rayturn.decode.server``). The replica reuses the prefix pages it
holds, loads the ones the KV store holds, computes the rest with chunked
prefill (batched with other replicas' prompts), samples the first token, and
— before answering — writes every full page of the prompt into its host
segment and registers it with the store's master, so the decode replica can
pull them straight into its cache.
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

logger = logging.getLogger(__name__)


class PrefillServer:
    """Ray Serve deployment body for the prefill pool (the cluster wraps it with pool options)."""

    def __init__(self, model: str, engine_kwargs: Mapping[str, Any], kvstore: Mapping[str, Any] | None) -> None:
        if kvstore is None:
            raise ValueError("a prefill server needs the KV store: its pages are its only output")
        self.kv_client = join_store(kvstore)
        connector = StoreConnector(self.kv_client, replicas=int(kvstore.get("replicas", 1)))
        self.engine = AsyncEngine(LLMEngine.from_pretrained(model, kv_connector=connector, **dict(engine_kwargs)))
        self.started_at = time.time()
        self.counters = {"requests": 0, "prompt_tokens": 0, "computed_tokens": 0}
        logger.info("prefill replica ready: backend %s", self.engine.engine.backend.name)

    async def prefill(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Compute ``request``'s prompt; returns the first token (and its logprobs) and cache counts."""
        params = dataclasses.replace(request["params"], max_tokens=1, n=1)
        final: RequestOutput | None = None
        async for output in self.engine.generate(
            request["prompt_token_ids"], params, f"prefill-{request['request_id']}", cache_salt=request["cache_salt"]
        ):
            final = output
        assert final is not None and final.finished
        completion = final.completions[0]
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += len(final.prompt_token_ids)
        self.counters["computed_tokens"] += len(final.prompt_token_ids) - final.num_cached_prompt_tokens
        engine = self.engine.engine
        page_hashes, _ = engine.prefix_residency(request["prompt_token_ids"], request["cache_salt"])
        return {
            # The store keys of the prompt's full pages (hex), all published before this returns.
            "page_keys": [page_hash.hex() for page_hash in page_hashes],
            "token_ids": list(completion.token_ids),
            "logprobs": list(completion.logprobs) if completion.logprobs is not None else None,
            "cached_tokens": final.num_cached_prompt_tokens,
            "loaded_tokens": final.num_loaded_prompt_tokens,
        }

    def record_routing_stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def check_health(self) -> None:
        """Serve's periodic probe (and the ingress's ``/health``): a replica whose engine thread died fails it,
        and Serve replaces the replica."""
        if not self.engine.healthy:
            raise RuntimeError("the prefill replica's engine has stopped")

    async def health(self) -> dict[str, Any]:
        engine = self.engine.engine
        return {
            "status": "ok" if self.engine.healthy else "failed",
            "role": "prefill",
            "node_id": ray.get_runtime_context().get_node_id(),
            "backend": engine.backend.name,
            "device": str(engine.device),
            "model_id": engine.model_id,
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

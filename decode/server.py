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
``cache_salt``, and the routing hints ``session_id``, ``page_hashes``,
``prompt_tokens``. ``generate`` yields per-step deltas per completion.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any, TypedDict

from rayturn.engine import LLMEngine, RequestOutput
from rayturn.engine.async_engine import AsyncEngine
from rayturn.engine.kv_connector import StoreConnector
from rayturn.engine.sampling_params import SamplingParams
from rayturn.kvstore import join_store

logger = logging.getLogger(__name__)


class ServeRequest(TypedDict):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str
    session_id: str | None
    page_hashes: list[str]
    prompt_tokens: int


def connect_engine(model: str, engine_kwargs: Mapping[str, Any], kvstore: Mapping[str, Any] | None) -> AsyncEngine:
    """The replica's engine, joined to the KV store when ``kvstore`` settings are given.

    ``kvstore``: ``rayturn.kvstore.join_store`` settings plus ``"replicas"`` (copies per page).
    """
    connector = None
    if kvstore is not None:
        client = join_store(kvstore)
        connector = StoreConnector(client, replicas=int(kvstore.get("replicas", 1)))
    engine = LLMEngine.from_pretrained(model, kv_connector=connector, **dict(engine_kwargs))
    return AsyncEngine(engine)


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


class DecodeServer:
    """Ray Serve deployment body for the decode pool (the cluster wraps it with pool options)."""

    def __init__(
        self,
        model: str,
        engine_kwargs: Mapping[str, Any],
        kvstore: Mapping[str, Any] | None = None,
        prefill: Any = None,
        disaggregation_threshold_tokens: int = 512,
    ) -> None:
        self.engine = connect_engine(model, engine_kwargs, kvstore)
        self.prefill = prefill  # a Serve handle to the prefill pool, or None
        self.threshold = disaggregation_threshold_tokens
        self.started_at = time.time()
        self.counters = {"requests": 0, "disaggregated": 0, "local_prefill": 0, "failed_prefill": 0}
        logger.info("decode replica ready: backend %s", self.engine.engine.backend.name)

    async def _uncached_tokens(self, request: ServeRequest) -> tuple[int, int]:
        """(tokens to compute, pages the store holds beyond the local ones)."""
        token_ids = request["prompt_token_ids"]
        salt = request["cache_salt"]
        hashes, local = await asyncio.wrap_future(
            self.engine.call(lambda engine: engine.prefix_residency(token_ids, salt))
        )
        connector = self.engine.engine.kv_connector
        in_store = 0
        if connector is not None and local < len(hashes):
            try:
                in_store = await asyncio.to_thread(connector.longest_prefix, hashes[local:])
            except Exception as err:
                logger.warning("KV store lookup failed: %s", err)
        return len(token_ids) - (local + in_store) * self.engine.engine.page_size, in_store

    def _can_disaggregate(self, params: SamplingParams) -> bool:
        # n > 1 forks after the first token on one replica; seeded sampling
        # must draw every token from one generator to stay reproducible.
        return self.prefill is not None and params.n == 1 and (params.greedy or params.seed is None)

    async def generate(self, request: ServeRequest) -> AsyncIterator[dict[str, Any]]:
        self.counters["requests"] += 1
        params = request["params"]
        prefix: list[int] = []
        prefix_logprobs = None
        path = "local"
        if self._can_disaggregate(params):
            uncached, _ = await self._uncached_tokens(request)
            if uncached >= self.threshold:
                try:
                    first = await self.prefill.prefill.remote(request)
                    prefix = first["token_ids"]
                    prefix_logprobs = first["logprobs"]
                    path = "disaggregated"
                except Exception as err:  # the prefill pool failing must not fail the call
                    self.counters["failed_prefill"] += 1
                    logger.warning("remote prefill failed, prefilling locally: %s", err)
        self.counters["disaggregated" if path == "disaggregated" else "local_prefill"] += 1
        sent: dict[int, tuple[int, int, int, bool]] = {}
        async for output in self.engine.generate(
            request["prompt_token_ids"],
            params,
            request["request_id"],
            cache_salt=request["cache_salt"],
            output_prefix=prefix,
            output_prefix_logprobs=prefix_logprobs,
        ):
            deltas = completion_deltas(output, sent)
            if deltas:
                yield {
                    "deltas": deltas,
                    "prompt_tokens": len(output.prompt_token_ids),
                    "cached_tokens": output.num_cached_prompt_tokens,
                    "loaded_tokens": output.num_loaded_prompt_tokens,
                    "finished": output.finished,
                    "path": path,
                }

    def record_routing_stats(self) -> dict[str, Any]:
        return self.engine.stats()

    async def health(self) -> dict[str, Any]:
        engine = self.engine.engine
        return {
            "status": "ok" if self.engine.healthy else "failed",
            "role": "decode",
            "backend": engine.backend.name,
            "device": str(engine.device),
            "model_id": engine.model_id,
            "kv_store": engine.kv_connector is not None,
            "uptime_s": round(time.time() - self.started_at, 1),
            **self.counters,
            **{k: v for k, v in self.engine.stats().items() if k != "cached_page_hashes"},
        }

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout_s=1.0)

"""A call's prompt is hashed once, at the ingress, on the disaggregated path.

The ingress's call pipeline, a decode server and a prefill server, really
built (the tiny model, the KV store's master as a Ray actor, both servers
joined to the store) and wired in one process the way Serve wires them, so
one counter sees every page hash the call costs: the ingress hashes the
prompt's pages, and the decode replica's residency probe, the prefill
replica and both engines use those hashes instead of hashing again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from rayturn.api.pipeline import CallPipeline, chain_steps, new_request_id  # noqa: E402
from rayturn.api.settings import IngressSettings  # noqa: E402
from rayturn.cluster.app import model_path, pool_engine_kwargs, store_membership  # noqa: E402
from rayturn.cluster.config import load_config  # noqa: E402
from rayturn.decode.server import DecodeServer  # noqa: E402
from rayturn.engine import LLMEngine, SamplingParams, page_hash  # noqa: E402
from rayturn.prefill.server import PrefillServer  # noqa: E402

THRESHOLD = 64
PAGE_SIZE = 16
PROMPT_PAGES = 40
MAX_TOKENS = 4  # the answer completes no page of its own: every hash counted is a prompt page's


class _Method:
    """One method of a Serve handle, over a local object: ``.remote(...)`` and ``.options(stream=True)``."""

    def __init__(self, method: Callable[..., Any], stream: bool = False) -> None:
        self.method = method
        self.stream = stream

    def options(self, stream: bool = False) -> _Method:
        return _Method(self.method, stream)

    def remote(self, *args: Any) -> Any:
        if self.stream:
            return _Stream(self.method(*args))
        result = self.method(*args)
        return result if isinstance(result, Awaitable) else asyncio.sleep(0, result)


class _Stream:
    def __init__(self, steps: AsyncIterator[Any]) -> None:
        self.steps = steps

    def __aiter__(self) -> AsyncIterator[Any]:
        return self.steps

    def cancel(self) -> None:
        pass


class _Handle:
    def __init__(self, target: Any) -> None:
        self.target = target

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self.target, name))


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[CallPipeline, DecodeServer]]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="rayturn")
    config = load_config(
        **{
            "model.name": "tiny",
            "model.num_pages": 256,
            "kvstore.segment_bytes": "32MiB",
            "kvstore.master_name": "rayturn-kv-hash-once",
            "router.disaggregation_threshold_tokens": THRESHOLD,
        }
    )
    model, kvstore = model_path(config), store_membership(config)
    prefill = PrefillServer(model, pool_engine_kwargs(config, config.prefill), kvstore)
    decode = DecodeServer(
        model,
        pool_engine_kwargs(config, config.decode),
        kvstore,
        _Handle(prefill),
        THRESHOLD,
        config.lifecycle,
    )
    settings = IngressSettings(model=model, served_model_name="tiny", page_size=config.model.page_size)
    try:
        yield CallPipeline(_Handle(decode), _Handle(prefill), None, settings), decode
    finally:
        decode.__del__()
        prefill.__del__()
        ray.shutdown()


def test_the_prompt_is_hashed_once_per_call(
    servers: tuple[CallPipeline, DecodeServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    pipeline, decode = servers
    assert pipeline.page_size == PAGE_SIZE
    prompt = [(7 * i) % 200 + 3 for i in range(PROMPT_PAGES * PAGE_SIZE + 5)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    hashed: list[int] = []
    real_hash_page = page_hash.hash_page

    def counting_hash_page(*args: Any, **kwargs: Any) -> Any:
        hashed.append(1)
        return real_hash_page(*args, **kwargs)

    monkeypatch.setattr(page_hash, "hash_page", counting_hash_page)

    async def one_call() -> tuple[Any, list[int]]:
        call = await pipeline.serve_request(new_request_id(), prompt, params, "default", "s-hash-once")
        result, steps, first = await pipeline.start(call)
        async for _ in chain_steps(first, steps):
            pass
        return result, result.completions[0].token_ids

    result, token_ids = asyncio.run(one_call())
    assert result.path == "disaggregated" and decode.counters["disaggregated"] == 1
    assert len(hashed) == PROMPT_PAGES  # once each, at the ingress: no server or engine hashed a page again
    monkeypatch.undo()
    reference = LLMEngine.from_pretrained("tiny", dtype="float32")
    assert token_ids == reference.generate([prompt], params)[0].token_ids

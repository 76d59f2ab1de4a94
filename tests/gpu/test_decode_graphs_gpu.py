"""Decode steps replayed from CUDA graphs give the eager engine's greedy tokens on a GPU: the `small` preset
in float32, batches of 1 to 40 sequences (every captured size, padding rows in most steps) joining and leaving
as they finish, prompts of 1 to 600 tokens; and a decode step's time with graphs and without, printed.
Skipped without a GPU."""

from __future__ import annotations

import random
import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm GPU", allow_module_level=True)
pytest.importorskip("triton")

from rayturn.engine import LLMEngine, SamplingParams
from rayturn.engine.warm_up import warm_up_kernels


def engine_on_gpu(enforce_eager: bool) -> LLMEngine:
    engine = LLMEngine.from_pretrained(
        "small", backend="triton", dtype="float32", device="cuda", num_pages=2048, enforce_eager=enforce_eager
    )
    warm_up_kernels(engine)
    return engine


def staggered(engine: LLMEngine, seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    vocab = engine.config.vocab_size
    done: dict[str, list[int]] = {}
    for size in (1, 2, 3, 5, 8, 13, 40):
        for _ in range(size):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 600))]
            params = SamplingParams(max_tokens=rng.randint(2, 24), temperature=0.0, ignore_eos=True)
            engine.add_request(prompt, params)
        for _ in range(6):
            done.update({o.request_id: list(o.token_ids) for o in engine.step() if o.finished})
    while engine.has_unfinished_requests():
        done.update({o.request_id: list(o.token_ids) for o in engine.step() if o.finished})
    return done


def decode_step_ms(engine: LLMEngine, batch: int) -> float:
    for i in range(batch):
        engine.add_request([(5 * i + j) % 200 + 3 for j in range(64)], SamplingParams(max_tokens=34, ignore_eos=True))
    engine.step()  # the prefills
    engine.step()
    torch.cuda.synchronize()
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return (time.perf_counter() - start) / steps * 1e3


def test_replayed_decode_steps_give_the_eager_engines_tokens() -> None:
    eager, engine = engine_on_gpu(enforce_eager=True), engine_on_gpu(enforce_eager=False)
    assert eager.runner.decode_graphs is None
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.captured
    assert staggered(engine, 0) == staggered(eager, 0)
    assert graphs.num_replays > 50
    timings = {batch: (decode_step_ms(eager, batch), decode_step_ms(engine, batch)) for batch in (1, 8, 32)}
    print("decode step ms (eager, graphs):", {b: (round(e, 3), round(g, 3)) for b, (e, g) in timings.items()})

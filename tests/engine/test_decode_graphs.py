"""Decode steps replayed from graphs captured at start (``engine/decode_graphs.py``).

The CUDA capture itself needs a GPU (``tests/gpu/test_decode_graphs_gpu.py``). Here the torch backend runs the
same path with a capture that records the step and replays it by running it again, over the same static
tensors: what the graphs compute, the padding rows, which steps they take and which run eagerly, and that
the warm-up captures them only where the backend can replay them and the engine is not told to stay eager.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from moe_models import make_moe_checkpoint

from rayturn.engine import LLMEngine, SamplingParams, decode_graphs, warm_up
from rayturn.engine.decode_graphs import DecodeGraphs, bucket_sizes
from rayturn.engine.speculative import SpeculativeConfig
from rayturn.kernels.cpu_backend import CpuBackend
from rayturn.kernels.torch_backend import TorchBackend
from rayturn.kernels.triton_backend import TritonBackend

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


class RerunCapture:
    """A capture that replays a step by running it again; counts the steps it recorded and replayed."""

    def __init__(self) -> None:
        self.recorded = 0
        self.replayed = 0

    def __call__(self, forward: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        self.recorded += 1
        forward()

        def replay() -> torch.Tensor:
            self.replayed += 1
            return forward()

        return replay


def make_engine(max_num_seqs: int = 8, **kwargs: Any) -> LLMEngine:
    return LLMEngine.from_pretrained(
        "tiny", backend="torch", dtype="float32", num_pages=96, max_num_seqs=max_num_seqs, **kwargs
    )


def with_graphs(max_num_seqs: int = 8, **kwargs: Any) -> tuple[LLMEngine, RerunCapture]:
    engine = make_engine(max_num_seqs, **kwargs)
    capture = RerunCapture()
    warm_up.capture_decode_graphs(engine, capture)
    return engine, capture


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (n,), generator=generator).tolist() for n in lengths]


def run_staggered(engine: LLMEngine, batches: list[list[list[int]]], params: SamplingParams) -> dict[str, list[int]]:
    """Add each batch of prompts one step after the last (so prefills join running decodes), then run to the end."""
    done: dict[str, list[int]] = {}
    for batch in batches:
        for prompt in batch:
            engine.add_request(prompt, params)
        for output in engine.step():
            if output.finished:
                done[output.request_id] = list(output.token_ids)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = list(output.token_ids)
    return done


def test_bucket_sizes() -> None:
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    with pytest.raises(ValueError, match="max_num_seqs"):
        bucket_sizes(0)


def test_no_backend_on_this_host_captures_graphs() -> None:
    assert not torch.cuda.is_available()
    assert [b.captures_cuda_graphs() for b in (TorchBackend(), CpuBackend(), TritonBackend())] == [False] * 3


def test_replayed_decode_steps_give_the_eager_engines_tokens_and_cache() -> None:
    # 1 to 7 sequences of 5 to 70 tokens (pages 16): every bucket, padding rows in most steps, page tables of
    # 1 to 6 pages, prefills joining running decodes (those steps run eagerly).
    batches = [prompts([5, 40]), prompts([70], 1), prompts([9, 33, 17], 2), prompts([50, 12], 3)]
    eager = make_engine()
    expected = run_staggered(eager, batches, GREEDY)
    engine, capture = with_graphs()
    assert capture.recorded == len(bucket_sizes(8)) and engine.runner.decode_graphs is not None
    assert run_staggered(engine, batches, GREEDY) == expected
    graphs = engine.runner.decode_graphs
    assert graphs.num_replays == capture.replayed and graphs.num_replays >= 8
    # The same keys and values, page for page (to the last bits a matmul of more rows may change), and nothing
    # in the pages no sequence used: padding rows wrote nothing.
    torch.testing.assert_close(engine.runner.kv_cache, eager.runner.kv_cache, rtol=0, atol=1e-5)
    unused = eager.runner.kv_cache.flatten(1).abs().amax(dim=1) == 0
    assert unused.any() and not engine.runner.kv_cache.flatten(1)[unused].any()


def test_a_batch_of_the_largest_size_and_cached_prefixes_replay_too() -> None:
    shared = prompts([48])[0]
    batch = [shared + tail for tail in prompts([3, 5, 7, 9, 11, 13], 4)]
    eager = make_engine(max_num_seqs=6)
    expected = run_staggered(eager, [batch[:1], batch[1:]], GREEDY)
    engine, capture = with_graphs(max_num_seqs=6)
    assert engine.runner.decode_graphs is not None and engine.runner.decode_graphs.sizes == [1, 2, 4, 6]
    assert run_staggered(engine, [batch[:1], batch[1:]], GREEDY) == expected
    assert capture.replayed > 0


def test_steps_the_graphs_cannot_replay_run_eagerly() -> None:
    engine, capture = with_graphs(max_num_seqs=4)
    graphs = engine.runner.decode_graphs
    assert graphs is not None
    steps: list[list[Any]] = []
    run = engine.runner.run

    def recording_run(chunks: list[Any]) -> Any:
        steps.append(list(chunks))
        return run(chunks)

    engine.runner.run = recording_run  # type: ignore[method-assign]
    engine.add_request(prompts([20])[0], GREEDY)
    engine.step()  # the prefill: eager
    assert capture.replayed == 0
    engine.step()  # a decode alone: replayed
    assert capture.replayed == 1
    engine.add_request(prompts([30], 1)[0], GREEDY)
    engine.step()  # a decode beside a prompt chunk: eager
    assert capture.replayed == 1
    engine.step()  # two decodes: replayed
    assert capture.replayed == 2
    decodes = steps[-1]
    assert len(decodes) == 2 and graphs.can_run(decodes)
    graphs.max_pages = 1  # both sequences are past the first page: past the graphs' page table
    assert not graphs.can_run(decodes)
    graphs.max_pages = 64
    assert not graphs.can_run(decodes * 3)  # more sequences than the largest graph
    assert not graphs.can_run([])


def test_drafts_to_verify_run_eagerly_with_the_same_tokens() -> None:
    # A session's second call holds the first's prompt and the start of its answer: the drafter proposes the
    # rest from the first answer, the verify steps (several tokens a chunk) run eagerly, plain decodes replay.
    speculative = SpeculativeConfig(enabled=True)
    prompt = prompts([20], 5)[0]
    results = []
    engine, capture = with_graphs(speculative=speculative)
    for each in (make_engine(speculative=speculative), engine):
        first = run_staggered(each, [[prompt]], GREEDY)
        answer = next(iter(first.values()))
        results.append((first, run_staggered(each, [[prompt + answer[:4]]], GREEDY)))
    assert results[0] == results[1]
    assert engine.drafter.stats.num_accepted_tokens > 0 and capture.replayed > 0


def test_the_warm_up_captures_graphs_only_where_the_backend_replays_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode_graphs, "CudaCapture", RerunCapture)
    engine = make_engine()
    warm_up.warm_up_kernels(engine)
    assert engine.runner.decode_graphs is None  # the torch backend: no graphs
    monkeypatch.setattr(engine.backend, "captures_cuda_graphs", lambda: True)
    warm_up.warm_up_kernels(engine)
    assert isinstance(engine.runner.decode_graphs, DecodeGraphs) and engine.runner.decode_graphs.captured
    eager = make_engine(enforce_eager=True)
    monkeypatch.setattr(eager.backend, "captures_cuda_graphs", lambda: True)
    warm_up.warm_up_kernels(eager)
    assert eager.runner.decode_graphs is None
    engine.add_request([5, 6, 7], GREEDY)
    with pytest.raises(RuntimeError, match="before the first request"):
        warm_up.capture_decode_graphs(engine, RerunCapture())


def test_a_failed_capture_leaves_every_step_eager(caplog: pytest.LogCaptureFixture) -> None:
    def failing(forward: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        raise RuntimeError("operation not permitted when stream is capturing")

    engine = make_engine()
    assert warm_up.capture_decode_graphs(engine, failing) is None
    assert engine.runner.decode_graphs is None
    assert "decode steps stay eager: capturing them as graphs failed: operation not permitted" in caplog.text
    assert run_staggered(engine, [prompts([10])], GREEDY) == run_staggered(make_engine(), [prompts([10])], GREEDY)


def test_a_model_whose_window_layers_keep_a_cache_of_their_own_stays_eager(tmp_path: Path) -> None:
    _, path = make_moe_checkpoint("gptoss-e4-top2-window20", tmp_path)
    engine = LLMEngine.from_pretrained(str(path), backend="torch", dtype="float32")
    assert engine.runner.window_cache is not None
    assert warm_up.capture_decode_graphs(engine, RerunCapture()) is None and engine.runner.decode_graphs is None
    with pytest.raises(ValueError, match="sliding-window layers keep no cache"):
        DecodeGraphs(engine.runner, 4, 64, RerunCapture())

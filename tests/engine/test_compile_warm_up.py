"""Where the backend compiles its kernels per launch signature (Triton on a GPU), the engine's warm-up runs one
request through a prefill and decode steps and each mixture-of-experts layer at each tile shape; the request
leaves no trace a client or the energy ledger could see.

The compiling itself needs a GPU (``tests/gpu/test_warm_up_gpu.py``); here the torch backend stands in, told
that it compiles."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from moe_models import make_moe_checkpoint

from rayturn.engine import LLMEngine, SamplingParams, warm_up
from rayturn.engine.speculative import SpeculativeConfig
from rayturn.kernels import triton_attention, triton_moe
from rayturn.kernels.cpu_backend import CpuBackend
from rayturn.kernels.torch_backend import TorchBackend
from rayturn.kernels.triton_backend import TritonBackend

PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def compiling_engine(monkeypatch: pytest.MonkeyPatch, model: str = "tiny") -> LLMEngine:
    speculative = SpeculativeConfig(enabled=True)  # on by default: the warm-up request still drafts nothing
    engine = LLMEngine.from_pretrained(model, backend="torch", dtype="float32", num_pages=64, speculative=speculative)
    monkeypatch.setattr(engine.backend, "compiles_kernels", lambda: True)
    return engine


def test_no_backend_compiles_on_this_host() -> None:
    # Without a GPU the Triton kernels run under the interpreter: nothing to compile, so no warm-up request.
    assert not torch.cuda.is_available()
    assert [b.compiles_kernels() for b in (TorchBackend(), CpuBackend(), TritonBackend())] == [False] * 3


def test_a_backend_that_compiles_nothing_gets_no_warm_up_request() -> None:
    engine = LLMEngine.from_pretrained("tiny", backend="torch", num_pages=64)
    steps: list[int] = []
    run = engine.runner.run

    def recording_run(chunks: Any) -> Any:
        steps.append(len(chunks))
        return run(chunks)

    engine.runner.run = recording_run  # type: ignore[method-assign]
    warm_up.warm_up_kernels(engine)
    assert steps == []


def test_the_warm_up_request_runs_prefill_and_decode_and_leaves_no_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = compiling_engine(monkeypatch)
    ledger, store = engine.energy, object()
    engine.kv_transfer = store  # type: ignore[assignment]  # a stand-in: the warm-up must not touch it
    seen: list[tuple[list[int], Any, Any]] = []
    run = engine.runner.run

    def recording_run(chunks: Any) -> Any:
        seen.append(([chunk.num_tokens for chunk in chunks], engine.energy, engine.kv_transfer))
        return run(chunks)

    monkeypatch.setattr(engine.runner, "run", recording_run)
    warm_up.warm_up_kernels(engine)

    page_size = engine.page_size
    assert [tokens for tokens, _, _ in seen] == [[3 * page_size + page_size // 2]] + [[1]] * 3  # prefill, 3 decodes
    assert all(step_ledger is not ledger and step_store is None for _, step_ledger, step_store in seen)
    assert all(step_ledger.meter is ledger.meter for _, step_ledger, _ in seen)  # no second meter (or its thread)
    assert engine.energy is ledger and ledger.num_steps == 0  # the warm-up's steps are in no one's energy
    assert engine.kv_transfer is store
    assert engine.drafter.stats.num_drafts == 0 and len(engine.drafter._recent) == 0  # no index for its salt
    assert not engine.has_unfinished_requests()
    engine.kv_transfer = None

    # What clients get afterwards is what an engine that never warmed up gives: ids, tokens, no cached pages.
    warm_prompt = [(7 * i + 1) % engine.config.vocab_size for i in range(3 * page_size + page_size // 2)]
    prompts = [warm_prompt, [5, 6, 7]]
    outs = engine.generate(prompts, PARAMS)
    cold = LLMEngine.from_pretrained(
        "tiny", backend="torch", dtype="float32", num_pages=64, speculative=SpeculativeConfig(enabled=True)
    )
    expected = cold.generate(prompts, PARAMS)
    assert [(o.request_id, list(o.token_ids)) for o in outs] == [(o.request_id, list(o.token_ids)) for o in expected]
    assert [o.num_cached_prompt_tokens for o in outs] == [0, 0]  # its own cache salt: no prompt hits its pages


def test_warm_up_refuses_to_run_beside_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = compiling_engine(monkeypatch)
    engine.add_request([1, 2, 3], PARAMS)
    with pytest.raises(RuntimeError, match="before the first request"):
        warm_up.compile_step_kernels(engine)


def test_each_distinct_expert_layer_runs_at_each_tile_shape(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Mixtral's two sparse layers have one shape: one of them is enough to compile what both launch.
    _, path = make_moe_checkpoint("mixtral-e4-top2", tmp_path)
    engine = compiling_engine(monkeypatch, str(path))
    asked: list[tuple[int, int, torch.dtype, int]] = []

    def counts(num_experts: int, top_k: int, dtype: torch.dtype, device: torch.device, max_tokens: int) -> list[int]:
        asked.append((num_experts, top_k, dtype, max_tokens))
        return [2, 5, 9]

    monkeypatch.setattr(engine.backend, "moe_token_counts_to_compile", counts)
    rows: dict[int, list[int]] = {}
    blocks: list[torch.nn.Module] = [layer.mlp for layer in engine.model.layers]
    for index, block in enumerate(blocks):
        block.register_forward_hook(lambda _m, args, _out, index=index: rows.setdefault(index, []).append(len(args[0])))
    warm_up.warm_up_kernels(engine)
    assert asked == [(4, 2, torch.float32, engine.scheduler.config.max_num_batched_tokens)]
    tile_runs = {index: [n for n in seen if n in (2, 5, 9)] for index, seen in rows.items()}
    assert sorted(tile_runs.values()) == [[], [2, 5, 9]]


def test_token_counts_reach_every_tile_shape_the_experts_pick_on_a_gpu() -> None:
    gpu = torch.device("cuda")  # choose_tiles only reads the device's type: no GPU is touched
    for num_experts, top_k, max_tokens in [(128, 8, 8192), (32, 4, 8192), (8, 2, 64), (64, 8, 100)]:
        counts = triton_moe.token_counts_for_each_tile(num_experts, top_k, torch.bfloat16, gpu, max_tokens)
        every = {triton_moe.choose_tiles(n * top_k, num_experts, torch.bfloat16, gpu) for n in range(1, max_tokens + 1)}
        picked = [triton_moe.choose_tiles(n * top_k, num_experts, torch.bfloat16, gpu) for n in counts]
        assert counts[0] == 1 and max(counts) <= max_tokens
        assert len(set(picked)) == len(picked) == len(every)  # one count per shape, and every shape
    assert triton_moe.token_counts_for_each_tile(128, 8, torch.bfloat16, gpu, 8192) == [1, 257, 1025]
    assert triton_moe.token_counts_for_each_tile(128, 8, torch.bfloat16, torch.device("cpu"), 8192) == [1]
    # The warm-up asks the backend: Triton's are these counts, a backend that compiles nothing has none.
    assert TritonBackend().moe_token_counts_to_compile(128, 8, torch.bfloat16, gpu, 8192) == [1, 257, 1025]
    assert TorchBackend().moe_token_counts_to_compile(128, 8, torch.bfloat16, gpu, 8192) == []


@pytest.mark.parametrize(
    "kernel,argument",
    [
        (triton_attention.decode_attention_kernel, "page_table_stride"),  # the widest page table in a batch
        (triton_attention.prefill_attention_kernel, "page_table_stride"),
        (triton_moe.expert_gate_up_kernel, "num_pairs"),  # tokens x top-k
        (triton_moe.expert_down_kernel, "num_pairs"),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_integers_that_change_between_steps_are_not_in_a_kernel_signature(kernel: Any, argument: str) -> None:
    # Under the interpreter the kernels keep what triton.jit was given; on a GPU the warm-up test counts compiles.
    assert argument in kernel.arg_names
    assert argument in kernel.kwargs["do_not_specialize"]

"""The whole engine on a GPU with the Triton backend equals ``transformers`` on the same weights.

A dense Llama, a Qwen3-MoE (dense and sparse layers) and a GPT-OSS (sliding
windows shorter than most prompts, sinks, biased clamped experts) checkpoint,
float32: greedy tokens equal transformers' (run on the CPU) for 11 prompts of
1-300 tokens decoded together, prefilled in 64-token chunks, and again with
their full pages served from the prefix cache; the last prompt position's
logits within 1e-4 relative. The fused-MoE, paged-attention, norm and rotary
kernels run compiled, not interpreted. Again after the start-up warm-up, whose
decode steps replay CUDA graphs (but GPT-OSS's, whose window layers keep a
cache of their own). Skipped without a GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm GPU", allow_module_level=True)
pytest.importorskip("triton")
from hf_models import make_hf_checkpoint, parity_prompts, transformers_reference
from moe_models import make_moe_checkpoint

from rayturn.engine import LLMEngine, SamplingParams
from rayturn.engine.warm_up import warm_up_kernels

transformers = pytest.importorskip("transformers")

MAX_NEW_TOKENS = 8
PAGE_SIZE = 16
DEVICE, BACKEND = "cuda", "triton"
ARCHITECTURES = ["llama", "qwen3moe-e8-top2-norm-step2", "gptoss-e8-top3-window32-gqa4"]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        path = make_hf_checkpoint("llama", directory)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return model, path
    return make_moe_checkpoint(request.param, directory)


def gpu_engine(path: Path, max_batched: int = 64) -> LLMEngine:
    engine = LLMEngine.from_pretrained(
        str(path),
        backend=BACKEND,
        dtype="float32",
        page_size=PAGE_SIZE,
        enable_prefix_caching=True,
        max_num_batched_tokens=max_batched,
        device=DEVICE,
    )
    assert engine.backend.name == BACKEND and engine.device.type == DEVICE
    return engine


def test_greedy_tokens_and_logits_equal_transformers(checkpoint: tuple[Any, Path]) -> None:
    model, path = checkpoint
    prompts = parity_prompts()
    expected_tokens, expected_logits = transformers_reference(model, prompts, MAX_NEW_TOKENS)
    engine = gpu_engine(path)
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    assert [list(out.token_ids) for out in engine.generate(prompts, params)] == expected_tokens
    again = engine.generate(prompts, params)  # all but each prompt's last page from the prefix cache
    assert [list(out.token_ids) for out in again] == expected_tokens
    assert [out.num_cached_prompt_tokens for out in again] == [(len(p) - 1) // PAGE_SIZE * PAGE_SIZE for p in prompts]

    # Every prompt in one batched step (no chunking): the logits at each prompt's last position.
    engine = gpu_engine(path, max_batched=4096)
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    out = engine.runner.run(engine.scheduler.schedule().chunks)
    assert len(out.sampled) == len(prompts)
    row = {chunk.seq.request_id: i for i, chunk in enumerate(out.sampled)}
    for i, theirs in enumerate(expected_logits):
        ours = out.logits[row[str(i)]].float().cpu()
        relative = (ours - theirs).abs().max() / theirs.abs().max()
        assert relative < 1e-4, f"prompt {i}: relative logits error {relative:.2e}"


def test_greedy_tokens_equal_transformers_with_decode_graphs(checkpoint: tuple[Any, Path]) -> None:
    model, path = checkpoint
    prompts = parity_prompts()
    expected_tokens, _ = transformers_reference(model, prompts, MAX_NEW_TOKENS)
    engine = gpu_engine(path)
    warm_up_kernels(engine)
    graphs = engine.runner.decode_graphs
    if engine.runner.window_cache is not None:
        assert graphs is None  # every step eager
    else:
        assert graphs is not None and graphs.captured
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    assert [list(out.token_ids) for out in engine.generate(prompts, params)] == expected_tokens
    for prompt, tokens in zip(prompts, expected_tokens):  # one at a time: batches of one, replayed
        assert list(engine.generate([prompt], params)[0].token_ids) == tokens
    if graphs is not None:
        assert graphs.num_replays >= len(prompts) * (MAX_NEW_TOKENS - 1)

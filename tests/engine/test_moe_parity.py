"""Mixture-of-experts models (Mixtral, Qwen3-MoE): greedy outputs and logits equal transformers' on the same weights.

The random checkpoints vary the number of experts, top-k, renormalised or raw
top-k probabilities, and dense MLP layers between sparse ones; one is also
saved in the stacked-experts layout transformers keeps in memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hf_models import check_greedy_parity, parity_prompts, transformers_reference
from moe_models import MOE_ARCHITECTURES, make_moe_checkpoint
from safetensors import safe_open
from safetensors.torch import save_file

from rayturn.engine import LLMEngine, SamplingParams

transformers = pytest.importorskip("transformers")

MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module", params=sorted(MOE_ARCHITECTURES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    return make_moe_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def reference(checkpoint: tuple[Any, Path]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """transformers' greedy continuations and last-position prompt logits, one prompt at a time."""
    model, _ = checkpoint
    return transformers_reference(model, parity_prompts(), MAX_NEW_TOKENS)


def test_checkpoint_stores_one_tensor_per_expert(checkpoint: tuple[Any, Path]) -> None:
    _, path = checkpoint
    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    assert any(".experts.0." in name for name in names)
    assert not any(name.endswith(".experts.gate_up_proj") for name in names)


@pytest.mark.parametrize(
    "backend,prefix_caching,max_batched",
    [("torch", True, 2048), ("torch", False, 2048), ("cpu", True, 64)],
    ids=["cache-on", "cache-off", "cpu-cache-on-chunked"],
)
def test_greedy_matches_transformers(
    checkpoint: tuple[Any, Path],
    reference: tuple[list[list[int]], list[torch.Tensor]],
    backend: str,
    prefix_caching: bool,
    max_batched: int,
) -> None:
    _, path = checkpoint
    expected, _ = reference
    check_greedy_parity(path, parity_prompts(), expected, backend, prefix_caching, max_batched, MAX_NEW_TOKENS)


def prompt_logits(path: Path) -> list[torch.Tensor]:
    """The engine's last-position logits of every prompt, all prompts in one batched step."""
    engine = LLMEngine.from_pretrained(str(path), backend="torch", dtype="float32")
    prompts = parity_prompts()
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    step = engine.scheduler.schedule()
    out = engine.runner.run(step.chunks)
    assert len(out.sampled) == len(prompts)
    order = {chunk.seq.request_id: row for row, chunk in enumerate(out.sampled)}
    return [out.logits[order[str(i)]] for i in range(len(prompts))]


def test_prompt_logits_match_transformers(
    checkpoint: tuple[Any, Path], reference: tuple[list[list[int]], list[torch.Tensor]]
) -> None:
    _, path = checkpoint
    _, expected_logits = reference
    for i, (ours, theirs) in enumerate(zip(prompt_logits(path), expected_logits, strict=True)):
        relative = (ours - theirs).abs().max() / theirs.abs().max()
        assert relative < 1e-4, f"prompt {i}: relative logits error {relative:.2e}"


def test_stacked_expert_checkpoint_loads_the_same(checkpoint: tuple[Any, Path], tmp_path: Path) -> None:
    """A checkpoint holding transformers' in-memory names (``experts.gate_up_proj`` [E, 2I, H]) gives equal logits."""
    model, path = checkpoint
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    for file in path.iterdir():
        if file.suffix != ".safetensors":
            (tmp_path / file.name).write_bytes(file.read_bytes())
    for ours, stacked in zip(prompt_logits(path), prompt_logits(tmp_path), strict=True):
        torch.testing.assert_close(stacked, ours, rtol=0, atol=0)

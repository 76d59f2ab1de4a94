"""Greedy outputs and logits equal Hugging Face transformers' on the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_models import (
    ARCHITECTURES,
    check_greedy_parity,
    make_hf_checkpoint,
    parity_prompts,
    transformers_reference,
)

from rayturn.engine import LLMEngine, SamplingParams

transformers = pytest.importorskip("transformers")

MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    arch = request.param
    return arch, make_hf_checkpoint(arch, tmp_path_factory.mktemp(arch))


@pytest.fixture(scope="module")
def reference(checkpoint: tuple[str, Path]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """HF greedy continuations and last-position prompt logits, one prompt at a time (no padding)."""
    _, path = checkpoint
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    return transformers_reference(model, parity_prompts(), MAX_NEW_TOKENS)


@pytest.mark.parametrize(
    "backend,prefix_caching,max_batched",
    [("torch", True, 2048), ("torch", False, 2048), ("torch", True, 64), ("cpu", True, 2048), ("cpu", True, 64)],
    ids=["cache-on", "cache-off", "cache-on-chunked", "cpu-cache-on", "cpu-cache-on-chunked"],
)
def test_greedy_matches_transformers(
    checkpoint: tuple[str, Path],
    reference: tuple[list[list[int]], list[torch.Tensor]],
    backend: str,
    prefix_caching: bool,
    max_batched: int,
) -> None:
    _, path = checkpoint
    expected, _ = reference
    check_greedy_parity(path, parity_prompts(), expected, backend, prefix_caching, max_batched, MAX_NEW_TOKENS)


def test_prompt_logits_match_transformers(
    checkpoint: tuple[str, Path], reference: tuple[list[list[int]], list[torch.Tensor]]
) -> None:
    _, path = checkpoint
    _, expected_logits = reference
    engine = LLMEngine.from_pretrained(str(path), backend="torch", dtype="float32")
    for prompt in parity_prompts():
        engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    step = engine.scheduler.schedule()  # one batched step covers every prompt
    out = engine.runner.run(step.chunks)
    sampled, logits = out.sampled, out.logits
    assert len(sampled) == len(expected_logits)
    order = {chunk.seq.request_id: row for row, chunk in enumerate(sampled)}
    for i, reference_logits in enumerate(expected_logits):
        ours = logits[order[str(i)]]
        relative = (ours - reference_logits).abs().max() / reference_logits.abs().max()
        assert relative < 1e-4, f"prompt {i}: relative logits error {relative:.2e}"

"""Guided decoding with logits on a GPU: the mask unpacked on the device equals the CPU's, and a guided
engine there keeps to its schema. Skipped without a GPU."""

from __future__ import annotations

import json

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm GPU", allow_module_level=True)

from rayturn.engine import Guide, LLMEngine, SamplingParams
from rayturn.engine.guided import GuideCompiler, mask_guided_logits

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green"]}, "count": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["color", "count"],
    "additionalProperties": False,
}


def test_device_mask_equals_the_cpu_mask() -> None:
    engine = LLMEngine.from_pretrained("tiny", backend="torch", device="cpu")
    vocab_size = 1000  # wider than the tokenizer, and not a multiple of 32
    compiler = GuideCompiler(engine.tokenizer, vocab_size, engine.eos_token_ids)
    states = [compiler.start(Guide.json_schema(SCHEMA)), None, compiler.start(Guide.regex("[a-c]+"))]
    logits = torch.randn(3, vocab_size)
    on_cpu = mask_guided_logits(logits, states)
    on_gpu = mask_guided_logits(logits.cuda(), states)
    assert torch.equal(on_gpu.cpu(), on_cpu)


def test_a_guided_engine_on_the_gpu_keeps_to_its_schema() -> None:
    engine = LLMEngine.from_pretrained("tiny", backend="torch", device="cuda")
    guide = Guide.json_schema(SCHEMA)
    params = [SamplingParams(max_tokens=48, temperature=1.0, seed=seed, guide=guide) for seed in range(4)]
    for out in engine.generate(["gpu"] * 5, [SamplingParams(max_tokens=48, temperature=0.0, guide=guide), *params]):
        value = json.loads(out.text)
        assert out.finish_reason == "stop" and value["color"] in ("red", "green") and 0 <= value["count"] <= 9

"""GPT-OSS: greedy outputs and logits equal transformers' on the same weights, unquantised and MXFP4.

The random checkpoints have sliding windows shorter than most prompts (one
layer pattern alternating, one mostly sliding), nonzero sinks and biases
everywhere, YaRN RoPE, 4 or 8 experts with top-2 or top-3 routing, and a
SwiGLU limit low enough that the clamps change activations.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_models import check_greedy_parity, parity_prompts, transformers_reference
from moe_models import GPT_OSS_ARCHITECTURES, make_moe_checkpoint, make_moe_model
from safetensors.torch import load_file, save_file

from rayturn.engine import LLMEngine, SamplingParams, mxfp4
from rayturn.engine.byte_tokenizer import CHATML_TOOLS_TEMPLATE, save_byte_tokenizer

transformers = pytest.importorskip("transformers")
mxfp4_integration = pytest.importorskip("transformers.integrations.mxfp4")

MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module", params=sorted(GPT_OSS_ARCHITECTURES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    return make_moe_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def reference(checkpoint: tuple[Any, Path]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """transformers' greedy continuations and last-position prompt logits (its first step's), one prompt at a
    time."""
    model, _ = checkpoint
    return transformers_reference(model, parity_prompts(1), MAX_NEW_TOKENS)


def test_checkpoint_has_sinks_windows_and_yarn(checkpoint: tuple[Any, Path]) -> None:
    _, path = checkpoint
    config = json.loads((path / "config.json").read_text())
    assert "sliding_attention" in config["layer_types"] and config["sliding_window"] <= 32
    assert config["rope_parameters"]["rope_type"] == "yarn"
    engine = LLMEngine.from_pretrained(str(path), backend="torch", dtype="float32")
    layers = engine.runner.model.layers
    assert all(layer.self_attn.sinks is not None and layer.self_attn.sinks.abs().min() > 0 for layer in layers)
    windows = [layer.self_attn.sliding_window for layer in layers]
    window = config["sliding_window"]
    assert windows == [window if kind == "sliding_attention" else None for kind in config["layer_types"]]


@pytest.mark.parametrize(
    "backend,prefix_caching,max_batched",
    [("torch", True, 2048), ("torch", False, 2048), ("cpu", True, 48)],
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
    check_greedy_parity(path, parity_prompts(1), expected, backend, prefix_caching, max_batched, MAX_NEW_TOKENS)


def prompt_logits(path: Path, backend: str = "torch") -> list[torch.Tensor]:
    """The engine's last-position logits of every prompt, all prompts in one batched step."""
    engine = LLMEngine.from_pretrained(str(path), backend=backend, dtype="float32")
    prompts = parity_prompts(1)
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    step = engine.scheduler.schedule()
    out = engine.runner.run(step.chunks)
    assert len(out.sampled) == len(prompts)
    order = {chunk.seq.request_id: row for row, chunk in enumerate(out.sampled)}
    return [out.logits[order[str(i)]] for i in range(len(prompts))]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_prompt_logits_match_transformers(
    checkpoint: tuple[Any, Path], reference: tuple[list[list[int]], list[torch.Tensor]], backend: str
) -> None:
    _, path = checkpoint
    _, expected_logits = reference
    for i, (ours, theirs) in enumerate(zip(prompt_logits(path, backend), expected_logits, strict=True)):
        relative = (ours - theirs).abs().max() / theirs.abs().max()
        assert relative < 1e-4, f"prompt {i}: relative logits error {relative:.2e}"


# ------------------------------------------------------------------------------------------------ MXFP4


def random_mxfp4(shape: tuple[int, ...], generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed blocks [*shape[:-1], shape[-1] // 32, 16] and scales [*shape[:-1], shape[-1] // 32] for a tensor
    of ``shape``; scales of 2**-5 .. 2**-2 keep random weights in a sane range."""
    *rows, columns = shape
    blocks = torch.randint(0, 256, (*rows, columns // 32, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(122, 126, (*rows, columns // 32), generator=generator, dtype=torch.uint8)
    return blocks, scales


def test_dequantize_matches_transformers() -> None:
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(0, 256, (3, 10, 4), generator=generator, dtype=torch.uint8)  # the whole E8M0 range
    for dtype in (torch.float32, torch.bfloat16):
        ours = mxfp4.dequantize(blocks, scales, dtype).transpose(1, 2)
        theirs = mxfp4_integration.convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        assert ours.shape == theirs.shape == (3, 128, 10)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)


def test_dequantize_refuses_mismatched_scales() -> None:
    blocks = torch.zeros(2, 3, 4, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"MXFP4 blocks \(2, 3, 4, 16\) do not match scales \(2, 3, 5\)"):
        mxfp4.dequantize(blocks, torch.zeros(2, 3, 5, dtype=torch.uint8))


@pytest.fixture(scope="module")
def mxfp4_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same random weights twice: experts MXFP4-packed (``*_blocks``/``*_scales``, quantization_config) and
    dequantised by transformers' own helper into a plain checkpoint."""
    arch = sorted(GPT_OSS_ARCHITECTURES)[0]
    model = make_moe_model(arch)
    generator = torch.Generator().manual_seed(3)
    packed: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            experts = layer.mlp.experts
            for name in ("gate_up_proj", "down_proj"):
                weight = getattr(experts, name)  # [E, in, out]; packed as [E, out, in]
                blocks, scales = random_mxfp4(tuple(weight.transpose(1, 2).shape), generator)
                weight.copy_(mxfp4_integration.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                packed[f"model.layers.{index}.mlp.experts.{name}_blocks"] = blocks
                packed[f"model.layers.{index}.mlp.experts.{name}_scales"] = scales
    plain = tmp_path_factory.mktemp("gptoss-plain")
    model.save_pretrained(plain)
    save_byte_tokenizer(plain, CHATML_TOOLS_TEMPLATE)

    quantized = tmp_path_factory.mktemp("gptoss-mxfp4")
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    for name in list(state):
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            del state[name]
    save_file({**state, **packed}, str(quantized / "model.safetensors"))
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (quantized / "config.json").write_text(json.dumps(config))
    save_byte_tokenizer(quantized, CHATML_TOOLS_TEMPLATE)
    return plain, quantized


def test_mxfp4_checkpoint_loads_as_the_dequantised_one(mxfp4_checkpoints: tuple[Path, Path]) -> None:
    plain, quantized = mxfp4_checkpoints
    for ours, dequantised in zip(prompt_logits(quantized), prompt_logits(plain), strict=True):
        torch.testing.assert_close(ours, dequantised, rtol=0, atol=0)
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = parity_prompts(1)[:4]
    outputs = [
        [list(o.token_ids) for o in LLMEngine.from_pretrained(str(path), dtype="float32").generate(prompts, params)]
        for path in (quantized, plain)
    ]
    assert outputs[0] == outputs[1]


def test_mxfp4_checkpoint_missing_scales_is_named(mxfp4_checkpoints: tuple[Path, Path], tmp_path: Path) -> None:
    _, quantized = mxfp4_checkpoints
    tensors = load_file(str(quantized / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    for file in quantized.iterdir():
        if file.suffix != ".safetensors":
            (tmp_path / file.name).write_bytes(file.read_bytes())
    unpaired = r"without their blocks or scales: model\.layers\.1\.mlp\.experts\.down_proj_blocks"
    with pytest.raises(ValueError, match=unpaired):
        LLMEngine.from_pretrained(str(tmp_path), backend="torch")

"""The Triton mixture-of-experts MLP against the torch reference, with small shapes.

Without a GPU the kernels run on CPU tensors under the Triton interpreter
(``tests/conftest.py`` sets TRITON_INTERPRET before Triton is imported) with
16-row blocks, so token counts of 1 to 37 cover partial blocks, several blocks
per expert and experts with no tokens.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from triton_cases import MoeSpec, check_fused_moe, make_moe_case

from rayturn.kernels import moe, triton_moe
from rayturn.kernels.triton_backend import TritonBackend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def backend() -> TritonBackend:
    return TritonBackend()


def test_kernels_run_on_this_device() -> None:
    """The cases below test the kernels, not the fallback: here they run natively or under the interpreter."""
    assert triton_moe.kernels_run_on(torch.device(DEVICE))


@pytest.mark.parametrize(
    "spec",
    [
        MoeSpec(1, 32, 32, 4, 1),
        # 37 tokens: partial blocks; hidden 48 and intermediate 40 end mid-tile.
        MoeSpec(37, 48, 40, 8, 2, biased=True),
        MoeSpec(37, 64, 96, 8, 3, biased=True, clamped_swiglu=True),
        MoeSpec(13, 32, 48, 4, 2, renormalize=False, clamped_swiglu=True),
        MoeSpec(20, 64, 32, 6, 3, biased=True, idle_expert=2),
        MoeSpec(5, 32, 40, 5, 2, renormalize=False, idle_expert=0),
        MoeSpec(3, 32, 32, 4, 4),  # every expert for every token
        MoeSpec(11, 48, 40, 4, 2, biased=True, transposed_weights=True),
        MoeSpec(0, 32, 32, 4, 2),
    ],
    ids=lambda spec: spec.label,
)
def test_fused_moe_matches_reference(backend: TritonBackend, spec: MoeSpec) -> None:
    check_fused_moe(backend, spec, torch.float32, DEVICE)


def test_fused_moe_in_float16(backend: TritonBackend) -> None:
    spec = MoeSpec(9, 32, 40, 4, 2, biased=True, clamped_swiglu=True)
    check_fused_moe(backend, spec, torch.float16, DEVICE)


def test_transposed_weights_reach_the_kernels_as_strided_views() -> None:
    case = make_moe_case(MoeSpec(2, 32, 32, 4, 2, transposed_weights=True), torch.float32, DEVICE, torch.Generator())
    assert not case.gate_up.is_contiguous() and not case.down.is_contiguous()


def test_align_to_blocks_pads_each_expert_to_whole_blocks() -> None:
    expert_ids = torch.tensor([[2, 0], [2, 3], [0, 2]])  # pairs 0..5: experts 2, 0, 2, 3, 0, 2
    blocks = triton_moe.align_to_blocks(expert_ids, num_experts=5, block_rows=2)
    pad = 6  # num_pairs marks a padding row
    assert blocks.max_blocks == 3 + 5  # ceil(6 / 2) + min(5 experts, 6 pairs)
    # Expert 0: pairs 1, 4; expert 1: none; expert 2: pairs 0, 2, 5 and a pad; expert 3: pair 3 and a pad.
    assert blocks.sorted_pair_ids.tolist() == [1, 4, 0, 2, 5, pad, 3, pad] + [pad] * 8
    assert blocks.block_experts.tolist() == [0, 2, 2, 3, -1, -1, -1, -1]


def test_align_to_blocks_with_one_expert_taking_every_pair() -> None:
    expert_ids = torch.full((5, 1), 3)
    blocks = triton_moe.align_to_blocks(expert_ids, num_experts=4, block_rows=4)
    assert blocks.sorted_pair_ids.tolist()[:8] == [0, 1, 2, 3, 4, 5, 5, 5]
    assert blocks.block_experts.tolist() == [3, 3, -1, -1, -1, -1]


def test_falls_back_on_the_reference_where_the_kernels_cannot_run(
    backend: TritonBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = MoeSpec(7, 32, 40, 4, 2, biased=True, clamped_swiglu=True)
    case = make_moe_case(spec, torch.float32, "cpu", torch.Generator().manual_seed(0))

    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("the Triton path ran")

    monkeypatch.setattr(triton_moe, "kernels_run_on", lambda device: False)
    monkeypatch.setattr(triton_moe, "fused_moe", refuse)
    assert case.activation is not None
    expected = moe.fused_moe(
        case.x,
        case.router_logits,
        case.gate_up,
        case.down,
        spec.top_k,
        spec.renormalize,
        case.activation,
        case.gate_up_bias,
        case.down_bias,
    )
    torch.testing.assert_close(case.run(backend, spec), expected)


def test_refuses_weights_of_another_dtype(backend: TritonBackend) -> None:
    case = make_moe_case(MoeSpec(3, 32, 32, 4, 2), torch.float32, DEVICE, torch.Generator())
    with pytest.raises(ValueError, match="dtype of x"):
        triton_moe.fused_moe(case.x, case.router_logits, case.gate_up.half(), case.down.half(), 2, True)


def test_refuses_a_gate_up_of_the_wrong_shape(backend: TritonBackend) -> None:
    case = make_moe_case(MoeSpec(3, 32, 32, 4, 2), torch.float32, DEVICE, torch.Generator())
    with pytest.raises(ValueError, match=r"gate_up must be \[4, 64, 32\]"):
        triton_moe.fused_moe(case.x, case.router_logits, case.gate_up[:, :48], case.down, 2, True)

"""Mixture-of-experts ops against a naive loop over tokens and their chosen experts, in every CPU backend."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from rayturn.kernels import KernelBackend, moe, native_moe
from rayturn.kernels.cpu_backend import CpuBackend
from rayturn.kernels.torch_backend import TorchBackend

from .triton_cases import count_native_calls

HIDDEN = 24
INTERMEDIATE = 20


def naive_moe(
    x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int, renormalize: bool
) -> torch.Tensor:
    """Per token: softmax, pick the top_k experts one by one, run each expert's MLP, sum weighted."""
    out = torch.zeros_like(x)
    for token in range(x.shape[0]):
        probs = torch.softmax(logits[token].double(), dim=-1)
        chosen = sorted(range(probs.numel()), key=lambda e: -probs[e].item())[:top_k]
        total = sum(probs[e].item() for e in chosen) if renormalize else 1.0
        for expert in chosen:
            gate, up = (gate_up[expert] @ x[token]).chunk(2)
            out[token] += (probs[expert].item() / total) * (down[expert] @ (F.silu(gate) * up))
    return out


def make_case(
    num_tokens: int, num_experts: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=generator)
    logits = torch.randn(num_tokens, num_experts, generator=generator) * 2
    gate_up = torch.randn(num_experts, 2 * INTERMEDIATE, HIDDEN, generator=generator) * 0.2
    down = torch.randn(num_experts, HIDDEN, INTERMEDIATE, generator=generator) * 0.2
    return x, logits, gate_up, down


@pytest.mark.parametrize("backend", [TorchBackend(), CpuBackend()], ids=lambda b: b.name)
@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,renormalize",
    [(37, 4, 2, True), (37, 8, 1, False), (50, 8, 2, False), (3, 8, 2, True), (1, 4, 4, True), (0, 4, 2, True)],
)
def test_fused_moe_matches_naive_loop(
    backend: KernelBackend, num_tokens: int, num_experts: int, top_k: int, renormalize: bool
) -> None:
    x, logits, gate_up, down = make_case(num_tokens, num_experts)
    out = backend.fused_moe(x, logits, gate_up, down, top_k, renormalize)
    torch.testing.assert_close(out, naive_moe(x, logits, gate_up, down, top_k, renormalize), rtol=1e-5, atol=1e-5)


def test_fused_moe_in_bfloat16_stays_close_to_float32() -> None:
    x, logits, gate_up, down = make_case(40, 8)
    expected = naive_moe(x, logits, gate_up, down, 2, True)
    out = TorchBackend().fused_moe(x.bfloat16(), logits.bfloat16(), gate_up.bfloat16(), down.bfloat16(), 2, True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=0.05, atol=0.05)


def test_route_top_k_softmaxes_over_all_experts_then_picks() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 3.5, -2.0, 0.5]])
    probs = torch.softmax(logits, dim=-1)
    weights, expert_ids = moe.route_top_k(logits, 2, renormalize=False)
    assert expert_ids.tolist() == [[1, 2], [1, 0]]
    torch.testing.assert_close(weights, probs.gather(1, expert_ids))
    renormalized, _ = moe.route_top_k(logits, 2, renormalize=True)
    torch.testing.assert_close(renormalized, weights / weights.sum(-1, keepdim=True))
    assert weights.dtype == torch.float32 and expert_ids.dtype == torch.int64


@pytest.mark.parametrize("top_k", [0, 5])
def test_route_top_k_refuses_a_top_k_outside_the_experts(top_k: int) -> None:
    with pytest.raises(ValueError, match=r"top_k must be in 1\.\.4"):
        moe.route_top_k(torch.zeros(2, 4), top_k, renormalize=True)


def test_permutation_groups_rows_by_expert_without_padding() -> None:
    expert_ids = torch.tensor([[2, 0], [2, 3], [0, 2]])
    permutation = moe.permute_by_expert(expert_ids, num_experts=5)
    assert permutation.group_sizes == (2, 0, 3, 1, 0)
    assert permutation.token_index.numel() == expert_ids.numel()  # one row per (token, slot), no padding
    grouped = expert_ids.reshape(-1)[permutation.slot_index]
    assert grouped.tolist() == [0, 0, 2, 2, 2, 3]
    assert permutation.token_index.tolist() == [0, 2, 0, 1, 2, 1]  # token order kept inside a group


@pytest.mark.parametrize("one_grouped_mm", [True, False], ids=["grouped-mm", "matmul-per-expert"])
def test_grouped_expert_mlp_runs_each_expert_on_its_rows_only(
    one_grouped_mm: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, gate_up, down = make_case(0, 3)
    if one_grouped_mm and not moe._grouped_mm_runs(torch.empty(0), gate_up):
        pytest.skip("this torch has no F.grouped_mm")
    monkeypatch.setattr(moe, "_grouped_mm_runs", lambda rows, weight: one_grouped_mm)
    rows = torch.randn(5, HIDDEN)
    group_sizes = (2, 0, 3)
    out = moe.grouped_expert_mlp(rows, group_sizes, gate_up, down, lambda gate, up: F.silu(gate) * up)
    owners = [0, 0, 2, 2, 2]
    for row, expert in enumerate(owners):
        gate, up = (gate_up[expert] @ rows[row]).chunk(2)
        torch.testing.assert_close(out[row], down[expert] @ (F.silu(gate) * up), rtol=1e-5, atol=1e-5)


def test_unpermute_sums_each_tokens_rows_weighted() -> None:
    expert_ids = torch.tensor([[1, 0], [0, 1]])
    weights = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    permutation = moe.permute_by_expert(expert_ids, num_experts=2)
    expert_out = torch.tensor([[1.0], [10.0], [100.0], [1000.0]])  # rows: (t0, e0), (t1, e0), (t0, e1), (t1, e1)
    out = moe.unpermute(expert_out, permutation, weights, num_tokens=2)
    assert out.tolist() == [[0.25 * 1 + 0.75 * 100], [0.5 * 10 + 0.5 * 1000]]


def naive_gpt_oss_moe(
    x: torch.Tensor,
    logits: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_bias: torch.Tensor,
    down_bias: torch.Tensor,
    top_k: int,
    activation: moe.ClampedSwiGLU,
) -> torch.Tensor:
    """GPT-OSS's routing as it is written: top-k of the raw logits, softmax among those; biased experts."""
    out = torch.zeros_like(x)
    for token in range(x.shape[0]):
        top_logits, chosen = torch.topk(logits[token], top_k)
        for weight, expert in zip(torch.softmax(top_logits, dim=0), chosen.tolist()):
            gate, up = (gate_up[expert] @ x[token] + gate_up_bias[expert]).chunk(2)
            gate, up = gate.clamp(max=activation.limit), up.clamp(-activation.limit, activation.limit)
            hidden = (up + 1) * gate * torch.sigmoid(activation.alpha * gate)
            out[token] += weight * (down[expert] @ hidden + down_bias[expert])
    return out


@pytest.mark.parametrize("backend", [TorchBackend(), CpuBackend()], ids=lambda b: b.name)
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(37, 4, 2), (20, 8, 3), (1, 4, 4), (0, 4, 2)])
def test_biased_experts_with_clamped_swiglu_match_naive_loop(
    backend: KernelBackend, num_tokens: int, num_experts: int, top_k: int
) -> None:
    x, logits, gate_up, down = make_case(num_tokens, num_experts)
    generator = torch.Generator().manual_seed(1)
    gate_up_bias = torch.randn(num_experts, 2 * INTERMEDIATE, generator=generator)
    down_bias = torch.randn(num_experts, HIDDEN, generator=generator)
    activation = moe.ClampedSwiGLU(alpha=1.702, limit=0.8)  # low enough that both clamps bite
    out = backend.fused_moe(x, logits, gate_up, down, top_k, True, gate_up_bias, down_bias, activation)
    expected = naive_gpt_oss_moe(x, logits, gate_up, down, gate_up_bias, down_bias, top_k, activation)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_clamped_swiglu_clamps_gate_above_and_up_on_both_sides() -> None:
    activation = moe.ClampedSwiGLU(alpha=1.0, limit=2.0)
    gate = torch.tensor([5.0, -5.0, 1.0])
    up = torch.tensor([-9.0, 9.0, 0.5])

    def glu(g: float) -> float:
        return g / (1 + math.exp(-g))

    # gate 5 -> 2 and up -9 -> -2; gate -5 stays (no lower clamp) and up 9 -> 2; nothing clamped.
    expected = torch.tensor([(-2 + 1) * glu(2.0), (2 + 1) * glu(-5.0), (0.5 + 1) * glu(1.0)])
    torch.testing.assert_close(activation(gate, up), expected)


@pytest.mark.parametrize(
    ("group_sizes", "out_features", "in_features"),
    [
        ((3, 0, 5, 1), 40, 32),  # an expert with no rows; outputs not a multiple of 16
        ((4,) * 16, 512, 256),  # a decode step of the MoE benchmark's shape
        ((0, 0, 2), 17, 48),
        ((1,), 1, 16),
    ],
)
def test_native_grouped_matmul_matches_torchs(
    group_sizes: tuple[int, ...], out_features: int, in_features: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = CpuBackend()
    calls = count_native_calls(backend, "grouped_matmul_f32", monkeypatch)
    generator = torch.Generator().manual_seed(len(group_sizes))
    rows = torch.randn(sum(group_sizes), in_features, generator=generator)
    weight = torch.randn(len(group_sizes), out_features, in_features, generator=generator)
    out = backend.grouped_matmul(rows, weight, group_sizes)
    assert len(calls) == 1
    torch.testing.assert_close(out, moe.grouped_matmul(rows, weight, group_sizes), rtol=1e-5, atol=1e-4)


def test_native_grouped_matmul_serves_decode_steps_and_leaves_prefill_to_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A whole MoE MLP on the cpu backend equals the naive loop both ways: few rows per expert through the
    native kernel, prefill-sized groups (over 32 rows per expert on average) through torch's."""
    backend = CpuBackend()
    calls = count_native_calls(backend, "grouped_matmul_f32", monkeypatch)
    generator = torch.Generator().manual_seed(7)
    hidden, intermediate, num_experts = 32, 48, 4
    gate_up = torch.randn(num_experts, 2 * intermediate, hidden, generator=generator) * 0.2
    down = torch.randn(num_experts, hidden, intermediate, generator=generator) * 0.2
    for num_tokens, native_calls in ((9, 2), (200, 0)):  # 18 rows over 4 experts; 400 rows
        calls.clear()
        x = torch.randn(num_tokens, hidden, generator=generator)
        logits = torch.randn(num_tokens, num_experts, generator=generator) * 2
        out = backend.fused_moe(x, logits, gate_up, down, 2, True)
        assert len(calls) == native_calls  # gate-up and down
        torch.testing.assert_close(out, naive_moe(x, logits, gate_up, down, 2, True), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "hidden", "biased", "renormalize"),
    [
        (1, 4, 1, 16, False, True),
        (7, 16, 2, 64, False, True),
        (33, 8, 3, 48, True, False),
        (300, 16, 2, 256, False, True),  # past one thread's share of rows
        (5, 3, 3, 32, True, True),  # every expert chosen by every token
        (600, 64, 8, 128, False, False),  # prefill-sized: torch's grouped matmul between the native steps
    ],
)
def test_native_permutation_gives_the_references_bits(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    hidden: int,
    biased: bool,
    renormalize: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cpu backend's MoE layer equals the torch reference's steps run with the same grouped matmul, to the
    bit: rows permuted in the reference's order and each token's weighted rows summed in its order."""
    backend = CpuBackend()
    permutes = count_native_calls(backend, "moe_permute_f32", monkeypatch)
    unpermutes = count_native_calls(backend, "moe_unpermute_f32", monkeypatch)
    generator = torch.Generator().manual_seed(num_tokens)
    intermediate = 32
    x = torch.randn(num_tokens, hidden, generator=generator)
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    gate_up = torch.randn(num_experts, 2 * intermediate, hidden, generator=generator) / hidden**0.5
    down = torch.randn(num_experts, hidden, intermediate, generator=generator) / intermediate**0.5
    gate_up_bias = torch.randn(num_experts, 2 * intermediate, generator=generator) if biased else None
    down_bias = torch.randn(num_experts, hidden, generator=generator) if biased else None
    for activation in (None, moe.ClampedSwiGLU(alpha=1.702, limit=7.0)):
        out = backend.fused_moe(x, logits, gate_up, down, top_k, renormalize, gate_up_bias, down_bias, activation)
        expected = moe.fused_moe(
            x, logits, gate_up, down, top_k, renormalize, activation or backend.silu_and_mul, gate_up_bias,
            down_bias, matmul=backend.grouped_matmul,
        )  # fmt: skip
        assert torch.equal(out, expected)
    assert len(permutes) == len(unpermutes) == 2


def test_native_permute_and_unpermute_match_the_reference_steps() -> None:
    backend = CpuBackend()
    generator = torch.Generator().manual_seed(3)
    num_tokens, num_experts, top_k = 40, 6, 3
    x = torch.randn(num_tokens, 100, generator=generator)[:, 10:74]  # rows further apart than they are long
    weights, expert_ids = moe.route_top_k(torch.randn(num_tokens, num_experts, generator=generator), top_k, True)
    expert_ids[:, 0] = 5  # one expert every token chooses, one (expert 0 or another) maybe none
    rows, slot_index, group_sizes = native_moe.permute(backend.native, x, expert_ids, num_experts)
    reference = moe.permute_by_expert(expert_ids, num_experts)
    assert group_sizes == reference.group_sizes
    assert torch.equal(slot_index, reference.slot_index)
    assert torch.equal(rows, x[reference.token_index])
    expert_out = torch.randn(num_tokens * top_k, 64, generator=generator)
    out = native_moe.unpermute(backend.native, expert_out, slot_index, weights)
    assert torch.equal(out, moe.unpermute(expert_out, reference, weights, num_tokens))


@pytest.mark.parametrize("bad_id", [-1, 4])
def test_native_permutation_refuses_an_expert_id_outside_the_experts(bad_id: int) -> None:
    expert_ids = torch.tensor([[0, 1], [2, bad_id]])
    with pytest.raises(ValueError, match=rf"expert id {bad_id} is outside the layer's experts 0\.\.3"):
        native_moe.permute(CpuBackend().native, torch.randn(2, 16), expert_ids, 4)


@pytest.mark.parametrize("dtype,num_tokens", [(torch.bfloat16, 5), (torch.float32, 0)], ids=["bf16", "no-tokens"])
def test_moe_layers_the_native_steps_do_not_take_are_the_torch_backends(
    dtype: torch.dtype, num_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = CpuBackend()
    calls = count_native_calls(backend, "moe_permute_f32", monkeypatch)
    x, logits, gate_up, down = (t.to(dtype) for t in make_case(num_tokens, 4))
    out = backend.fused_moe(x, logits, gate_up, down, 2, True)
    assert torch.equal(out, TorchBackend().fused_moe(x, logits, gate_up, down, 2, True))
    assert calls == []

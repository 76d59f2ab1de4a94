"""The last layer runs whole only for the rows a step samples: every other row's key and value are written all
the same, and what is sampled is what the whole layer would give."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from rayturn.engine import LLMEngine, SamplingParams
from rayturn.engine import model as model_module
from rayturn.engine.model import CausalLM, SampledRows

PROMPT_LENS = (300, 17, 5, 129)


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 250) for _ in range(length)] for length in PROMPT_LENS]


@pytest.fixture
def whole_last_layer(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The model as it was before: the last layer whole for every row, the sampled rows picked afterwards."""
    forward = CausalLM.forward

    def whole(
        self: CausalLM, ids: torch.Tensor, pos: torch.Tensor, batch: Any, rows: SampledRows | None = None
    ) -> torch.Tensor:
        hidden = forward(self, ids, pos, batch)
        return hidden if rows is None else hidden[rows.index]

    monkeypatch.setattr(model_module.CausalLM, "forward", whole)
    yield


def generate(backend: str, max_batched: int) -> tuple[LLMEngine, list[Any]]:
    engine = LLMEngine.from_pretrained("tiny", backend=backend, dtype="float32", max_num_batched_tokens=max_batched)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3)
    return engine, engine.generate(prompts(), params)


def last_layer_mlp_rows(engine: LLMEngine) -> list[int]:
    """Rows that reach the last layer's MLP, per call (recorded from now on)."""
    seen: list[int] = []
    engine.runner.model.layers[-1].mlp.register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[0]))
    return seen


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("max_batched", [2048, 64], ids=["whole-prompts", "chunked"])
def test_sampling_from_the_rows_alone_gives_the_whole_layers_tokens_and_cache(
    backend: str, max_batched: int, request: pytest.FixtureRequest
) -> None:
    engine, outputs = generate(backend, max_batched)
    request.getfixturevalue("whole_last_layer")
    whole_engine, whole_outputs = generate(backend, max_batched)
    assert [out.token_ids for out in outputs] == [out.token_ids for out in whole_outputs]
    for out, whole in zip(outputs, whole_outputs, strict=True):
        mine_all, theirs_all = out.completions[0].logprobs, whole.completions[0].logprobs
        assert mine_all is not None and theirs_all is not None
        for mine, theirs in zip(mine_all, theirs_all, strict=True):
            assert [token for token, _ in mine.top] == [token for token, _ in theirs.top]
            assert mine.logprob == pytest.approx(theirs.logprob, rel=1e-4, abs=1e-5)
    # Every key and value the whole layer wrote, bit for bit: the rows that skip its attention still fill it.
    assert torch.equal(engine.runner.kv_cache, whole_engine.runner.kv_cache)


def test_only_the_sampled_rows_reach_the_last_layers_attention_and_mlp(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = LLMEngine.from_pretrained("tiny", backend="cpu", dtype="float32", max_num_batched_tokens=64)
    mlp_rows = last_layer_mlp_rows(engine)
    first_mlp_rows: list[int] = []
    engine.runner.model.layers[0].mlp.register_forward_hook(
        lambda _m, args, _out: first_mlp_rows.append(args[0].shape[0])
    )
    prefill_layers: list[int] = []
    attention = model_module.Attention.forward

    def counted(self: Any, *args: Any) -> torch.Tensor:
        prefill_layers.append(self.layer_index)
        return attention(self, *args)

    monkeypatch.setattr(model_module.Attention, "forward", counted)
    engine.generate([prompts()[0]], SamplingParams(max_tokens=1, temperature=0.0))
    num_layers = len(engine.runner.model.layers)
    # A 300-token prompt in chunks of 64: five steps, only the last samples. The first layer's MLP sees every
    # row; the last layer's sees the one sampled row, once, and no step runs its whole attention.
    assert first_mlp_rows == [64, 64, 64, 64, 44]
    assert mlp_rows == [1]
    assert sorted(set(prefill_layers)) == list(range(num_layers - 1))
    # A prompt scored whole (prompt logprobs) needs every row's last hidden state: the layer runs whole.
    engine.generate([prompts()[1]], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
    assert mlp_rows == [1, 17]
    assert prefill_layers.count(num_layers - 1) == 1

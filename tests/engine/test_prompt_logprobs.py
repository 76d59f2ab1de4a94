"""Prompt logprobs equal ``log_softmax`` of Hugging Face transformers' logits on the same weights.

Checked across the paths that would skip or split a prompt's computation:
prefix-cache hits, chunked prefill, forks (n > 1), preemption mid-prompt.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hf_models import VOCAB_SIZE, make_hf_checkpoint

from rayturn.engine import LLMEngine, RequestOutput, SamplingParams
from rayturn.engine import model_runner as model_runner_module
from rayturn.engine.sequence import Sequence

transformers = pytest.importorskip("transformers")

PAGE = 16
NUM_TOP = 3
TOLERANCE = 1e-4


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_SIZE) for _ in range(length)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="module")
def hf_logprobs(checkpoint: Path) -> Callable[[list[int]], torch.Tensor]:
    """A prompt's log-softmaxed logits from transformers, [len(prompt), vocab]: row p scores token p + 1."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()

    def logprobs(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)

    return logprobs


def make_engine(checkpoint: Path, backend: str = "torch", **engine_args: object) -> LLMEngine:
    return LLMEngine.from_pretrained(str(checkpoint), backend=backend, dtype="float32", page_size=PAGE, **engine_args)


def params(**kwargs: object) -> SamplingParams:
    settings: dict[str, object] = {
        "max_tokens": 4,
        "temperature": 0.0,
        "ignore_eos": True,
        "prompt_logprobs": NUM_TOP,
        **kwargs,
    }
    return SamplingParams(**settings)  # type: ignore[arg-type]


def assert_matches(output: RequestOutput, prompt: list[int], reference: torch.Tensor, num_top: int = NUM_TOP) -> None:
    scored = output.prompt_logprobs
    assert scored is not None and len(scored) == len(prompt)
    assert scored[0] is None
    for position in range(1, len(prompt)):
        entry = scored[position]
        assert entry is not None
        row = reference[position - 1]
        assert entry.token_id == prompt[position]
        assert entry.logprob == pytest.approx(row[prompt[position]].item(), abs=TOLERANCE)
        values, ids = row.topk(num_top)
        assert [token for token, _ in entry.top] == ids.tolist(), f"position {position}"
        assert [value for _, value in entry.top] == pytest.approx(values.tolist(), abs=TOLERANCE)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_several_prompts_in_one_batch(
    checkpoint: Path, hf_logprobs: Callable[[list[int]], torch.Tensor], backend: str
) -> None:
    engine = make_engine(checkpoint, backend=backend)
    prompts = [random_prompt(n, seed) for seed, n in enumerate((1, 2, 7, 33, 100))]
    plain = engine.generate(prompts, params(prompt_logprobs=None))
    outs = engine.generate(prompts, params())
    for prompt, out, without in zip(prompts, outs, plain):
        assert_matches(out, prompt, hf_logprobs(prompt))
        assert out.token_ids == without.token_ids  # scoring the prompt changes nothing downstream
        assert without.prompt_logprobs is None


def test_zero_alternatives_and_a_one_token_prompt(
    checkpoint: Path, hf_logprobs: Callable[[list[int]], torch.Tensor]
) -> None:
    engine = make_engine(checkpoint)
    prompt = random_prompt(20, 5)
    single, out = engine.generate([[prompt[0]], prompt], params(prompt_logprobs=0))
    assert single.prompt_logprobs == (None,)
    assert_matches(out, prompt, hf_logprobs(prompt), num_top=0)


def test_a_cached_prefix_is_computed_again_and_then_shared(
    checkpoint: Path, hf_logprobs: Callable[[list[int]], torch.Tensor]
) -> None:
    engine = make_engine(checkpoint)
    first = random_prompt(70, 10)
    (warm,) = engine.generate([first], params(prompt_logprobs=None))
    second = first[:64] + random_prompt(9, 11)  # shares 4 full pages with the first
    (out,) = engine.generate([second], params())
    assert out.num_cached_prompt_tokens == 0
    assert_matches(out, second, hf_logprobs(second))
    # Its pages still went into the prefix cache for the requests after it.
    (again,) = engine.generate([second], params(prompt_logprobs=None))
    assert again.num_cached_prompt_tokens == 64 and again.token_ids == out.token_ids
    assert warm.num_cached_prompt_tokens == 0


def test_chunked_prefill_scores_a_prompt_over_several_steps(
    checkpoint: Path, hf_logprobs: Callable[[list[int]], torch.Tensor]
) -> None:
    engine = make_engine(checkpoint, max_num_batched_tokens=PAGE)
    prompts = [random_prompt(50, 20), random_prompt(37, 21), random_prompt(3, 22)]
    outs = engine.generate(prompts, [params(), params(prompt_logprobs=None), params(prompt_logprobs=1)])
    assert_matches(outs[0], prompts[0], hf_logprobs(prompts[0]))
    assert outs[1].prompt_logprobs is None
    assert_matches(outs[2], prompts[2], hf_logprobs(prompts[2]), num_top=1)


def test_every_output_carries_them_from_the_first(checkpoint: Path) -> None:
    engine = make_engine(checkpoint, max_num_batched_tokens=PAGE)
    prompt = random_prompt(40, 30)
    request_id = engine.add_request(prompt, params(max_tokens=5))
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    assert len(outputs) == 5  # one per token: the prompt's chunks report nothing
    assert all(output.prompt_logprobs is outputs[0].prompt_logprobs for output in outputs)
    assert outputs[0].request_id == request_id and outputs[0].prompt_logprobs is not None


def test_forks_share_the_prompt_scored_once(
    checkpoint: Path, hf_logprobs: Callable[[list[int]], torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    scored_positions: list[int] = []
    score_prompt = model_runner_module.score_prompt

    def counting(*args: object) -> object:
        positions = args[3]
        assert isinstance(positions, range)
        scored_positions.extend(positions)
        return score_prompt(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(model_runner_module, "score_prompt", counting)
    engine = make_engine(checkpoint)
    prompt = random_prompt(45, 40)
    (out,) = engine.generate([prompt], params(n=2, temperature=1.0, seed=3, max_tokens=6))
    assert len(out.completions) == 2
    assert scored_positions == list(range(len(prompt) - 1))
    assert_matches(out, prompt, hf_logprobs(prompt))


def test_a_prompt_preempted_midway_is_scored_in_full(
    checkpoint: Path, hf_logprobs: Callable[[list[int]], torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    # 8 pages: the first request grows to 7 while the second, 6 pages of prompt, is still prefilling.
    engine = make_engine(checkpoint, num_pages=8, max_num_batched_tokens=32, enable_prefix_caching=False)
    preempted: list[tuple[int, int]] = []  # (prompt length, prompt positions scored) of each preempted sequence
    preempt = engine.scheduler._preempt

    def counting(seq: Sequence) -> None:
        preempted.append((seq.num_prompt_tokens, len(seq.prompt_logprobs)))
        preempt(seq)

    monkeypatch.setattr(engine.scheduler, "_preempt", counting)
    growing, scored = random_prompt(40, 50), random_prompt(90, 51)
    alone = make_engine(checkpoint).generate([growing], params(max_tokens=60, prompt_logprobs=None))[0]
    outs = engine.generate([growing, scored], [params(max_tokens=60, prompt_logprobs=None), params(max_tokens=2)])
    assert {length for length, _ in preempted} == {90}
    assert any(1 < num_scored < 90 for _, num_scored in preempted)  # preempted with part of its prompt scored
    assert outs[0].token_ids == alone.token_ids
    assert_matches(outs[1], scored, hf_logprobs(scored))

"""A mixture-of-experts checkpoint served by the cluster: GPT-OSS through Serve, the prefill pool and the store.

A random GPT-OSS model (experts, attention sinks, sliding-window layers with a
window shorter than the prompts, YaRN) saved with ``save_pretrained`` is
served from its directory by one decode and one prefill replica. Every answer
must equal the offline engine's on the same checkpoint (itself equal to
``transformers``, ``tests/engine/test_gptoss_parity.py``): short prompts
prefilled on the decode replica, long ones computed by the prefill pool and
landed through the KV store, and a continued call whose prefix is cached.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from moe_models import make_moe_checkpoint  # noqa: E402
from small_cluster import serving, small_cluster  # noqa: E402

from rayturn.cluster.config import load_config  # noqa: E402
from rayturn.engine import LLMEngine, SamplingParams  # noqa: E402

HTTP_PORT, GRPC_PORT = 28711, 29711
THRESHOLD = 48  # uncached prompt tokens from which the prefill pool computes the prompt
ARCH = "gptoss-e4-top2-window20"
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _, path = make_moe_checkpoint(ARCH, tmp_path_factory.mktemp("gpt-oss") / ARCH)
    return path


@pytest.fixture(scope="module")
def offline(checkpoint: Path) -> LLMEngine:
    return LLMEngine.from_pretrained(str(checkpoint), dtype="float32")


@pytest.fixture(scope="module")
def cluster(checkpoint: Path) -> Iterator[str]:
    config = load_config(**small_cluster(HTTP_PORT, GRPC_PORT, THRESHOLD, **{"model.name": str(checkpoint)}))
    with serving(config) as url:
        yield url


@pytest.fixture(scope="module")
def client(cluster: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster}/v1", api_key="unused", max_retries=0, timeout=120)


def calls_by_path(cluster: str) -> dict[str, float]:
    """Calls the ingress saw prefilled on each path ("local", "disaggregated"): its TTFT histogram's counts."""
    counts: dict[str, float] = {}
    for line in requests.get(f"{cluster}/metrics", timeout=30).text.splitlines():
        if line.startswith("rayturn_time_to_first_token_seconds_count{"):
            path = line.split('path="', 1)[1].split('"', 1)[0]
            counts[path] = counts.get(path, 0.0) + float(line.split()[-1])
    return counts


def expected(offline: LLMEngine, prompt: list[int]) -> list[int]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return list(offline.generate([prompt], params)[0].token_ids)


def served(client: openai.OpenAI, model: str, prompt: list[int]) -> tuple[str, int]:
    """The answer's text and the prompt tokens found cached."""
    response = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    usage = response.usage
    assert usage is not None and usage.completion_tokens == MAX_TOKENS
    details = usage.prompt_tokens_details
    return response.choices[0].text, (details.cached_tokens or 0) if details is not None else 0


def test_gpt_oss_answers_equal_the_offline_engine(cluster: str, client: openai.OpenAI, offline: LLMEngine) -> None:
    model = client.models.list().data[0].id
    short = [(7 * i + 3) % 250 + 5 for i in range(13)]
    long = [(11 * i + 1) % 250 + 5 for i in range(150)]  # past the window (20) and the threshold: the prefill pool
    for prompt, path in ((short, "local"), (long, "disaggregated")):
        before = calls_by_path(cluster).get(path, 0.0)
        text, _ = served(client, model, prompt)
        assert text == offline.tokenizer.decode(expected(offline, prompt)), len(prompt)
        assert calls_by_path(cluster).get(path, 0.0) == before + 1, path
    # The session goes on: the long prompt plus its answer plus a tool result, its prefix found cached.
    answer = expected(offline, long)
    continued = long + answer + [(5 * i + 2) % 250 + 5 for i in range(40)]
    text, cached = served(client, model, continued)
    assert text == offline.tokenizer.decode(expected(offline, continued))
    assert cached >= len(long) // 16 * 16 - 16, cached

"""The cluster spread over Ray nodes: prefill and decode pools pinned to their own node groups.

Three Ray nodes on this host (``ray.cluster_utils.Cluster``): a head node that
runs no pool, a "prefill" node and a "decode" node, told apart by custom
resources the pools ask for. The KV store is forced onto UCX
(``kvstore.transport="ucx"``): the nodes share /dev/shm here, and forcing UCX
makes pages take the cross-node path from the prefill replica's segment to the
decode replica. A long prompt's first call therefore finds every full page of
the prompt cached, all of them loaded from the store, and the answer still
equals the offline engine's.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")

from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from small_cluster import small_cluster  # noqa: E402

from rayturn.cluster.app import serve_start_options  # noqa: E402
from rayturn.cluster.config import load_config  # noqa: E402
from rayturn.cluster.runner import running_cluster  # noqa: E402
from rayturn.engine import LLMEngine, SamplingParams  # noqa: E402

HTTP_PORT, GRPC_PORT = 28461, 29461
PAGE_SIZE = 16
THRESHOLD = 16  # every prompt with a page to compute goes to the prefill pool
OVERRIDES = small_cluster(
    HTTP_PORT,
    GRPC_PORT,
    THRESHOLD,
    **{
        "prefill.resources": {"rayturn-prefill": 1},
        "decode.resources": {"rayturn-decode": 1},
        "kvstore.transport": "ucx",
    },
)


@dataclass(frozen=True)
class Nodes:
    head: str
    prefill: str
    decode: str


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[tuple[Cluster, Nodes]]:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        # The head node advertises itself to bare ``ray.init()`` calls on this host; other
        # Ray users here (another test session, ``rayturn serve``) must not join this cluster.
        ray._common.utils.reset_ray_address()
        prefill = cluster.add_node(num_cpus=1, resources={"rayturn-prefill": 4})
        decode = cluster.add_node(num_cpus=1, resources={"rayturn-decode": 4})
        cluster.wait_for_nodes()
        yield cluster, Nodes(head=cluster.head_node.node_id, prefill=prefill.node_id, decode=decode.node_id)
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def endpoint(ray_cluster: tuple[Cluster, Nodes]) -> Iterator[str]:
    cluster, _ = ray_cluster
    config = load_config(**OVERRIDES)
    ray.init(address=cluster.address, namespace="rayturn", log_to_driver=False)
    try:
        # One proxy, on the head node: proxies on every node would all bind the same ports on this host.
        serve.start(proxy_location="HeadOnly", **serve_start_options(config))
        with running_cluster(config) as endpoints:
            yield endpoints.http
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def client(endpoint: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{endpoint}/v1", api_key="unused", max_retries=0, timeout=120)


PROMPTS = [
    [{"role": "user", "content": "Explain this traceback:\n" + "  File 'app.py', line 12, in main\n" * 4}],
    [{"role": "user", "content": "Write tests for:\n" + "def add(a, b):\n    return a + b\n" * 3}],
]


@pytest.mark.parametrize("messages", PROMPTS, ids=["traceback", "tests"])
def test_pages_computed_on_the_prefill_node_decode_on_the_decode_node(
    client: openai.OpenAI, reference: LLMEngine, messages: list[dict[str, str]]
) -> None:
    prompt = reference.tokenizer.encode_chat(messages)
    expected = reference.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0))[0]
    response = client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=10,
        temperature=0,
    )
    assert response.choices[0].message.content == expected.text
    assert response.usage is not None and response.usage.prompt_tokens == len(prompt)
    # A fresh prompt: the prefill replica computed every page (nothing was cached anywhere) and
    # the decode replica loaded them from the store to decode on.
    assert response.usage.prompt_tokens_details is not None
    assert response.usage.prompt_tokens_details.cached_tokens == 0
    # They landed in the decode replica's cache: the same call again finds every full page there.
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)  # type: ignore[arg-type]
    assert again.choices[0].message.content == expected.text
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == (len(prompt) - 1) // PAGE_SIZE * PAGE_SIZE > 0
    assert getattr(again.usage.prompt_tokens_details, "kv_store_tokens", None) == 0


def test_pools_run_on_their_node_groups(
    endpoint: str, ray_cluster: tuple[Cluster, Nodes], client: openai.OpenAI
) -> None:
    _, nodes = ray_cluster
    client.chat.completions.create(model="tiny", messages=PROMPTS[0], max_tokens=2)  # type: ignore[arg-type]
    health = requests.get(f"{endpoint}/health", timeout=30).json()
    assert health["status"] == "ok"
    details = health["details"]
    assert details["prefill.node_id"] == nodes.prefill
    assert details["decode.node_id"] == nodes.decode
    assert details["decode.disaggregated"] >= 1 and details["prefill.requests"] >= 1
    assert nodes.head not in (details["prefill.node_id"], details["decode.node_id"])

    # The store is the two replicas' segments, one on each node; the prompts' pages sit in them.
    master = ray.get_actor(load_config(**OVERRIDES).kvstore.master_name, namespace="rayturn")
    store = ray.get(master.stats.remote())
    segments = store["segments"].values()
    assert sorted(segment["node_id"] for segment in segments) == sorted([nodes.prefill, nodes.decode])
    # The master sits on the head node, which scaling never removes, whichever replica started it.
    master_id = master._actor_id.hex()
    assert ray._private.state.actors()[master_id]["Address"]["NodeID"] == nodes.head
    assert sum(segment["used_bytes"] for segment in segments) > 0 and store["hits"] > 0


def test_parallel_and_seeded_sampling_take_the_prefill_pools_pages(
    endpoint: str, client: openai.OpenAI, reference: LLMEngine
) -> None:
    """n > 1 and seeded calls are prefilled by the prefill pool too: the decode replica takes the pages, samples
    every completion's first token itself and forks; completion i equals a separate call seeded seed + i."""
    messages = [{"role": "user", "content": "Refactor:\n" + "for i in range(10):\n    total += values[i]\n" * 3}]
    prompt = reference.tokenizer.encode_chat(messages)
    expected = reference.generate([prompt], SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=5))[0]

    def counters() -> tuple[int, int]:
        details = requests.get(f"{endpoint}/health", timeout=30).json()["details"]
        return details["decode.disaggregated"], details["prefill.requests"]

    before = counters()
    response = client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=1.0,
        n=3,
        seed=5,
    )
    assert [choice.message.content for choice in sorted(response.choices, key=lambda c: c.index)] == [
        completion.text for completion in expected.completions
    ]
    assert len({completion.text for completion in expected.completions}) > 1
    after = counters()
    assert after[0] == before[0] + 1 and after[1] == before[1] + 1  # one prefill for all three completions
    for i, completion in enumerate(expected.completions):
        alone = client.chat.completions.create(
            model="tiny",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=1.0,
            seed=5 + i,
        )
        assert alone.choices[0].message.content == completion.text

"""The cluster as an attacker, a careless client and a second tenant meet it: really started, over real HTTP and gRPC.

Two API keys (two tenants) and a tenant with two keys; two decode replicas and
a prefill replica sharing the KV store; a 1 MiB body limit. Checked: the key
on every gRPC method as on HTTP, both ports listening only at ``server.host``,
busy ports refused, bodies and prompts bounded before they cost anything,
nesting too deep for the parser answered in the API's shape, tenants that
share no cached prefix and no session, a call's own ``cache_salt`` that
keeps its prefix apart within its tenant, health and metrics that show an
unauthenticated caller neither secret nor model, logs without secrets, and a
decode replica killed mid-stream: a clean retryable error, a health report
that names it, and the survivor still serving. The kill comes last.
"""

from __future__ import annotations

import base64
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
grpc = pytest.importorskip("grpc")
openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")

from small_cluster import serving, small_cluster  # noqa: E402

import rayturn  # noqa: E402
from rayturn.api.session import SESSION_STATE_HEADER  # noqa: E402
from rayturn.api.tenants import key_digest  # noqa: E402
from rayturn.cluster.config import load_config  # noqa: E402
from rayturn.cluster.listeners import ListenerError, check_ports_free  # noqa: E402
from rayturn.engine import LLMEngine  # noqa: E402
from rayturn.protos import rayturn_pb2 as pb  # noqa: E402
from rayturn.protos import rayturn_pb2_grpc as pb_grpc  # noqa: E402

HTTP_PORT, GRPC_PORT = 28471, 29471
KEY_A, KEY_B = "sk-alice-2f7c9e1d5a8b4c3e", "sk-bob-8d1e4b7a2c9f6e5d"
TEAM_KEYS = ["sk-team-one-3b8e1f2a", "sk-team-two-9c4d7a1e"]
BODY_LIMIT = 1 << 20
OVERRIDES = small_cluster(
    HTTP_PORT,
    GRPC_PORT,
    48,
    **{
        "server.api_keys": [KEY_A, KEY_B],
        "server.tenant_keys": {"team": TEAM_KEYS},
        "server.max_request_bytes": BODY_LIMIT,
        "decode.min_replicas": 2,
        "decode.max_replicas": 2,
        "decode.num_cpus": 0.2,
        "prefill.num_cpus": 0.2,
    },
)
SECRETS = [KEY_A, KEY_B, *TEAM_KEYS]
# A long agent prompt: ~2,000 tokens of the byte-level `tiny` tokenizer.
LONG_PROMPT = "Refactor this module and keep its tests green:\n" + "def f(x):\n    return x + 1\n" * 75


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    with serving(load_config(**OVERRIDES)) as url:
        yield url


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def chat(
    url: str, key: str, content: str, session: str | None = None, max_tokens: int = 4, cache_salt: str | None = None
) -> Any:
    headers = {"x-session-id": session} if session else {}
    return client(url, key).chat.completions.with_raw_response.create(
        model="tiny",
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
        extra_headers=headers,
        extra_body={"cache_salt": cache_salt} if cache_salt else None,
    )


# -- keys on every door ----------------------------------------------------------------------


def grpc_metadata(*extra: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    return (("application", "rayturn"), *extra)


@pytest.mark.parametrize(
    "credentials",
    [(), (("authorization", "Bearer sk-wrong"),), (("x-api-key", "sk-wrong"),)],
    ids=["none", "wrong", "x-api-key-wrong"],
)
def test_every_grpc_method_refuses_a_missing_or_wrong_key(
    cluster: str, credentials: tuple[tuple[str, str], ...]
) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        stub = pb_grpc.RayTurnStub(channel)
        calls = [
            lambda: list(stub.Generate(pb.GenerateRequest(text="hi"), metadata=grpc_metadata(*credentials))),
            lambda: stub.Prewarm(pb.PrewarmRequest(session_id="s"), metadata=grpc_metadata(*credentials)),
            lambda: stub.Health(pb.HealthRequest(), metadata=grpc_metadata(*credentials)),
            lambda: stub.Tokenize(pb.GenerateRequest(text="hi"), metadata=grpc_metadata(*credentials)),
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "API key" in (err.value.details() or "")


def test_grpc_server_reflection_is_off(cluster: str) -> None:
    """Reflection would list the services to a caller without a key; clients build stubs from the protos."""
    reflection_pb2 = pytest.importorskip("grpc_reflection.v1alpha.reflection_pb2")
    reflection_pb2_grpc = pytest.importorskip("grpc_reflection.v1alpha.reflection_pb2_grpc")
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        for metadata in ((), grpc_metadata(("authorization", f"Bearer {KEY_A}"))):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.ServerReflectionInfo(iter([ask]), metadata=metadata, timeout=30))
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("header", ["authorization", "x-api-key"])
def test_a_valid_key_passes_as_bearer_token_or_x_api_key_on_grpc_and_http(cluster: str, header: str) -> None:
    value = f"Bearer {KEY_A}" if header == "authorization" else KEY_A
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        stub = pb_grpc.RayTurnStub(channel)
        request = pb.GenerateRequest(text="hi", sampling=pb.SamplingOptions(max_tokens=2, temperature=0.0))
        responses = list(stub.Generate(request, metadata=grpc_metadata((header, value))))
        assert responses[-1].usage.completion_tokens == 2
        assert stub.Health(pb.HealthRequest(), metadata=grpc_metadata((header, value))).status == "ok"
    assert requests.get(f"{cluster}/v1/models", headers={header: value}, timeout=30).status_code == 200
    refused = requests.get(f"{cluster}/v1/models", headers={header: value.replace(KEY_A, KEY_A + "x")}, timeout=30)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(("path", "body"), [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [104, 105]})])
def test_the_tokenizer_endpoints_ask_for_a_key(cluster: str, path: str, body: dict[str, Any]) -> None:
    """Their ids say which model is served, as ``/v1/models`` does: no key, no answer."""
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
        refused = requests.post(f"{cluster}{path}", json=body, headers=headers, timeout=30)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    answer = requests.post(f"{cluster}{path}", json=body, headers={"x-api-key": KEY_A}, timeout=30)
    assert answer.status_code == 200
    assert answer.json() == ({"prompt": "hi"} if path == "/detokenize" else {**answer.json(), "tokens": [104, 105]})


# -- listeners -------------------------------------------------------------------------------


def test_both_ports_listen_only_on_the_configured_host(cluster: str) -> None:
    node_ip = ray.util.get_node_ip_address()
    if node_ip.startswith("127."):
        pytest.skip("this host has no address besides loopback")
    for port in (HTTP_PORT, GRPC_PORT):
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # where the config says
        with pytest.raises(OSError):
            socket.create_connection((node_ip, port), timeout=5).close()  # nowhere else


def test_a_second_server_on_the_same_ports_is_refused(cluster: str) -> None:
    for key, port in (("server.http_port", HTTP_PORT), ("server.grpc_port", GRPC_PORT)):
        with pytest.raises(ListenerError, match=rf"address already in use: 127\.0\.0\.1:{port} \({key}\)"):
            check_ports_free("127.0.0.1", {key: port})
        with pytest.raises(ListenerError, match="address already in use"):
            check_ports_free("0.0.0.0", {key: port})


# -- bounded requests ------------------------------------------------------------------------

AUTH_A = {"Authorization": f"Bearer {KEY_A}"}


def test_a_body_over_the_limit_is_413_before_it_is_read_or_while_it_streams(cluster: str) -> None:
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x" * (2 * BODY_LIMIT)}]}).encode()
    declared = requests.post(f"{cluster}/v1/chat/completions", data=body, headers=AUTH_A, timeout=60)
    assert declared.status_code == 413
    error = declared.json()["error"]
    assert error["code"] == "request_too_large" and str(BODY_LIMIT) in error["message"]
    assert "server.max_request_bytes" in error["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is found while reading
        for start in range(0, len(body), 64 << 10):
            yield body[start : start + (64 << 10)]

    streamed = requests.post(f"{cluster}/v1/chat/completions", data=chunks(), headers=AUTH_A, timeout=60)
    assert streamed.status_code == 413 and streamed.json()["error"]["code"] == "request_too_large"
    assert streamed.json()["error"]["message"].startswith("The request body passed the limit while it was being read;")
    assert chat(cluster, KEY_A, "still here?").http_response.status_code == 200


def test_a_prompt_that_cannot_fit_is_refused_without_tokenizing_it(cluster: str, reference: LLMEngine) -> None:
    max_chars = reference.max_model_len * reference.tokenizer.max_token_chars * 4
    content = "y" * (max_chars + 1)  # under the body limit, but more tokens than the context for sure
    with pytest.raises(openai.BadRequestError) as err:
        chat(cluster, KEY_A, content)
    assert err.value.status_code == 400
    body = err.value.body
    assert isinstance(body, dict) and body["code"] == "context_length_exceeded" and "characters" in body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client(cluster, KEY_A).completions.create(model="tiny", prompt=content, max_tokens=1)
    body = err.value.body
    assert isinstance(body, dict) and body["code"] == "context_length_exceeded" and body["param"] == "prompt"


def test_grpc_messages_and_prompts_are_bounded_too(cluster: str, reference: LLMEngine) -> None:
    metadata = grpc_metadata(("x-api-key", KEY_A))
    max_chars = reference.max_model_len * reference.tokenizer.max_token_chars * 4
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}", options=[("grpc.max_send_message_length", -1)]) as channel:
        stub = pb_grpc.RayTurnStub(channel)
        with pytest.raises(grpc.RpcError) as err:  # over server.max_request_bytes: refused by the proxy itself
            list(stub.Generate(pb.GenerateRequest(text="x" * (2 * BODY_LIMIT)), metadata=metadata))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as err:  # under it, but surely longer than the context
            list(stub.Generate(pb.GenerateRequest(text="x" * (max_chars + 1)), metadata=metadata))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "characters" in (err.value.details() or "")
        request = pb.GenerateRequest(text="hi", sampling=pb.SamplingOptions(max_tokens=1))
        assert list(stub.Generate(request, metadata=metadata))[-1].usage.completion_tokens == 1


def test_json_nested_too_deep_is_a_400_in_the_openai_shape(cluster: str) -> None:
    nested = "[" * 3000 + "]" * 3000
    body = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "metadata": ' + nested + "}"
    for path in ("/v1/chat/completions", "/v1/completions"):
        answer = requests.post(f"{cluster}{path}", data=body, headers=AUTH_A, timeout=30)
        assert answer.status_code == 400 and answer.headers["content-type"] == "application/json"
        assert answer.json()["error"]["code"] == "json_too_deep"
    # Deeply nested tool parameters reach the chat template's tojson: a 400 as well, never a 500.
    parameters = "[" * 900 + "]" * 900  # written out: this process's own json would run out of stack too
    deep_tools = (
        '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, '
        '"tools": [{"type": "function", "function": {"name": "f", "parameters": ' + parameters + "}}]}"
    )
    answer = requests.post(f"{cluster}/v1/chat/completions", data=deep_tools, headers=AUTH_A, timeout=30)
    assert 400 <= answer.status_code < 500 and "error" in answer.json()
    assert chat(cluster, KEY_A, "still here?").http_response.status_code == 200


# -- tenants ---------------------------------------------------------------------------------


def test_two_tenants_with_the_same_prompt_share_nothing(cluster: str) -> None:
    first = chat(cluster, KEY_A, LONG_PROMPT).parse()
    assert first.usage.prompt_tokens >= 2000 and first.usage.prompt_tokens_details.cached_tokens == 0
    again = chat(cluster, KEY_A, LONG_PROMPT).parse()  # alice's own prefix: cached (device or store)
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16
    for key in (KEY_B, TEAM_KEYS[0]):  # another tenant's key: nothing of alice's, on any tier
        other = chat(cluster, key, LONG_PROMPT).parse()
        assert other.usage.prompt_tokens_details.cached_tokens == 0
        assert other.usage.prompt_tokens_details.kv_store_tokens == 0  # type: ignore[attr-defined]
        assert other.choices[0].message.content == first.choices[0].message.content  # same model, same answer
    # One tenant's keys share it: the team's second key finds what the first one cached.
    team = chat(cluster, TEAM_KEYS[1], LONG_PROMPT).parse()
    assert team.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16


def grpc_chat_usage(content: str, key: str, cache_salt: str) -> Any:
    messages = pb.Messages(messages=[pb.ChatMessage(role="user", content=content)])
    request = pb.GenerateRequest(
        messages=messages, sampling=pb.SamplingOptions(max_tokens=4, temperature=0.0), cache_salt=cache_salt
    )
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        responses = list(pb_grpc.RayTurnStub(channel).Generate(request, metadata=grpc_metadata(("x-api-key", key))))
    return responses[-1].usage


def test_a_calls_cache_salt_keeps_its_prefix_apart_within_its_tenant_on_http_and_grpc(cluster: str) -> None:
    prompt = "Salted. " + LONG_PROMPT  # a prefix no other test cached
    first = chat(cluster, KEY_A, prompt, cache_salt="s1").parse()
    num_tokens = first.usage.prompt_tokens
    assert num_tokens >= 2000 and first.usage.prompt_tokens_details.cached_tokens == 0
    again = chat(cluster, KEY_A, prompt, cache_salt="s1").parse()  # the same tenant and salt: cached
    assert again.usage.prompt_tokens_details.cached_tokens >= num_tokens - 16
    # gRPC's field names the same salt: its chat renders the same prompt and finds the pages cached over HTTP.
    on_grpc = grpc_chat_usage(prompt, KEY_A, "s1")
    assert on_grpc.prompt_tokens == num_tokens and on_grpc.cached_tokens >= num_tokens - 16
    # Another salt, no salt, the same salt under another tenant: nothing of it, on any tier; the same answer.
    for key, salt in [(KEY_A, "s2"), (KEY_A, None), (KEY_B, "s1")]:
        other = chat(cluster, key, prompt, cache_salt=salt).parse()
        assert other.usage.prompt_tokens_details.cached_tokens == 0, (key, salt)
        assert other.usage.prompt_tokens_details.kv_store_tokens == 0  # type: ignore[attr-defined]
        assert other.choices[0].message.content == first.choices[0].message.content
    assert grpc_chat_usage(prompt, KEY_A, "s3").cached_tokens == 0
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        request = pb.GenerateRequest(text=prompt, cache_salt="a/b")
        with pytest.raises(grpc.RpcError) as err:
            list(pb_grpc.RayTurnStub(channel).Generate(request, metadata=grpc_metadata(("x-api-key", KEY_A))))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in (err.value.details() or "")
    with pytest.raises(openai.BadRequestError) as refused:
        chat(cluster, KEY_A, prompt, cache_salt="x" * 129)
    assert isinstance(refused.value.body, dict) and refused.value.body["param"] == "cache_salt"


def test_a_session_id_belongs_to_its_tenant(cluster: str) -> None:
    chat(cluster, KEY_A, "alice's turn", session="shared-id")
    seen_by_alice = json.loads(chat(cluster, KEY_A, "alice again", session="shared-id").headers[SESSION_STATE_HEADER])
    assert seen_by_alice["state"] != "new"
    seen_by_bob = json.loads(chat(cluster, KEY_B, "bob's turn", session="shared-id").headers[SESSION_STATE_HEADER])
    assert seen_by_bob["state"] == "new"  # bob's "shared-id" is his own session, not alice's
    prewarm = requests.post(f"{cluster}/v1/sessions/never-used/prewarm", headers={"x-api-key": KEY_B}, timeout=30)
    assert prewarm.status_code == 202 and prewarm.json()["state"] == "unknown"
    assert requests.post(f"{cluster}/v1/sessions/shared-id/prewarm", timeout=30).status_code == 401


# -- what an unauthenticated caller and the logs see -------------------------------------------


def test_health_and_metrics_show_no_secret_and_no_model_without_a_key(cluster: str, reference: LLMEngine) -> None:
    anonymous = requests.get(f"{cluster}/health", timeout=30)
    assert anonymous.status_code == 200 and anonymous.json()["status"] == "ok"
    pools = anonymous.json()["pools"]
    assert pools["decode"] == {"ok": True, "replicas": 2, "target_replicas": 2}
    metrics = requests.get(f"{cluster}/metrics", timeout=30).text
    assert "rayturn_requests_total" in metrics
    assert set(anonymous.json()) == {"status", "pools"}  # no details, no replica states
    for text in (anonymous.text, metrics):
        for revealing in ("tiny", reference.model_id, *SECRETS, *(key_digest(key) for key in SECRETS)):
            assert revealing not in text
    detailed = requests.get(f"{cluster}/health", headers={"x-api-key": KEY_B}, timeout=30).json()
    assert detailed["details"]["model"] == "tiny" and len(detailed["pools"]["decode"]["replica_states"]) == 2


def test_ping_answers_as_health_and_the_version_asks_for_a_key(cluster: str) -> None:
    """vLLM's ``/ping`` (SageMaker's probe, GET or POST) and ``/version``."""
    for method in ("GET", "POST"):
        for headers in ({}, {"x-api-key": KEY_B}):
            ping = requests.request(method, f"{cluster}/ping", headers=headers, timeout=30)
            health = requests.get(f"{cluster}/health", headers=headers, timeout=30)
            assert ping.status_code == health.status_code == 200
            assert set(ping.json()) == set(health.json()) and ping.json()["status"] == "ok"
    refused = requests.get(f"{cluster}/version", timeout=30)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    version = requests.get(f"{cluster}/version", headers={"authorization": f"Bearer {KEY_A}"}, timeout=30)
    assert version.status_code == 200 and version.json() == {"version": rayturn.__version__}


def test_no_secret_reaches_the_logs(cluster: str) -> None:
    chat(cluster, KEY_A, "a call with a key")
    requests.get(f"{cluster}/v1/models", headers={"Authorization": "Bearer sk-not-a-key-3c2b"}, timeout=30)
    master = ray.get_actor("rayturn-kv", namespace="rayturn")
    store_secret = ray.get(master.store_secret.remote())
    needles = [key.encode() for key in SECRETS] + [key_digest(key).encode() for key in SECRETS]
    needles += [store_secret, store_secret.hex().encode(), base64.b64encode(store_secret)]
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    files = [path for path in logs.rglob("*") if path.is_file()]
    assert any(path.name.startswith("worker") for path in files)  # the replicas' own logs are here
    for path in files:
        data = path.read_bytes()
        for needle in needles:
            assert needle not in data, f"a secret in {path.name}"


# -- a replica dies (last: the cluster runs on one decode replica afterwards) -----------------------


def test_a_replica_killed_mid_stream_is_a_clean_retryable_error_and_health_names_it(cluster: str) -> None:
    # Seeded sampling cannot continue exactly on another replica (``api/resume.py``), so this stream ends with
    # the retryable error; greedy streams resume instead (tests/cluster/test_faults.py).
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "count"}],
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
        "temperature": 1.0,
        "seed": 7,
    }
    with requests.post(f"{cluster}/v1/chat/completions", json=body, headers=AUTH_A, stream=True, timeout=120) as answer:
        assert answer.status_code == 200
        replica_id = answer.headers["x-rayturn-replica"]
        lines = answer.iter_lines()
        assert next(line for line in lines if line.startswith(b"data: "))  # streaming
        ray.kill(ray.get_actor(f"SERVE_REPLICA::rayturn#decode#{replica_id}", namespace="serve"), no_restart=True)
        events = [line.removeprefix(b"data: ") for line in lines if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "replica_unavailable" and "Retry" in error["message"]
    for internal in (replica_id, "pid", "actor", "Actor", "SERVE_REPLICA", "ray."):
        assert internal not in error["message"]
    # /health answers from one probe a second at most: the death shows within a few seconds, well before
    # Serve's controller notices it at its next periodic health check and starts a replacement.
    deadline = time.monotonic() + 5
    while (health := requests.get(f"{cluster}/health", headers=AUTH_A, timeout=30)).status_code == 200:
        assert time.monotonic() < deadline, "the dead replica never showed in /health"
        time.sleep(0.2)
    assert health.status_code == 503 and health.json()["status"] == "degraded"
    decode = health.json()["pools"]["decode"]
    assert decode["ok"] is False and decode["replicas"] < decode["target_replicas"]
    states = {state["replica_id"]: state["state"] for state in decode["replica_states"]}
    assert states.get(replica_id, "gone") != "RUNNING"
    # The other replica serves; a call the router still sends to the dead one fails cleanly, and a retry works.
    outcomes = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            outcomes.append(chat(cluster, KEY_A, "are you there?").http_response.status_code)
            break
        except openai.APIStatusError as err:
            assert err.status_code == 503 and err.response.headers.get("retry-after") == "1"
            assert "pid" not in err.message and replica_id not in err.message
            outcomes.append(err.status_code)
    assert outcomes[-1] == 200

"""Bad input against a really started cluster, over real HTTP and gRPC: refused in each API's own shape, never a 5xx.

One cluster (API keys on, a 1 MiB body limit) for the module. Checked:

- the OpenAPI document (``GET /openapi.json``) asks for the key and carries a
  request schema for every body-taking route;
- bodies drawn from those schemas are accepted (2xx), so the schemas are not
  looser than the parsers; the rules JSON Schema cannot state, which the
  document lists under ``x-rayturn-rules``, are kept by the drawing;
- fuzzed bodies (``schemathesis``, positive and negative) get a 2xx or a 4xx
  in the API's error shape, never a 5xx;
- hand-written bad bodies for the OpenAI chat, Anthropic Messages and
  Responses APIs: malformed JSON, an empty body, invalid UTF-8, a lone
  surrogate, 100k nested arrays, deep JSON inside a string field, NaN and
  Infinity, duplicate keys, wrong types, huge and negative numbers, an integer
  past Python's digit limit, absurd ``n``, thousands of stop strings, a giant
  prompt (past the body limit, and past the context), a wrong content type:
  each a 4xx in the API's shape that names what is wrong;
- random bytes as the request message of every gRPC method: INVALID_ARGUMENT
  (grpcio alone answers UNKNOWN); bad metadata: UNAUTHENTICATED for a key in
  a bad form, INVALID_ARGUMENT for a bad session id;
- after all of it, ``/health`` is ok and a normal chat call and gRPC call succeed.
"""

from __future__ import annotations

import http.client
import json
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")
grpc = pytest.importorskip("grpc")
openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")
schemathesis = pytest.importorskip("schemathesis")

from google.protobuf.message import DecodeError  # noqa: E402
from hypothesis import HealthCheck, Phase, assume, given, settings  # noqa: E402
from llguidance import LLMatcher  # noqa: E402
from llguidance.gbnf_to_lark import any_to_lark  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402
from small_cluster import serving, small_cluster  # noqa: E402

from rayturn.cluster.config import load_config  # noqa: E402
from rayturn.protos import rayturn_pb2 as pb  # noqa: E402
from rayturn.protos import rayturn_pb2_grpc as pb_grpc  # noqa: E402

HTTP_PORT, GRPC_PORT = 28641, 29641
API_KEY = "sk-fuzz-7d3e9a1c5b8f"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
BODY_LIMIT = 1 << 20
OVERRIDES = small_cluster(
    HTTP_PORT, GRPC_PORT, 48, **{"server.api_keys": [API_KEY], "server.max_request_bytes": BODY_LIMIT}
)
# Each fuzzed operation gets this many examples (derandomized: the same ones every run).
EXAMPLES_PER_OPERATION = 10
# Drawn bodies this long may hold more tokens than the context (a documented rule the schema cannot state).
MAX_DRAWN_BODY_CHARS = 2000
# Generation is the slow part of a call; fuzzed calls ask for at most this many tokens and choices.
MAX_FUZZ_TOKENS, MAX_FUZZ_N = 2, 2

CHAT, MESSAGES, RESPONSES = "/v1/chat/completions", "/v1/messages", "/v1/responses"
GOOD_BODIES: dict[str, dict[str, Any]] = {
    CHAT: {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    MESSAGES: {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    RESPONSES: {"model": "tiny", "input": "hi", "max_output_tokens": 2},
}
# The field each API reads its token cap and its prompt from.
MAX_TOKENS_FIELD = {CHAT: "max_tokens", MESSAGES: "max_tokens", RESPONSES: "max_output_tokens"}
STOP_FIELD = {CHAT: "stop", MESSAGES: "stop_sequences"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    with serving(load_config(**OVERRIDES)) as url:
        yield url


@pytest.fixture(scope="module")
def api_schema(cluster: str) -> Any:
    document = requests.get(f"{cluster}/openapi.json", headers=AUTH, timeout=30)
    assert document.status_code == 200, document.text
    schema = schemathesis.openapi.from_dict(drawable(document.json()))
    schema.config.update(base_url=cluster)
    return schema


# -- what every answer must look like ----------------------------------------------------------------


def error_of(path: str, response: Any) -> dict[str, Any]:
    """The error object of a refused call, checked against its API's shape; its message must say something."""
    assert 400 <= response.status_code < 500, f"{path}: {response.status_code} {response.text[:500]}"
    body = response.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    else:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    return dict(body["error"])


def assert_healthy(url: str) -> None:
    assert requests.get(f"{url}/health", timeout=30).json()["status"] == "ok"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    answer = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "still there?"}], max_tokens=3, temperature=0
    )
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 3
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        # Greedy, as the chat call above: sampled at gRPC's default temperature (1.0), one call in ~150 ends on EOS.
        request = pb.GenerateRequest(text="still there?", sampling=pb.SamplingOptions(max_tokens=2, temperature=0))
        responses = list(pb_grpc.RayTurnStub(channel).Generate(request, metadata=[("x-api-key", API_KEY)]))
    assert responses and responses[-1].finish_reason == "length"


# -- the published document --------------------------------------------------------------------------


def test_the_openapi_document_asks_for_the_key_and_has_a_schema_for_every_body(cluster: str) -> None:
    refused = requests.get(f"{cluster}/openapi.json", timeout=30)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    document = requests.get(f"{cluster}/openapi.json", headers=AUTH, timeout=30).json()
    assert document["openapi"].startswith("3.1")
    paths = document["paths"]
    assert set(paths) >= {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
        "/v1/responses/{response_id}",
        "/v1/responses/{response_id}/cancel",
        "/tokenize",
        "/detokenize",
        "/health",
    }
    assert set(paths["/v1/responses/{response_id}"]) == {"get", "delete"}
    assert "requestBody" not in paths["/v1/responses/{response_id}/cancel"]["post"]
    for path, operations in paths.items():
        if "post" not in operations or path.endswith("/cancel"):
            continue
        schema = operations["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert schema["type"] == "object" and schema["additionalProperties"] is False, path
        assert schema["properties"]["model"]["enum"] == ["tiny", ""], path
        shape = "AnthropicError" if path.startswith("/v1/messages") else "OpenAIError"
        assert operations["post"]["responses"]["4XX"]["content"]["application/json"]["schema"]["$ref"].endswith(shape)


# -- drawn from the schemas ---------------------------------------------------------------------------


def final_text(body: dict[str, Any]) -> str | None:
    """The text of a body's final message when it is an assistant's (a string, or its text parts); else None."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or messages[-1].get("role") != "assistant":
        return None
    content = messages[-1].get("content")
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"]
        return "\n".join(text for text in texts if isinstance(text, str))
    return content if isinstance(content, str) else None


# Rules the generator is not given: its canonical form of a schema doubles with each rule that holds only when a
# field is present (``dependentSchemas``), and past a size cap it gives up on the whole body (``UnsupportedSchema``);
# the chat body's rules are one too many. The document still states each one (``test_bad_input_unit`` checks that
# it refuses what breaks them); here ``keeps_the_documented_rules`` keeps them instead.
UNDRAWN_RULES = {CHAT: ("top_logprobs",)}


def drawable(document: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI document without the ``UNDRAWN_RULES``."""
    for path, fields in UNDRAWN_RULES.items():
        body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        for field in fields:
            del body["dependentSchemas"][field]
    return document


def keeps_the_documented_rules(path: str, body: dict[str, Any]) -> bool:
    """The ``x-rayturn-rules`` JSON Schema cannot state: unique tool names, a named tool choice that is
    declared, a ``required`` one with tools to call, a ``previous_response_id`` or an ``item_reference`` that
    names a stored response or item (state, not shape: none is drawn), a chat's ``continue_final_message``
    after an assistant's text, an Anthropic prefill without trailing whitespace, a structured output's regex
    or grammar that compiles, token filters (``allowed_token_ids``, ``bad_words``) only without a guide,
    ``min_tokens`` within the answer's bound, and the ``UNDRAWN_RULES``: a chat's ``top_logprobs`` with
    ``logprobs: true``."""
    text = final_text(body)
    continues = body.get("continue_final_message") is True
    if path in ("/v1/chat/completions", "/tokenize") and continues and not (text and text.strip()):
        return False
    if path.startswith("/v1/messages") and text and text != text.rstrip():
        return False
    if path == CHAT and body.get("top_logprobs") is not None and body.get("logprobs") is not True:
        return False  # UNDRAWN_RULES
    text_options = body.get("text")  # a Responses body's text.format
    form = body.get("response_format") or (text_options.get("format") if isinstance(text_options, dict) else None)
    guided = "structured_outputs" in body or (isinstance(form, dict) and form.get("type") != "text")
    least, most = body.get("min_tokens"), answer_bound(body)
    if isinstance(least, int) and most is not None and least > most:
        return False
    filtered = body.get("allowed_token_ids") is not None or bool(body.get("bad_words"))
    if filtered and (guided or _forced_call(body)):
        return False
    tools = [tool for tool in body.get("tools") or [] if tool.get("type") in (None, "function", "custom")]
    names = [tool.get("name") or tool.get("function", {}).get("name") for tool in tools]
    choice = body.get("tool_choice")
    if choice == "required" and not names:
        return False
    if isinstance(choice, dict) and choice["type"] in ("tool", "function"):
        chosen = choice.get("name") or choice.get("function", {}).get("name")
        if chosen not in names:
            return False
    return (
        len(names) == len(set(names))
        and "previous_response_id" not in body
        and not _references(body)
        and compiles(body.get("structured_outputs"))
    )


def answer_bound(body: dict[str, Any]) -> int | None:
    """The most tokens a body asks for, as its parser reads it (a chat's max_completion_tokens over max_tokens)."""
    for field in ("max_completion_tokens", "max_output_tokens", "max_tokens"):
        if isinstance(body.get(field), int):
            return int(body[field])
    return None


def _references(body: dict[str, Any]) -> bool:
    items = body.get("input")
    return isinstance(items, list) and any(isinstance(i, dict) and i.get("type") == "item_reference" for i in items)


def _forced_call(body: dict[str, Any]) -> bool:
    choice = body.get("tool_choice")
    return bool(body.get("tools")) and (choice == "required" or isinstance(choice, dict))


def compiles(form: Any) -> bool:
    """The rule that a drawn ``structured_outputs.regex`` or ``.grammar`` compiles, judged by llguidance itself."""
    if not isinstance(form, dict):
        return True
    try:
        if isinstance(form.get("regex"), str):
            grammar = LLMatcher.grammar_from_regex(form["regex"])
        elif isinstance(form.get("grammar"), str):
            grammar = LLMatcher.grammar_from_lark(any_to_lark(form["grammar"]))
        else:
            return True
    except Exception:  # the GBNF converter raises whatever its parser meets
        return False
    return not LLMatcher.validate_grammar_with_warnings(grammar, None)[0]


def bounded(body: Any) -> Any:
    """A drawn body that asks for few tokens and choices, so that generation stays quick (a ``min_tokens`` kept
    within the bound, as the rule says)."""
    if isinstance(body, dict):
        for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if isinstance(body.get(field), int | float) and body[field] >= 1:
                body[field] = min(int(body[field]), MAX_FUZZ_TOKENS)
        if isinstance(body.get("min_tokens"), int | float) and body["min_tokens"] >= 0:
            bound = answer_bound(body)
            body["min_tokens"] = min(int(body["min_tokens"]), MAX_FUZZ_TOKENS if bound is None else bound)
        if isinstance(body.get("n"), int | float) and body["n"] >= 1:
            body["n"] = min(int(body["n"]), MAX_FUZZ_N)
    return body


def shown(body: Any) -> str:
    try:
        return json.dumps(body)
    except TypeError:  # a negative case may hold bytes
        return repr(body)


def fuzz(operation: Any, mode: GenerationMode, check: Callable[[Any, Any], None]) -> int:
    """Draws ``EXAMPLES_PER_OPERATION`` cases of ``operation`` in ``mode``, calls each, checks the answer."""
    calls = 0

    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(operation.as_strategy(generation_mode=mode))
    def call(case: Any) -> None:
        nonlocal calls
        if mode == GenerationMode.POSITIVE and isinstance(case.body, dict):
            assume(keeps_the_documented_rules(case.path, case.body) and len(shown(case.body)) < MAX_DRAWN_BODY_CHARS)
        case.body = bounded(case.body)
        calls += 1
        check(case, case.call(headers=AUTH, timeout=120))

    call()
    return calls


def test_bodies_drawn_from_the_schemas_are_accepted(cluster: str, api_schema: Any) -> None:
    def accepted(case: Any, response: Any) -> None:
        assert response.status_code == 200, f"{case.path}: {response.text[:500]} for {shown(case.body)[:2000]}"

    for result in api_schema.get_all_operations():
        operation = result.ok()
        if operation.method == "post" and operation.body:  # not a cancel: its (random) response id is unknown
            assert fuzz(operation, GenerationMode.POSITIVE, accepted) > 0, operation.path
    assert_healthy(cluster)


def test_fuzzed_requests_get_an_answer_or_a_4xx_in_the_api_shape(cluster: str, api_schema: Any) -> None:
    def no_server_error(case: Any, response: Any) -> None:
        what = f"{case.method} {case.formatted_path}"
        assert response.status_code < 500, f"{what}: {response.text[:500]} for {shown(case.body)[:2000]}"
        if response.status_code >= 400:
            error_of(case.path, response)

    num_calls = 0
    for result in api_schema.get_all_operations():
        operation = result.ok()
        if operation.method == "post" and operation.body:  # a body can break its schema; any string is an id
            num_calls += fuzz(operation, GenerationMode.NEGATIVE, no_server_error)
        num_calls += fuzz(operation, GenerationMode.POSITIVE, no_server_error)
    assert num_calls > EXAMPLES_PER_OPERATION * 8
    assert_healthy(cluster)


# -- written by hand -------------------------------------------------------------------------------


def _json(path: str, **fields: Any) -> bytes:
    return json.dumps({**GOOD_BODIES[path], **fields}).encode()


def _prompt(path: str, text: str) -> bytes:
    if path == RESPONSES:
        return _json(path, input=text)
    return _json(path, messages=[{"role": "user", "content": text}])


def _raw_field(path: str, name: str, literal: str) -> bytes:
    """A good body with ``name`` set to ``literal``, written as is (JSON that ``json.dumps`` would not write)."""
    return _json(path)[:-1] + f', "{name}": {literal}}}'.encode()


# Deeper than Python's parser goes (about a thousand levels), short enough for the context.
DEEP_TEXT = "[" * 1500 + "]" * 1500


def _deep_in_a_string(path: str) -> bytes:
    """JSON nested too deep to parse, inside a string field the server parses as JSON when it can."""
    if path == MESSAGES:  # Claude Code's ``metadata.user_id`` holds JSON naming the session
        return _json(path, metadata={"user_id": '{"session_id": ' + DEEP_TEXT + "}"})
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP_TEXT}}
    if path == CHAT:
        turns = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ]
        return _json(path, messages=turns)
    items = [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": DEEP_TEXT}]
    return _json(path, input=[*items, {"type": "function_call_output", "call_id": "c1", "output": "ok"}])


BadCase = tuple[bytes, dict[str, str], int, str]


def _max_tokens(path: str, value: Any) -> BadCase:
    field = MAX_TOKENS_FIELD[path]
    return _json(path, **{field: value}), {}, 400, field


def _deep_case(path: str) -> BadCase:
    """Only text to the server: the call is served, or (Anthropic) its session id is too long."""
    if path == MESSAGES:
        return _deep_in_a_string(path), {}, 400, "metadata.user_id"
    return _deep_in_a_string(path), {}, 200, ""


# name -> (body, extra headers, expected status, a word the message or param must hold); each built per API.
BAD_BODIES: dict[str, Callable[[str], BadCase]] = {
    "malformed JSON": lambda path: (_json(path)[:-9], {}, 400, "parse"),
    "an empty body": lambda path: (b"", {}, 400, "parse"),
    "a JSON array": lambda path: (b"[1, 2]", {}, 400, "object"),
    "invalid UTF-8": lambda path: (_prompt(path, "ok\u0001").replace(b"\\u0001", b"\xff\xfe"), {}, 400, "utf-8"),
    "a lone surrogate": lambda path: (_prompt(path, "a\udc00b"), {}, 400, "surrogate"),
    "100k nested arrays": lambda path: (b"[" * 100_000 + b"]" * 100_000, {}, 400, "deep"),
    "deep JSON in a string field": _deep_case,
    "NaN": lambda path: (_raw_field(path, "temperature", "NaN"), {}, 400, "NaN"),
    "Infinity": lambda path: (_raw_field(path, MAX_TOKENS_FIELD[path], "-Infinity"), {}, 400, "Infinity"),
    "duplicate keys": lambda path: (_raw_field(path, "model", '"other"'), {}, 400, "'model' appears twice"),
    "a wrong type": lambda path: _max_tokens(path, "2"),
    "a huge max_tokens": lambda path: _max_tokens(path, 1e30),
    "a negative max_tokens": lambda path: _max_tokens(path, -1),
    "an integer of 5000 digits": lambda path: (_raw_field(path, "temperature", "9" * 5000), {}, 400, "digits"),
    "a giant prompt past the body limit": lambda path: (_prompt(path, "a" * (BODY_LIMIT + 1)), {}, 413, "bytes"),
    "a prompt past the context": lambda path: (_prompt(path, "ab " * 150_000), {}, 400, "context"),
    "a wrong content type": lambda path: (_json(path), {"content-type": "text/plain"}, 415, "content-type"),
}
API_ONLY_CASES: dict[str, Callable[[str], BadCase]] = {
    "absurd n": lambda path: (_json(path, n=10**9), {}, 400, "'n'"),
    "thousands of stop strings": lambda path: (
        _json(path, **{STOP_FIELD[path]: [f"stop-{i}" for i in range(5000)]}),
        {},
        400,
        STOP_FIELD[path],
    ),
}
CASES = [(path, name) for path in GOOD_BODIES for name in BAD_BODIES] + [
    (path, name) for path in (CHAT, MESSAGES) for name in API_ONLY_CASES if name != "absurd n" or path == CHAT
]


@pytest.mark.parametrize(("path", "case"), CASES, ids=[f"{path}-{case}" for path, case in CASES])
def test_a_bad_body_is_a_4xx_in_the_api_shape_naming_what_is_wrong(cluster: str, path: str, case: str) -> None:
    body, headers, status, word = {**BAD_BODIES, **API_ONLY_CASES}[case](path)
    response = requests.post(
        f"{cluster}{path}", data=body, headers={"content-type": "application/json", **AUTH, **headers}, timeout=120
    )
    if status == 200:  # deep JSON inside a string is only text: the call is served
        assert response.status_code == 200, response.text[:500]
        return
    assert response.status_code == status, response.text[:500]
    error = error_of(path, response)
    said = f"{error['message']} {error.get('param') or ''}".lower()
    assert word.lower() in said, error


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
def test_a_session_header_that_is_not_utf8_is_read_as_any_header(cluster: str, path: str) -> None:
    """Serve's proxy decoded its own session header, the one rayturn's callers send, as UTF-8: a plain-text 500.
    Now the header reaches the ingress, which reads it as Latin-1 as it reads every header."""
    connection = http.client.HTTPConnection("127.0.0.1", HTTP_PORT, timeout=120)
    try:
        connection.putrequest("POST", path)
        for name, value in (*AUTH.items(), ("content-type", "application/json"), ("x-session-id", b"caf\xe9-1")):
            connection.putheader(name, value)
        body = _prompt(path, "hi")
        connection.putheader("content-length", str(len(body)))
        connection.endheaders(body)
        response = connection.getresponse()
        assert response.status == 200, response.read()[:500]
        assert json.loads(response.read())["usage"]
    finally:
        connection.close()


def test_the_server_is_healthy_after_the_bad_bodies(cluster: str) -> None:
    assert_healthy(cluster)


# -- gRPC ----------------------------------------------------------------------------------------------

GRPC_METHODS: dict[str, Any] = {
    "/rayturn.v1.RayTurn/Generate": pb.GenerateRequest,
    "/rayturn.v1.RayTurn/Prewarm": pb.PrewarmRequest,
    "/rayturn.v1.RayTurn/Health": pb.HealthRequest,
}
# Bytes no protobuf message decodes: a truncated varint, a length past the end, a string that is not UTF-8.
UNDECODABLE = [b"\x08\xff\xff", b"\x0a\x7f", b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", b"\x0a\x02\xc3\x28"]


def decodes(message_class: Any, data: bytes) -> bool:
    try:
        message_class.FromString(data)
    except DecodeError:
        return False
    return True


def raw_call(channel: Any, method: str, data: bytes, metadata: list[tuple[str, Any]]) -> Any:
    """The status of ``method`` called with ``data`` as its request message, unserialized."""
    if method.endswith("Generate"):
        call = channel.unary_stream(method, request_serializer=None, response_deserializer=None)
        try:
            list(call(data, metadata=metadata, timeout=60))
        except grpc.RpcError as err:
            return err
        return None
    try:
        channel.unary_unary(method, request_serializer=None, response_deserializer=None)(
            data, metadata=metadata, timeout=60
        )
    except grpc.RpcError as err:
        return err
    return None


def test_request_messages_that_do_not_decode_are_invalid_argument(cluster: str) -> None:
    rng = random.Random(16)
    frames = UNDECODABLE + [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))) for _ in range(16)]
    key = [("x-api-key", API_KEY)]
    num_undecodable = 0
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        for method, message_class in GRPC_METHODS.items():
            for data in frames:
                err = raw_call(channel, method, data, key)
                if decodes(message_class, data):  # random bytes that happen to be a message: any answer but a crash
                    assert err is None or err.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
                    continue
                num_undecodable += 1
                assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, data)
                assert message_class.DESCRIPTOR.full_name in err.details()
            # The key is checked before the message: no key, no word about the message.
            err = raw_call(channel, method, UNDECODABLE[0], [])
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert num_undecodable >= len(UNDECODABLE) * len(GRPC_METHODS)
    assert_healthy(cluster)


BAD_KEYS: list[list[tuple[str, Any]]] = [
    [("authorization", "Bearer")],
    [("authorization", f"Basic {API_KEY}")],
    [("authorization", f"Bearer {API_KEY}x")],
    [("authorization", f"Bearer {API_KEY[:-1]}")],
    [("x-api-key", " ")],
    [("x-api-key", "k" * 4000)],
    [("x-api-key-bin", API_KEY.encode() + b"\xff\xfe")],
    [("authorization-bin", b"\xc3\x28\xff")],
]


@pytest.mark.parametrize("metadata", BAD_KEYS, ids=[f"{m[0][0]}-{len(m[0][1])}" for m in BAD_KEYS])
def test_a_key_in_a_bad_form_is_unauthenticated_on_every_method(cluster: str, metadata: list[tuple[str, Any]]) -> None:
    request = pb.GenerateRequest(text="hi", sampling=pb.SamplingOptions(max_tokens=1)).SerializeToString()
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        for method in GRPC_METHODS:
            err = raw_call(channel, method, request if method.endswith("Generate") else b"", metadata)
            assert err is not None and err.code() == grpc.StatusCode.UNAUTHENTICATED, (method, err)


def test_bad_session_metadata_is_invalid_argument_and_binary_metadata_is_ignored(cluster: str) -> None:
    key = ("x-api-key", API_KEY)
    request = pb.GenerateRequest(text="hi", sampling=pb.SamplingOptions(max_tokens=1))
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        stub = pb_grpc.RayTurnStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request, metadata=[key, ("x-session-id", "s" * 5000)], timeout=60))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "session id" in (err.value.details() or "")
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request, metadata=[key, ("x-rayturn-call", "sideways")], timeout=60))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "x-rayturn-call" in (err.value.details() or "")
        binary = [key, ("x-session-id-bin", b"\xff\xfe\x00"), ("x-anything-bin", bytes(range(256)))]
        answers = list(stub.Generate(request, metadata=binary, timeout=60))
        assert answers[-1].finish_reason == "length"
    assert_healthy(cluster)

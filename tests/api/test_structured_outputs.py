"""vLLM's structured outputs at the API edge: each form becomes the guide it names (checked by running the guide
over the ``tiny`` tokenizer's tokens), the earlier ``guided_*`` spellings too, and everything this server cannot
honour is a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rayturn.api.chat_request import parse_chat_request
from rayturn.api.completion_request import parse_completion_request
from rayturn.api.errors import APIError
from rayturn.api.openapi import openapi_document
from rayturn.api.protocol import to_sampling_params
from rayturn.api.responses_request import parse_responses_request
from rayturn.engine.guided import Guide, GuideCompiler
from rayturn.engine.presets import preset_dir
from rayturn.engine.tokenizer import Tokenizer

MODEL = "tiny"
TOOLS = [{"type": "function", "function": {"name": "open_file", "parameters": {"type": "object"}}}]
# Strings a choice must hold as they are: quotes, a backslash, a newline, Lark's and regexes' own signs, non-ASCII.
AWKWARD_CHOICES = ['say "hi"', "back\\slash", "two\nlines", "a|b", "/x/", "(ok)?", "ünïcode ✓", "%json{}"]


@pytest.fixture(scope="module")
def compiler() -> GuideCompiler:
    tokenizer = Tokenizer.from_dir(preset_dir("tiny"))
    vocab_size = json.loads((preset_dir("tiny") / "config.json").read_text())["vocab_size"]
    return GuideCompiler(tokenizer, vocab_size, {tokenizer.eos_token_id})


def accepts(compiler: GuideCompiler, guide: Guide, text: str) -> bool:
    """Whether ``guide`` takes ``text``, token by token, as a whole answer."""
    state = compiler.start(guide)
    for token_id in compiler._tokenizer.encode(text):
        state.advance(token_id)
    return state.error is None and state.matcher.is_accepting()


def chat_guide(**fields: Any) -> tuple[Guide | None, str | None]:
    sampling = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], **fields}, MODEL).sampling
    return sampling.guide, sampling.guide_param


def completion_guide(**fields: Any) -> tuple[Guide | None, str | None]:
    sampling = parse_completion_request({"prompt": "hi", **fields}, MODEL).sampling
    return sampling.guide, sampling.guide_param


def chat_error(**fields: Any) -> APIError:
    with pytest.raises(APIError) as caught:
        parse_chat_request({"messages": [{"role": "user", "content": "hi"}], **fields}, MODEL)
    assert caught.value.status_code == 400
    return caught.value


@pytest.mark.parametrize("read", [chat_guide, completion_guide], ids=["chat", "completions"])
@pytest.mark.parametrize("legacy", [False, True], ids=["structured_outputs", "guided"])
def test_a_choice_takes_exactly_its_strings(compiler: GuideCompiler, read: Any, legacy: bool) -> None:
    fields = {"guided_choice": AWKWARD_CHOICES} if legacy else {"structured_outputs": {"choice": AWKWARD_CHOICES}}
    guide, param = read(**fields)
    assert guide is not None and param == ("guided_choice" if legacy else "structured_outputs.choice")
    for choice in AWKWARD_CHOICES:
        assert accepts(compiler, guide, choice), choice
    for other in ("say hi", "back\\\\slash", "a", "b", "x", "ok", "", AWKWARD_CHOICES[0] + " "):
        assert not accepts(compiler, guide, other), other


def test_a_regex_holds_the_whole_answer(compiler: GuideCompiler) -> None:
    guide, param = completion_guide(structured_outputs={"regex": r"[0-9]{3}-[a-c]+"})
    assert guide == Guide.regex(r"[0-9]{3}-[a-c]+") and param == "structured_outputs.regex"
    assert accepts(compiler, guide, "123-abca")
    for other in ("12-a", "123-", "123-abd", "x123-a", "123-a\n"):
        assert not accepts(compiler, guide, other), other
    assert completion_guide(guided_regex="a+")[0] == Guide.regex("a+")


@pytest.mark.parametrize(
    "grammar",
    ['root ::= "yes" | "no" | "maybe " [0-9]', 'start: "yes" | "no" | "maybe " /[0-9]/'],
    ids=["gbnf", "lark"],
)
def test_a_grammar_in_gbnf_or_lark(compiler: GuideCompiler, grammar: str) -> None:
    for guide, _ in (chat_guide(structured_outputs={"grammar": grammar}), chat_guide(guided_grammar=grammar)):
        assert guide is not None and guide.kind == "lark"
        for text in ("yes", "no", "maybe 7"):
            assert accepts(compiler, guide, text), text
        for text in ("maybe", "yes no", "maybe x"):
            assert not accepts(compiler, guide, text), text


def test_json_forms(compiler: GuideCompiler) -> None:
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}
    open_guide, _ = chat_guide(structured_outputs={"json": schema})
    assert open_guide == Guide.json_schema(schema)
    closed, _ = chat_guide(structured_outputs={"json": schema, "disable_additional_properties": True})
    assert closed == Guide.json_schema({**schema, "additionalProperties": False})
    assert accepts(compiler, open_guide, '{"a": 1, "b": 2}') and not accepts(compiler, closed, '{"a": 1, "b": 2}')
    assert accepts(compiler, closed, '{"a": 2}')
    # A schema in a string, as vLLM takes it too; compact whatever disable_any_whitespace says.
    as_text, param = completion_guide(guided_json=json.dumps(schema))
    assert as_text == Guide.json_schema(schema) and param == "guided_json"
    loose = {"json": schema, "disable_any_whitespace": False}
    assert chat_guide(structured_outputs=loose)[0] == Guide.json_schema(schema)
    assert chat_guide(structured_outputs={"json_object": True})[0] == Guide.json_object()


def test_the_guide_reaches_the_engine() -> None:
    sampling = parse_completion_request({"prompt": "hi", "guided_regex": "a+"}, MODEL).sampling
    params = to_sampling_params(sampling, default_max_tokens=8, prompt_tokens=2, max_model_len=64)
    assert params.guide == Guide.regex("a+")
    # A response format and no structured output: the chat's own guide comes later (``guides``), none here.
    plain = parse_chat_request({"messages": [{"role": "user", "content": "x"}], "guided_json": None}, MODEL)
    assert plain.sampling.guide is None and plain.sampling.guide_param is None


BAD_CASES: list[tuple[dict[str, Any], str, str]] = [
    ({"structured_outputs": "x"}, "structured_outputs", "expected an object"),
    ({"structured_outputs": {}}, "structured_outputs", "expected one of json, regex, choice, grammar, json_object"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs", "expected one of"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice", "ask for one"),
    ({"structured_outputs": {"regex": "a"}, "guided_json": {}}, "guided_json", "ask for one"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "ask for one"),
    ({"structured_outputs": {"regex": "(?=a)b"}}, "structured_outputs.regex", "look-around"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex", "non-empty pattern"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex", "expected a string"),
    ({"guided_regex": "a{"}, "guided_regex", "unclosed counted repetition"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "expected 1 to 1024 strings, got 0"),
    ({"guided_choice": ["a"] * 1025}, "guided_choice", "got 1025"),
    ({"guided_choice": ["a", 1]}, "guided_choice[1]", "expected a string"),
    ({"guided_choice": "a"}, "guided_choice", "an array of strings"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar", "not a Lark or GBNF"),
    ({"structured_outputs": {"grammar": "  "}}, "structured_outputs.grammar", "only whitespace"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "undefined_rule"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": [1]}, "guided_json", "a JSON schema object"),
    ({"guided_json": "[" * 100_000}, "guided_json", "nests too deeply"),
    ({"structured_outputs": {"json": {"type": "banana"}}}, "structured_outputs.json", "Invalid type: banana"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object", "a boolean"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern", ""),
    ({"structured_outputs": {"regex": "a", "structural_tag": "{}"}}, "structured_outputs.structural_tag", ""),
    ({"structured_outputs": {"regex": "a", "backend": "xgrammar"}}, "structured_outputs.backend", "expected keys"),
    ({"structured_outputs": {"regex": "a", "disable_fallback": 1}}, "structured_outputs.disable_fallback", ""),
    ({"guided_json": {}, "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "structured_outputs"),
    ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern", ""),
]


@pytest.mark.parametrize(("fields", "param", "words"), BAD_CASES, ids=[case[1] for case in BAD_CASES])
def test_what_cannot_be_honoured_is_a_400_naming_it(fields: dict[str, Any], param: str, words: str) -> None:
    error = chat_error(**fields)
    assert error.param == param and words in error.message, error.message
    with pytest.raises(APIError) as caught:
        parse_completion_request({"prompt": "hi", **fields}, MODEL)
    assert caught.value.param == param


def test_a_chat_call_has_one_guide() -> None:
    error = chat_error(structured_outputs={"regex": "a"}, response_format={"type": "json_object"})
    assert error.param == "structured_outputs.regex" and "'response_format'" in error.message
    for choice in ("required", {"type": "function", "function": {"name": "open_file"}}):
        error = chat_error(guided_choice=["a"], tools=TOOLS, tool_choice=choice)
        assert error.param == "guided_choice" and "tool_choice" in error.message
    # Offered tools the model may call or not, and a text format, leave the structured output alone.
    assert chat_guide(guided_regex="a", tools=TOOLS, tool_choice="auto")[0] == Guide.regex("a")
    assert chat_guide(guided_regex="a", response_format={"type": "text"})[0] == Guide.regex("a")


def test_responses_take_the_structured_outputs_form_alone() -> None:
    def parsed(**fields: Any) -> Any:
        return parse_responses_request({"input": "hi", **fields}, MODEL).chat().sampling

    sampling = parsed(structured_outputs={"choice": ["a", "b"]}, text={"format": {"type": "text"}})
    assert sampling.guide == Guide.lark('start: "a" | "b"') and sampling.guide_param == "structured_outputs.choice"
    # vLLM's Responses API reads no ``guided_*``: refused by name, pointing at the form it takes.
    with pytest.raises(APIError) as caught:
        parsed(guided_regex="a+")
    assert caught.value.param == "guided_regex" and "'structured_outputs'" in caught.value.message
    with pytest.raises(APIError) as caught:
        parsed(structured_outputs={"regex": "a"}, text={"format": {"type": "json_object"}})
    assert caught.value.param == "structured_outputs.regex" and "'text.format'" in caught.value.message
    tools = [{"type": "function", "name": "f"}]
    with pytest.raises(APIError) as caught:
        parsed(structured_outputs={"regex": "a"}, tools=tools, tool_choice="required")
    assert caught.value.param == "structured_outputs.regex" and "tool_choice" in caught.value.message
    with pytest.raises(APIError) as caught:
        parsed(structured_outputs={"regex": "(?=a)"})
    assert caught.value.param == "structured_outputs.regex" and "look-around" in caught.value.message


def test_the_openapi_document_describes_structured_outputs() -> None:
    document = openapi_document(MODEL, 263)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        operation = document["paths"][path]["post"]
        schema = operation["requestBody"]["content"]["application/json"]["schema"]
        form = schema["properties"]["structured_outputs"]
        assert set(form["properties"]) >= {"json", "regex", "choice", "grammar", "json_object"}
        constraints = [one["required"] for one in form["oneOf"]]
        assert constraints == [["json"], ["regex"], ["choice"], ["grammar"], ["json_object"]]
        assert any("compile" in rule for rule in operation["x-rayturn-rules"])
        assert "guided_json" not in schema["properties"]  # the legacy spellings are accepted, not advertised

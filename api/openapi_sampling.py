"""The sampling fields of both OpenAI APIs in the OpenAPI document (``openapi``), vLLM's extensions included, as
``protocol.sampling_spec`` and ``sampling_fields`` read them."""

from __future__ import annotations

from rayturn.engine.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_PENALTY,
    MAX_STOP_TOKEN_IDS,
)

from .json_fields import INT64_MAX
from .json_schema import (
    BOOLEAN,
    JSON,
    NON_EMPTY,
    SESSION_ID,
    STRUCTURED_OUTPUTS,
    array_of,
    enum_of,
    integer,
    number,
    object_of,
    string,
    token_id_key,
)
from .protocol import MAX_N, MAX_REPETITION_PENALTY, MAX_TEMPERATURE
from .sampling_fields import MAX_BAD_WORD_CHARS, MAX_STOP_SEQUENCES
from .truncation import SIDES


def sampling_properties(vocab_size: int, max_model_len: int = INT64_MAX) -> JSON:
    """The sampling fields' schemas, by name, for a model of ``vocab_size`` tokens and a context of
    ``max_model_len`` (the default: none named)."""
    return {
        "max_tokens": integer(minimum=1),
        "temperature": number(0.0, MAX_TEMPERATURE),
        "top_p": number(0.0, 1.0, exclusive_minimum=True),
        "n": integer(1, MAX_N),
        "stop": {"anyOf": [NON_EMPTY, array_of(NON_EMPTY, max_items=MAX_STOP_SEQUENCES)]},
        "stop_token_ids": {
            **array_of(integer(0, vocab_size - 1), max_items=MAX_STOP_TOKEN_IDS),
            "description": "Token ids that end the answer as a stop sequence does (the id is kept).",
        },
        "seed": integer(),
        "stream": BOOLEAN,
        "stream_options": object_of(
            {
                "include_usage": BOOLEAN,
                "continuous_usage_stats": {
                    **BOOLEAN,
                    "description": "With include_usage: every chunk carries the usage so far (vLLM's extension).",
                },
            }
        ),
        "user": SESSION_ID,
        "frequency_penalty": number(-MAX_PENALTY, MAX_PENALTY),
        "presence_penalty": number(-MAX_PENALTY, MAX_PENALTY),
        "logit_bias": {
            "type": "object",
            "propertyNames": token_id_key(vocab_size),
            "additionalProperties": number(-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS),
            "maxProperties": MAX_LOGIT_BIAS_TOKENS,
            "description": "Token ids (in the vocabulary) to a number added to their logits.",
        },
        "allowed_token_ids": {
            **array_of(integer(0, vocab_size - 1), 1, MAX_ALLOWED_TOKEN_IDS),
            "description": "Only these token ids may be sampled; absent or null: every token.",
        },
        "bad_words": {
            **array_of(string(minLength=1, maxLength=MAX_BAD_WORD_CHARS, pattern=r"\S"), max_items=MAX_BAD_WORDS),
            "description": "Words the output must not complete (the last token of each is banned after the rest).",
        },
        "truncate_prompt_tokens": {
            "anyOf": [{"const": -1}, integer(1, max_model_len)],
            "description": "Keep at most this many prompt tokens (at most the context); -1: as many as leave "
            "room for max_tokens (one token without it). Absent or null: the whole prompt.",
        },
        "truncation_side": {
            **enum_of(*SIDES),
            "description": "Which end a truncated prompt keeps: left keeps the last tokens; absent: left.",
        },
        "top_k": integer(minimum=-1),
        "min_p": number(0.0, 1.0),
        "min_tokens": {
            **integer(minimum=0),
            "description": "No end of sequence or stop before this many tokens (at most the answer's bound).",
        },
        "repetition_penalty": number(0.0, MAX_REPETITION_PENALTY, exclusive_minimum=True),
        "ignore_eos": BOOLEAN,
        "include_stop_str_in_output": BOOLEAN,
        "skip_special_tokens": BOOLEAN,
        "return_tokens_as_token_ids": BOOLEAN,
        "return_token_ids": {**BOOLEAN, "description": "The answer carries the prompt's token ids and each choice's."},
        "structured_outputs": STRUCTURED_OUTPUTS,
    }

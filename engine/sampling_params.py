"""Per-request sampling settings, validated when made."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .guided import Guide
from .thinking import ThinkingBudget

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64
"""The most stop strings a request may give (each is looked for after every token)."""
MAX_STOP_TOKEN_IDS = 256
"""The most stop token ids a request may give."""
MAX_PENALTY = 2.0
"""``frequency_penalty`` and ``presence_penalty`` lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range)."""
MAX_LOGIT_BIAS = 100.0
"""A ``logit_bias`` value lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's range)."""
MAX_LOGIT_BIAS_TOKENS = 1024
"""The most tokens one request's ``logit_bias`` may name (each costs a write into the row's logits per step)."""
MAX_ALLOWED_TOKEN_IDS = 1 << 18
"""The most ids one request's ``allowed_token_ids`` may hold (the largest vocabularies' size; repeats are harmless)."""
MAX_BAD_WORDS = 128
"""The most token sequences one request's ``bad_words`` may hold (vLLM's ``VLLM_MAX_NUM_BAD_WORDS``)."""
MAX_BAD_WORD_TOKENS = 1024
"""The most tokens one of them may hold: four per character of the longest word the APIs take (256 characters),
so that no word they take is refused for its tokens (a byte-level vocabulary spends up to four on a character)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1`` disable
    those filters. ``seed`` makes a request's samples reproducible whatever
    else runs beside it. ``logprobs = k`` returns the chosen token's log
    probability and the ``k`` most likely alternatives, from the model's raw
    distribution (before temperature and filters).

    ``guide`` holds the output to a grammar (see ``guided.py``): tokens it
    forbids are masked before sampling, like another filter, so logprobs
    still show the model's unguided preferences (the alternatives may be
    tokens the guide forbade). A guided sequence ends as ``"stop"`` when its
    grammar is complete.

    ``repetition_penalty`` (1 is off) divides the positive logits, and
    multiplies the others, of every token already in the sequence (prompt
    and output), before temperature and filters; greedy rows take the argmax
    of the penalised logits. ``min_p`` drops, after temperature, the tokens
    less likely than ``min_p`` times the most likely one (random sampling
    only). ``min_tokens``: until that many output tokens exist, the stop
    token ids and EOS (unless ``ignore_eos``) cannot be sampled, and no stop
    string ends the sequence (the length limits and a guide still do). Logprobs
    still come from the raw distribution: the penalties, the bias and the masks
    do not show in them.

    ``logit_bias`` maps token ids to a number in [-100, 100] added to their
    logits (100 all but forces a token, -100 all but bans it), and
    ``frequency_penalty`` / ``presence_penalty`` (in [-2, 2], 0 is off) subtract,
    from the logit of every token the output already holds, the penalty times
    its count / the penalty once (OpenAI's definitions; the prompt does not
    count). Logits change in vLLM's order: the bias first, then the repetition,
    frequency and presence penalties. A dict given as ``logit_bias`` is stored
    as a tuple of ``(token_id, bias)`` pairs sorted by id.

    ``prompt_logprobs = k``: the log probability of every prompt token given
    the tokens before it, and the ``k`` most likely alternatives, from the raw
    distribution (``RequestOutput.prompt_logprobs``). Such a request computes
    its whole prompt: it takes no prefix-cache hits and loads no KV pages.

    ``speculative``: whether decoding may verify draft tokens several at a
    time (``speculative/``); None takes the engine's default. The output is
    the same either way (greedy: token for token; seeded: draw for draw).

    ``thinking_budget``: an answer that opens in reasoning ends it after at
    most that many tokens (``thinking.py``): past them, the engine forces the
    reasoning's end.

    ``allowed_token_ids`` (None: every token) leaves only those tokens to be
    sampled; ``bad_words``, as token sequences, bans the last token of each
    while the output ends with the ones before it (a one-token sequence: always),
    as vLLM does, which looks at the output only, never at the prompt. Both
    apply before the bias and the penalties (vLLM's order); like them, they do
    not show in logprobs.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    guide: Guide | None = None
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    speculative: bool | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    thinking_budget: ThinkingBudget | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        # Accept lists (and a lone string for stop) from callers; store tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        object.__setattr__(self, "bad_words", tuple(tuple(word) for word in self.bad_words))
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        _check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1,
            "max_tokens",
            f"must be an integer >= 1, got {self.max_tokens!r}",
        )
        _check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature!r}")
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int), "top_k", f"must be an integer, got {self.top_k!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "entries must be non-empty strings")
        _check(
            len(self.stop) <= MAX_STOP_STRINGS,
            "stop",
            f"must hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}",
        )
        _check(
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            "stop_token_ids",
            f"must hold at most {MAX_STOP_TOKEN_IDS} token ids, got {len(self.stop_token_ids)}",
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "entries must be non-negative integers",
        )
        if self.logprobs is not None:
            _check(
                isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
            )
        _check(
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty!r}",
        )
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check(
                _is_number(value) and -MAX_PENALTY <= value <= MAX_PENALTY,
                name,
                f"must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}",
            )
        _check(
            len(self.logit_bias) <= MAX_LOGIT_BIAS_TOKENS,
            "logit_bias",
            f"must name at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(self.logit_bias)}",
        )
        if self.allowed_token_ids is not None:
            _check(
                0 < len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS
                and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids),
                "allowed_token_ids",
                f"must hold 1 to {MAX_ALLOWED_TOKEN_IDS} token ids >= 0 (None allows every token)",
            )
        words = self.bad_words
        _check(
            len(words) <= MAX_BAD_WORDS,
            "bad_words",
            f"must hold at most {MAX_BAD_WORDS} token sequences, got {len(self.bad_words)}",
        )
        _check(
            all(0 < len(word) <= MAX_BAD_WORD_TOKENS and all(_is_int(t) and t >= 0 for t in word) for word in words),
            "bad_words",
            f"entries must be sequences of 1 to {MAX_BAD_WORD_TOKENS} token ids >= 0",
        )
        _check(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
        )
        if self.prompt_logprobs is not None:
            _check(
                _is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                "prompt_logprobs",
                f"must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}",
            )
        if self.speculative is not None:
            _check(isinstance(self.speculative, bool), "speculative", f"must be a boolean, got {self.speculative!r}")
        if self.seed is not None:
            _check(isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        if self.guide is not None:
            _check(isinstance(self.guide, Guide), "guide", f"must be a Guide, got {type(self.guide).__name__}")
        if self.thinking_budget is not None:
            budget = self.thinking_budget
            _check(
                isinstance(budget, ThinkingBudget),
                "thinking_budget",
                f"must be a ThinkingBudget, got {type(budget).__name__}",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalises_output(self) -> bool:
        """Whether the frequency or presence penalty is on (the logits then depend on the output so far)."""
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def _bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted ``(token_id, bias)`` pairs, from a mapping or pairs; ValueError naming what is
    wrong."""
    items = list(value.items()) if isinstance(value, Mapping) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, (list, tuple)) and len(i) == 2 for i in items):
        raise ValueError(f"SamplingParams.logit_bias must map token ids to numbers, got {type(value).__name__}")
    pairs = [(token_id, bias) for token_id, bias in items]
    for token_id, bias in pairs:
        _check(_is_int(token_id) and token_id >= 0, "logit_bias", f"keys must be token ids >= 0, got {token_id!r}")
        _check(
            _is_number(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS,
            "logit_bias",
            f"values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r} for token {token_id}",
        )
    by_id = dict(pairs)
    _check(len(by_id) == len(pairs), "logit_bias", "names a token id more than once")
    return tuple(sorted((token_id, float(bias)) for token_id, bias in by_id.items()))


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{field_name} {message}")

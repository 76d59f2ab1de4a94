"""Guided decoding: output held to a grammar (a JSON schema, any JSON object, Lark, a regex).

A ``Guide`` (a kind and a spec string, cheap to pickle) rides in
``SamplingParams``, so it crosses processes inside a ``Call``. Each engine's
``GuideCompiler`` compiles it with llguidance against the model's tokenizer
when the request is added (a guide that does not compile is a ``ValueError``
there) and gives the sequence its own ``GuideState``. One guided token::

    mask_guided_logits  -- tokens the grammar forbids next -> -inf   (before sampling)
    GuideState.advance  -- the chosen token moves the grammar on     (in the stop checks)
        error    -> the sequence ends as "abort" (its batch mates go on)
        complete -> the sequence ends as "stop"  (accepting, nothing more can follow)

EOS is allowed exactly when the grammar accepts. A guide with ``after`` (a
thinking model's ``</think>``) waits: the output is free, and the grammar
untouched, until that text appears in it; the grammar holds from the next
token on (vLLM's structured outputs wait for the reasoning's end the same
way). A fork deep-copies its parent's state. Tokens made elsewhere (a
prefill replica's first token) go through the same stop checks when the
request arrives, so the state has consumed (or watched) them before the
engine samples the next token.

JSON guides are compact: no free whitespace, ``", "`` and ``": "`` between
items (a schema's own ``x-guidance`` options override this). A ``%json``
inside a Lark guide keeps llguidance's defaults (free whitespace) unless its
schema sets ``"x-guidance": {"whitespace_flexible": false}``.
"""

from __future__ import annotations

import functools
import json
from collections import OrderedDict
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

import numpy as np
import torch
from llguidance import LLExecutor, LLMatcher, LLParserLimits, LLTokenizer
from llguidance.numpy import fill_next_token_bitmask_par

from .guide_tokenizer import build_guide_tokenizer
from .thinking import newly_shows
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

GuideKind = Literal["json_schema", "json_object", "lark", "regex"]
GUIDE_KINDS: tuple[str, ...] = get_args(GuideKind)

# Compact JSON: a model free to add whitespace can add it forever.
JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_ERROR_CHARS = 400  # llguidance errors can list a whole vocabulary's special tokens
DEFAULT_MAX_GRAMMARS = 128


@dataclass(frozen=True, slots=True)
class Guide:
    """What the output must match: ``kind`` names the language of ``spec``.

    ``json_schema``: ``spec`` is a JSON schema (a JSON object, as text).
    ``json_object``: any JSON object; ``spec`` stays empty. ``lark``:
    llguidance's Lark dialect, which may embed schemas as ``%json{...}``.
    ``regex``: the whole output matches the pattern. ``after``: the grammar
    holds only from the token after the output first contains this text (the
    end of a thinking model's reasoning); "": from the first token.
    """

    kind: GuideKind
    spec: str = ""
    after: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GUIDE_KINDS:
            raise ValueError(f"Guide.kind must be one of {', '.join(GUIDE_KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"Guide.spec must be a string, got {type(self.spec).__name__}")
        if self.kind == "json_object" and self.spec:
            raise ValueError("Guide.spec must be empty for kind 'json_object' (use 'json_schema' for a schema)")
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"Guide.spec must not be empty for kind {self.kind!r}")
        if not isinstance(self.after, str):
            raise ValueError(f"Guide.after must be a string, got {type(self.after).__name__}")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> Guide:
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> Guide:
        return cls("json_object")

    @classmethod
    def lark(cls, grammar: str) -> Guide:
        return cls("lark", grammar)

    @classmethod
    def regex(cls, pattern: str) -> Guide:
        return cls("regex", pattern)


def _json_schema_grammar(spec: str) -> str:
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as error:
        raise ValueError(f"json_schema guide is not valid JSON: {error}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"json_schema guide must be a JSON object, got {type(schema).__name__}")
    return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)


def _json_object_grammar(_spec: str) -> str:
    return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)


_GRAMMAR_OF: dict[str, Callable[[str], str]] = {
    "json_schema": _json_schema_grammar,
    "json_object": _json_object_grammar,
    "lark": LLMatcher.grammar_from_lark,
    "regex": LLMatcher.grammar_from_regex,
}

# Short errors: the verbose ones carry parser state and the whole grammar.
_LIMITS = LLParserLimits(verbose_errors=False)


def _grammar(guide: Guide) -> str:
    return _GRAMMAR_OF[guide.kind](guide.spec)


def _short(message: str) -> str:
    message = message.strip()
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + "..."


def check_guide(guide: Guide) -> None:
    """Check a guide's syntax without a tokenizer (for the API edge); ``ValueError`` naming what is wrong.

    Cheap next to generating. A guide that passes can still be refused at
    ``add_request`` for what only the tokenizer knows (a special token the
    vocabulary lacks).
    """
    is_error, messages = LLMatcher.validate_grammar_with_warnings(_grammar(guide), None, limits=_LIMITS)
    if is_error:
        raise ValueError(f"bad {guide.kind} guide: {_short(messages[0])}")


class GuideState:
    """One sequence's place in its guide's grammar, and what it still waits for before the grammar holds."""

    __slots__ = ("_matcher", "error", "waiting_for")

    def __init__(self, matcher: LLMatcher, waiting_for: str = "") -> None:
        self._matcher = matcher
        self.error: str | None = None  # set once the grammar broke; the sequence then ends
        self.waiting_for = waiting_for  # the guide's ``after`` until the output shows it; then ""

    @property
    def matcher(self) -> LLMatcher:
        return self._matcher

    @property
    def holds(self) -> bool:
        """The grammar holds the next token (its ``after`` text, if any, is in the output)."""
        return not self.waiting_for

    @property
    def is_complete(self) -> bool:
        """The grammar accepts the output and nothing more can follow."""
        return self.holds and self.error is None and self._matcher.is_stopped() and self._matcher.is_accepting()

    def watch(self, text: str, start_char: int) -> None:
        """The output's text so far (new from ``start_char``): the grammar holds from here once it shows the
        awaited text."""
        if self.waiting_for and newly_shows(text, start_char, self.waiting_for):
            self.waiting_for = ""

    def fork(self) -> GuideState:
        child = GuideState(self._matcher.deep_copy(), self.waiting_for)
        child.error = self.error
        return child

    def advance(self, token_id: int) -> None:
        """Move past ``token_id``; a token the grammar rejects (or a grammar that gave up) sets ``error``."""
        if self.error is not None:
            return
        matcher = self._matcher
        if not matcher.consume_token(token_id):
            self.error = _short(matcher.get_error()) or f"token {token_id} rejected"
        elif matcher.is_stopped() and not matcher.is_accepting():
            self.error = f"the grammar stopped before it was complete ({matcher.stop_reason()})"


class GuideCompiler:
    """Compiles guides against one model's tokenizer, keeping the ``max_grammars`` most recently used.

    The llguidance tokenizer is built on the first guided request, so an
    engine that never guides never pays for it. ``vocab_size`` is the
    model's (its logits' width), which may exceed the tokenizer's.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: AbstractSet[int],
        max_grammars: int = DEFAULT_MAX_GRAMMARS,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.max_grammars = max_grammars
        self._llg_tokenizer: LLTokenizer | None = None
        # Compiled, unconsumed matchers; each sequence starts from a deep copy (microseconds).
        self._grammars: OrderedDict[Guide, LLMatcher] = OrderedDict()

    @property
    def cached(self) -> list[Guide]:
        """The guides compiled and kept, least recently used first."""
        return list(self._grammars)

    def start(self, guide: Guide) -> GuideState:
        """A fresh state for ``guide``; ``ValueError`` naming the problem when it does not compile."""
        grammar = Guide(guide.kind, guide.spec)  # one compiled grammar, whatever the guide waits for
        prototype = self._grammars.get(grammar)
        if prototype is None:
            prototype = self._compile(grammar)
            self._grammars[grammar] = prototype
            if len(self._grammars) > self.max_grammars:
                self._grammars.popitem(last=False)
        else:
            self._grammars.move_to_end(grammar)
        return GuideState(prototype.deep_copy(), guide.after)

    def _compile(self, guide: Guide) -> LLMatcher:
        matcher = LLMatcher(self._llguidance_tokenizer(), _grammar(guide), log_level=0, limits=_LIMITS)
        if matcher.is_error():
            raise ValueError(f"bad {guide.kind} guide: {_short(matcher.get_error())}")
        return matcher

    def _llguidance_tokenizer(self) -> LLTokenizer:
        if self._llg_tokenizer is None:
            self._llg_tokenizer = build_guide_tokenizer(self._tokenizer, self.vocab_size, self.eos_token_ids)
        return self._llg_tokenizer


@functools.cache
def _executor() -> LLExecutor:
    """Computes the masks of a batch's guided rows in parallel (one pool per process)."""
    return LLExecutor()


def mask_guided_logits(logits: torch.Tensor, guides: Seq[GuideState | None]) -> torch.Tensor:
    """A copy of ``logits`` [B, V] with each guided row's forbidden tokens at -inf; unguided rows as they were."""
    rows = [i for i, guide in enumerate(guides) if guide is not None]
    states = [guide for guide in guides if guide is not None]
    vocab_size = logits.shape[-1]
    bitmask = np.zeros((len(states), (vocab_size + 31) // 32), dtype=np.int32)
    fill_next_token_bitmask_par(_executor(), [(state.matcher, j) for j, state in enumerate(states)], bitmask)
    # A broken grammar allows nothing: leave its row free rather than sample from all -inf;
    # advancing the token then finds the error and ends the sequence.
    bitmask[~bitmask.any(axis=1)] = -1
    allowed = _unpack_bits(bitmask, vocab_size, logits.device)
    index = torch.tensor(rows, device=logits.device)
    masked = logits.clone()
    masked[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return masked


def _unpack_bits(bitmask: np.ndarray, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[R, W] int32 words (bit ``b`` of word ``w`` is token ``32 w + b``) -> [R, vocab_size] bool on ``device``.

    Unpacked where the logits are: numpy's unpacking is the fast one on the
    CPU; for an accelerator the packed words cross (an eighth of the bytes).
    """
    if device.type == "cpu":
        return unpack_bits_numpy(bitmask, vocab_size)
    return unpack_bits_torch(torch.from_numpy(bitmask).to(device), vocab_size)


def unpack_bits_numpy(bitmask: np.ndarray, vocab_size: int) -> torch.Tensor:
    """The CPU's unpacking (see ``_unpack_bits``)."""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab_size, bitorder="little")
    return torch.from_numpy(bits.view(np.bool_))


def unpack_bits_torch(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """An accelerator's unpacking, on ``words``' device (see ``_unpack_bits``)."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    return ((words[:, :, None] >> shifts) & 1).reshape(words.shape[0], -1)[:, :vocab_size].bool()

"""Per-request sampling settings, validated when made."""

from __future__ import annotations

from dataclasses import dataclass

from .guided import Guide

MAX_LOGPROBS = 20


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

    def __post_init__(self) -> None:
        # Accept lists (and a lone string for stop) from callers; store tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
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
        if self.seed is not None:
            _check(isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        if self.guide is not None:
            _check(isinstance(self.guide, Guide), "guide", f"must be a Guide, got {type(self.guide).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{field_name} {message}")

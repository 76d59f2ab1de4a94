"""Speculative decoding's settings (the ``model.speculative`` section of the cluster config)."""

from __future__ import annotations

from dataclasses import dataclass

from rayturn.settings import check, check_at_least, check_choice

METHODS = ("suffix",)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """How drafts are made and bounded.

    ``enabled``: the default for requests that do not say
    (``SamplingParams.speculative``). A draft continues the longest earlier
    occurrence of the sequence's last tokens (at least ``min_match_tokens``)
    and has as many tokens as the match, at most ``num_speculative_tokens``.
    A sequence whose recent drafts are accepted less than ``min_acceptance``
    stops drafting for ``backoff_steps`` steps, then tries one draft: when that
    one fails too, the pause doubles (up to 16 times ``backoff_steps``).
    ``session_history_tokens``: the tokens kept per session (its earlier
    calls' prompts and outputs) for the ``max_sessions`` most recent
    sessions; ``recent_output_tokens``: the tokens kept of recent requests'
    outputs, per tenant (cache salt).
    """

    enabled: bool = False
    method: str = "suffix"
    num_speculative_tokens: int = 8
    min_match_tokens: int = 3
    min_acceptance: float = 0.3
    backoff_steps: int = 8
    session_history_tokens: int = 8192
    max_sessions: int = 64
    recent_output_tokens: int = 16384

    def __post_init__(self) -> None:
        check_choice("method", self.method, METHODS)
        check_at_least("num_speculative_tokens", self.num_speculative_tokens, 1)
        check_at_least("min_match_tokens", self.min_match_tokens, 1)
        check_at_least("backoff_steps", self.backoff_steps, 1)
        check_at_least("session_history_tokens", self.session_history_tokens, 0)
        check_at_least("max_sessions", self.max_sessions, 0)
        check_at_least("recent_output_tokens", self.recent_output_tokens, 0)
        check(0.0 <= self.min_acceptance <= 1.0, "min_acceptance", f"must be in [0, 1], got {self.min_acceptance!r}")

"""What the engine hands back per request."""

from __future__ import annotations

from dataclasses import dataclass

from .sequence import TokenLogprob


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop", "length", "abort", or None while running
    stop_reason: str | int | None  # the stop string or stop token id that ended it
    logprobs: tuple[TokenLogprob, ...] | None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One request's state: all ``n`` completions, the first also as shortcuts.

    ``prompt_logprobs`` (when ``SamplingParams.prompt_logprobs`` is set): one
    entry per prompt token, entry ``i`` the log probability of prompt token
    ``i`` given those before it, with the most likely alternatives there;
    entry 0 is None (nothing predicts the first token). Computed once per
    request (shared by its ``n`` completions), it is on every output of the
    request, from the first: that one comes from the step that finished the
    prompt. It stays None when the request did not ask, or ended before its
    prompt ran (aborted, or stopped on arrival by its output prefix).
    """

    request_id: str
    prompt_token_ids: list[int]
    num_cached_prompt_tokens: int
    completions: tuple[CompletionOutput, ...]
    finished: bool
    # Of the cached prompt tokens, those loaded from the KV store (not found on this engine).
    num_loaded_prompt_tokens: int = 0
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    # Joules the request's steps so far were attributed (``engine/energy``), and the meter that measured them.
    energy_j: float | None = None
    energy_meter: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.completions[0].token_ids

    @property
    def text(self) -> str:
        return self.completions[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.completions[0].finish_reason

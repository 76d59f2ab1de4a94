"""What crosses a Ray handle between the cluster's processes, typed.

    ingress --Call--> decode replica --Call--> prefill replica
            <-Step--               <-PrefillAnswer-
    ingress --SessionAnnouncement--> decode replica --PrewarmAnswer-->

Each message is built once, where it starts (the ingress builds the ``Call``
from a validated request: tokens, sampling, tenant salt, session, the
prompt's page hashes), and read by attribute everywhere after it. The page
hashes are the cluster's own (the ingress computes them with the engine's
``hash_pages``; no client can send them), so the replicas and their engines
trust them instead of hashing the prompt again. Serve's request routers read
the same objects (``rayturn.router.request_router``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from rayturn.engine.page_hash import PageHash
from rayturn.engine.prefix_pins import Retention
from rayturn.engine.sampling_params import SamplingParams
from rayturn.engine.sequence import TokenLogprob
from rayturn.engine.tool_calls import ToolCallDelta

# Where a call sits in its session: a new user message, or a tool's result coming back.
CallKind = Literal["user", "tool_continuation"]
# What follows a call's answer: a tool run (the agent is back in seconds), or the user (minutes).
NextStep = Literal["tool", "user"]
# How a call's prompt was filled: on the decode replica itself, or by a prefill replica.
PrefillPath = Literal["local", "disaggregated"]


class ReplicaAtCapacity(Exception):
    """A decode replica refused a call that starts a turn: its share of the replica's slots is taken
    (``rayturn.decode.admission``). The ingress sends the call to another replica (``Call.refused_by``), and
    answers 429 / RESOURCE_EXHAUSTED, to be retried, when every replica it tried refused it."""

    def __init__(self, message: str, replica_id: str | None = None) -> None:
        super().__init__(message)
        # The Serve replica id of the replica that refused (None outside a Serve replica).
        self.replica_id = replica_id

    def __reduce__(self) -> tuple[type[ReplicaAtCapacity], tuple[str, str | None]]:
        return type(self), (str(self), self.replica_id)


class RefusalLog(logging.Filter):
    """Serve's replica logs every exception a call raises as ``Request failed.`` at ERROR with its traceback.
    A refusal is not a failure: a replica at capacity (``ReplicaAtCapacity``, the ingress tries another or
    answers 429) and a request the engine refuses (its ``ValueError``, which the ingress answers as a 400)
    become one line at INFO, naming the reason; with DEBUG logging the traceback stays. Anything else is left
    as Serve logs it. ``RefusalLog.install()`` puts it on Serve's logger, once per process."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if record.msg != "Request failed." or not isinstance(error, ReplicaAtCapacity | ValueError):
            return True
        record.msg, record.args = "Request refused: %s: %s", (type(error).__name__, error)
        record.levelno, record.levelname = logging.INFO, "INFO"
        if not logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            record.exc_info, record.exc_text = None, None
        return True

    @classmethod
    def install(cls, logger_name: str = "ray.serve") -> None:
        serve_logger = logging.getLogger(logger_name)
        if not any(isinstance(existing, cls) for existing in serve_logger.filters):
            serve_logger.addFilter(cls())


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """What a completion had streamed when its decode replica died: the next replica decodes on after it.

    ``text_pieces`` are the texts of the deltas as they arrived, so a replica
    that splits the answer into prose and tool calls reaches the same state by
    taking the same pieces in the same order.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None
    text_pieces: tuple[str, ...]

    @property
    def text(self) -> str:
        return "".join(self.text_pieces)


@dataclass(frozen=True, slots=True)
class Call:
    """One generation call, as the decode pool (and a prefill replica) receives it."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    cache_salt: str = ""
    # The session, scoped by tenant (``<tenant>/<id>``); None for a call that names none.
    session_id: str | None = None
    # Chained hashes of the prompt's full pages before its last token, in order (salted by the tenant).
    page_hashes: tuple[PageHash, ...] = ()
    # The same pages in the short form routers match against replica stats (``router.replica_stats.page_hash_key``),
    # made once with the hashes rather than on every routing attempt.
    page_keys: tuple[str, ...] = ()
    call: CallKind | None = None
    after: NextStep | None = None
    # The answer is split into prose and tool calls: the call offered tools, or the model's tool-call format marks
    # up every answer (``rayturn.engine.tool_calls.splits_every_answer``). An answer holding calls means the agent
    # will be back.
    tools: bool = False
    # The client's cache retention contract: keep the prompt's first pages cached this long
    # (``rayturn.engine.prefix_pins``); None: cached as any prompt is, no promise.
    retention: Retention | None = None
    # The offered tools (OpenAI function-tool objects), for tool-call formats whose argument values are typed by
    # the tool's schema (Qwen3-Coder's XML parameters); empty for the formats that do not need them.
    tool_specs: tuple[Mapping[str, Any], ...] = ()
    # The answer opens in reasoning, split apart in this format (``rayturn.engine.reasoning``) before its tool
    # calls; None: no reasoning to take apart (no reasoning parser, or thinking turned off).
    reasoning: str | None = None
    # A call whose decode replica died mid-stream, sent again: what its one completion had streamed
    # (``rayturn.api.resume``); None for a call's first send.
    resume: ResumePoint | None = None
    # The decode replicas (Serve replica ids) that refused this call for capacity (``ReplicaAtCapacity``):
    # routers rank them last, so the call goes to a replica with room when one has it.
    refused_by: tuple[str, ...] = ()
    # The call's class (a ``rayturn.engine.priority.Priority`` value: what the request or its key's default
    # asked for, validated at the ingress); None: by its kind (``continues_turn``).
    priority: str | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def continues_turn(self) -> bool:
        """A tool's result coming back: the agent loop waits on this call (a continuation, unless it names a class)."""
        return self.call == "tool_continuation"


@dataclass(frozen=True, slots=True)
class SessionAnnouncement:
    """A session's user has started typing: its next call is coming (to the replica that follows it)."""

    session_id: str


@dataclass(frozen=True, slots=True)
class PrewarmAnswer:
    state: str
    replica_id: str | None


@dataclass(frozen=True, slots=True)
class Delta:
    """What one completion of a call gained in one engine step."""

    index: int
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    # A call whose answer is split (``Call.tools``): the replica's split of ``text`` into prose and tool calls
    # (``ToolCallStream.push``), and on the completion's last delta also what was held (``finish``).
    tool_parse: tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True, slots=True)
class Step:
    """One engine step of a call, as the decode replica streams it back."""

    deltas: tuple[Delta, ...]
    prompt_tokens: int
    # Prompt tokens served from cache (device or store), and of those, loaded from the store.
    cached_tokens: int
    loaded_tokens: int
    finished: bool
    path: PrefillPath
    # Serve's id of the decode replica serving the call (the id routers rank); None outside Serve.
    replica_id: str | None
    # On a session's call's first step: the replica's view of the session at arrival (a JSON object).
    session: Mapping[str, Any] | None = None
    # A call that asked for prompt logprobs (``SamplingParams.prompt_logprobs``), on its first step: one entry
    # per prompt token, the first None (nothing predicts it).
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    # Joules the call has been attributed so far (``rayturn.engine.energy``): this replica's engine, plus the
    # prefill replica's when the prefill pool computed the prompt; the meter (or meters, ``+``-joined) they read.
    energy_j: float = 0.0
    energy_meter: str | None = None


@dataclass(frozen=True, slots=True)
class PrefillAnswer:
    """A prefill replica's answer: the first token(s) and the prompt's cache counts there; every full page of
    the prompt is in the KV store before it returns."""

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None
    cached_tokens: int
    loaded_tokens: int
    # Joules the prefill replica's engine attributed to computing the prompt, and its meter's name.
    energy_j: float = 0.0
    energy_meter: str | None = None

"""A call whose decode replica died: sent again, resumed where its stream stopped, or ended cleanly.

The ingress streams a call's steps from one decode replica. When that
replica's process dies (Ray reports the actor dead or unreachable), what the
client has seen decides what happens next::

    streaming --replica died--> nothing streamed yet --------------------> sent again as it was ("retried")
                            |
                            +-> one completion, greedy or unseeded -------> sent again with what it streamed
                            |   (``messages.ResumePoint``): another          ("resumed"); the client sees one
                            |   replica decodes on after those tokens        unbroken stream
                            |
                            +-> n > 1, seeded sampling, or the logprobs ---> ended: a 503 ``replica_unavailable``
                            |   streamed do not match the tokens             ("failed"), an error event in a stream
                            |
                            +-> the completion had already finished -------> ended normally (nothing was lost)

    a call lost more than MAX_RESUMES replicas --> ended as "failed"

A replica that refuses a new turn for capacity (``ReplicaAtCapacity``, before
any step) has done nothing for it either: the call is sent again with that
replica in ``Call.refused_by``, which routers rank last, so it lands on a
replica with room when the pool has one; refused MAX_REFUSALS times, or
twice by one replica (none other had room), it is answered 429 /
RESOURCE_EXHAUSTED.

The rule: a resumed stream must be one the call could have produced without
the fault. Greedy decoding continues exactly (the next replica loads the
prompt's pages from the KV store or recomputes them, then computes the
streamed tokens one per step, as the decode steps that made them did, and
picks the same tokens: ``engine.scheduler.next_chunk_tokens``; a long stream
takes as many steps to resume); unseeded sampling continues as a valid sample of the
same distribution; the stop checks, the guide and the tool-call split replay
the streamed tokens and text pieces on the new replica, so they stand where
they stood. A seeded sample cannot continue its generator's state elsewhere,
and ``n > 1`` completions fork from one sequence; those end with the
retryable error (a retry reproduces a seeded answer exactly). Prompt logprobs
arrive with the first step, so a resumed call does not ask for them again.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Literal

from ray.exceptions import RayActorError, RayTaskError

from rayturn.messages import Call, ReplicaAtCapacity, ResumePoint

from .call_result import CallResult

logger = logging.getLogger(__name__)

# How many replicas one call may lose before it ends with the retryable error.
MAX_RESUMES = 2
# How many replicas may refuse one call for capacity before it is answered 429.
MAX_REFUSALS = 3


def replica_died(err: BaseException) -> bool:
    """Whether ``err`` says the replica serving the call is gone (dead, or unreachable), not that the call failed."""
    cause = err.cause if isinstance(err, RayTaskError) else err
    return isinstance(cause, RayActorError)


def capacity_refusal(err: BaseException) -> ReplicaAtCapacity | None:
    """The replica's refusal of the call for capacity, when ``err`` is one."""
    cause = err.cause if isinstance(err, RayTaskError) else err
    return cause if isinstance(cause, ReplicaAtCapacity) else None


# What followed a replica's death: the call sent again as it was, resumed, already finished, or ended.
LossOutcome = Literal["retried", "resumed", "finished", "failed"]


@dataclass(frozen=True, slots=True)
class ReplicaLoss:
    """What to do about one replica death: ``call`` is the next send (None when the call is over)."""

    outcome: LossOutcome
    call: Call | None = None


class CallResumer:
    """The sends of one call: what its first completion streamed, and its next send after a replica died."""

    def __init__(self, call: Call) -> None:
        self.call = call
        self.num_resumes = 0
        self._text_pieces: list[str] = []

    def record(self, index: int, text: str) -> None:
        """A delta of completion ``index`` reached the client with this text."""
        if index == 0:
            self._text_pieces.append(text)

    def after_refusal(self, refusal: ReplicaAtCapacity, sent: Call) -> Call | None:
        """The call sent again away from the replica that refused ``sent`` for capacity; None, to answer 429,
        when MAX_REFUSALS replicas have refused it, when a replica refused it twice (routers send a call back
        to a replica that refused it only when none other is left), or when the refusing replica is unknown."""
        refused_by = refusal.replica_id
        if refused_by is None or refused_by in sent.refused_by or len(sent.refused_by) + 1 >= MAX_REFUSALS:
            return None
        logger.info("request %s: replica %s is at capacity; trying another", sent.request_id, refusal.replica_id)
        return dataclasses.replace(sent, refused_by=(*sent.refused_by, refused_by))

    def after_death(self, err: BaseException, result: CallResult) -> ReplicaLoss:
        """The call's next send after its replica died (``err``) with the call's steps so far folded in ``result``."""
        request_id = self.call.request_id
        if self.num_resumes >= MAX_RESUMES:
            return self._failed(err, f"it lost {self.num_resumes + 1} replicas")
        params = self.call.params
        state = result.completions.get(0)
        if result.completions and (params.n != 1 or state is None):
            return self._failed(err, f"n={params.n} completions cannot continue elsewhere")
        if state is not None and state.finish_reason is not None:
            return ReplicaLoss("finished")
        self.num_resumes += 1
        sent_again = dataclasses.replace(self.call, request_id=f"{request_id}-resume{self.num_resumes}")
        if state is None:
            logger.warning("request %s: its replica died before any token; sending it again", request_id)
            return ReplicaLoss("retried", sent_again)
        if params.seed is not None and not params.greedy:
            return self._failed(err, "a seeded sample cannot continue elsewhere")
        logprobs = tuple(state.logprobs) if params.logprobs is not None else None
        if logprobs is not None and len(logprobs) != len(state.token_ids):
            return self._failed(err, "its streamed logprobs do not match its tokens")
        point = ResumePoint(tuple(state.token_ids), logprobs, tuple(self._text_pieces))
        logger.warning(
            "request %s: its replica died after %d tokens; resuming on another", request_id, len(point.token_ids)
        )
        resumed_params = dataclasses.replace(params, prompt_logprobs=None)
        return ReplicaLoss("resumed", dataclasses.replace(sent_again, params=resumed_params, resume=point))

    def _failed(self, err: BaseException, why: str) -> ReplicaLoss:
        logger.warning(
            "request %s: its replica died (%s: %s); %s, so it ends", self.call.request_id, type(err).__name__, err, why
        )
        return ReplicaLoss("failed")

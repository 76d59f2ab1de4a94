"""Where a decode replica's long prompt is computed: by the prefill pool, or by the replica itself.

A prompt whose uncached part reaches ``disaggregation_threshold_tokens`` goes
to the prefill pool unless the pool is busier than this replica (``balance``,
the config's ``router.balance_prefill``). The replica knows two queues without
asking anyone: the uncached tokens of its remote prefills not yet answered,
and those of the long prompts it prefills itself that have not yet produced
a token. A prompt goes to the pool when the first is no longer than the
second, so an idle pool always gets it; otherwise it is computed here. A burst
of new sessions is then split between the pool and the replica, instead of
queueing on the pool until its remote prefills time out and are computed here
all the same::

    remote tokens waiting > local tokens waiting --> here ("pool_busy")
    the pool's queue is full (Serve's max_queued_requests) --> here ("pool_full"); the pool is asked again next time
    the pool fails or is too slow --------------> here ("failed_prefill"); the pool is left alone for PREFILL_BACKOFF_S
    otherwise ----------------------------------> the pool ("disaggregated")

A remote prefill may take PREFILL_TIMEOUT_S plus, for each token it computes
and each token of this replica's remote prefills ahead of it, LIMIT_FACTOR times
the seconds per token this replica's long prefills took (the pool's answers and
its own first tokens, queueing included), and never less than
PREFILL_TIMEOUT_S_PER_TOKEN. A dead prefill replica fails its calls at once, but
calls sent while the pool has no live replica wait for a replacement, and a
stuck replica never answers; a pool that is merely slow, as on CPUs, is not
given up on, which would waste the work it has done.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from ray.serve.exceptions import BackPressureError

from rayturn.messages import Call, PrefillAnswer

logger = logging.getLogger(__name__)

PREFILL_TIMEOUT_S = 5.0
PREFILL_TIMEOUT_S_PER_TOKEN = 1 / 2000
LIMIT_FACTOR = 3.0
# After a remote prefill failed, the replica prefills locally for this long before asking the pool again.
PREFILL_BACKOFF_S = 5.0


class RemotePrefill:
    """A decode replica's view of the prefill pool (``pool``: a Serve handle) and of its own long prefills."""

    def __init__(
        self,
        pool: Any,
        counters: dict[str, int],
        *,
        balance: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.counters = counters
        for name in ("disaggregated", "failed_prefill", "pool_busy", "pool_full"):
            counters.setdefault(name, 0)
        self.balance = balance
        self.clock = clock
        self.remote_tokens = 0  # uncached tokens of this replica's remote prefills not yet answered
        self.seconds_per_token = 0.0  # what this replica's long prefills took per token, queueing included (EWMA)
        self.local_tokens = 0  # uncached tokens of long prompts prefilled here that have no token yet
        self._again_at = 0.0  # clock() from which the pool is asked again

    @property
    def open(self) -> bool:
        """Whether the pool is asked at all: not within ``PREFILL_BACKOFF_S`` of a failure."""
        return self.clock() >= self._again_at

    async def prefill(self, call: Call, uncached: int) -> PrefillAnswer | None:
        """The pool's answer for ``call``, whose prompt has ``uncached`` tokens to compute; None: compute it here
        (then count it with ``started_here`` until its first token)."""
        if self.balance and self.remote_tokens > self.local_tokens:
            self.counters["pool_busy"] += 1
            return None
        queued = self.remote_tokens + uncached
        per_token = max(PREFILL_TIMEOUT_S_PER_TOKEN, LIMIT_FACTOR * self.seconds_per_token)
        started_s = self.clock()
        self.remote_tokens += uncached
        try:
            answer: PrefillAnswer = await asyncio.wait_for(
                self.pool.prefill.remote(call), PREFILL_TIMEOUT_S + queued * per_token
            )
        except BackPressureError:  # the pool's queue is full: a moment's state, not a failure
            self.counters["pool_full"] += 1
            return None
        except Exception as err:  # the prefill pool failing must not fail the call
            self.counters["failed_prefill"] += 1
            self._again_at = self.clock() + PREFILL_BACKOFF_S
            logger.warning("remote prefill failed, prefilling locally: %s: %s", type(err).__name__, err)
            return None
        finally:
            self.remote_tokens -= uncached
        self.counters["disaggregated"] += 1
        self._took(self.clock() - started_s, queued)
        return answer

    def started_here(self, uncached: int) -> Callable[[bool], None]:
        """Count a long prompt this replica prefills itself; the function returned ends the count, once however
        often it is called: at its first token (``answered``: the time it took is learnt), or its end."""
        queued = self.local_tokens + uncached
        started_s = self.clock()
        self.local_tokens += uncached
        counted = [uncached]

        def done(answered: bool = True) -> None:
            if counted[0]:
                self.local_tokens -= counted[0]
                counted[0] = 0
                if answered:
                    self._took(self.clock() - started_s, queued)

        return done

    def _took(self, elapsed_s: float, queued_tokens: int) -> None:
        """A long prefill answered after ``elapsed_s``, with ``queued_tokens`` to compute (its own and those queued
        ahead of it, as this replica counts them)."""
        observed = elapsed_s / max(queued_tokens, 1)
        self.seconds_per_token = observed if not self.seconds_per_token else (self.seconds_per_token + observed) / 2

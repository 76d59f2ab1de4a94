"""The return-hazard idle predictor (the default): pages on the device exactly while a return is likely enough.

See ``HazardIdlePredictor``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from .predictors import MIN_GAP_S, IdlePrediction, IdlePrior, TurnEndFeatures

_STANDARD_NORMAL = NormalDist()

# The return-time grid of ``HazardIdlePredictor``: log seconds from 1 s to about two days. Grid
# point k stands for the cell of log seconds within half a step of it; the first cell also holds
# returns within a second, and what lies past the last cell is kept as a tail of its own.
_HAZARD_GRID_POINTS = 256
_LOG_GRID = np.linspace(0.0, math.log(2.0e5), _HAZARD_GRID_POINTS)
_GRID_S = np.exp(_LOG_GRID)
_LOG_STEP = float(_LOG_GRID[1] - _LOG_GRID[0])
_GRID_END = float(_LOG_GRID[-1] + 0.5 * _LOG_STEP)
# A cell's mass over this is its mean density per second.
_PER_SECOND = 1.0 / (_LOG_STEP * _GRID_S)
# A session's return-time density remembers this many of its latest gaps.
HAZARD_HISTORY_GAPS = 32
# Sessions whose schedule (and own return-time mass) is kept for the next look within the same gap.
HAZARD_CACHE_ENTRIES = 4096
# The log-normal's centre is taken to this step (log seconds), so that a schedule and the prior's
# mass serve until the centre has moved a step (the global drift term moves it a little with every
# gap any session ends).
HAZARD_CENTRE_STEP = 0.01
# The announced share is taken to this step, for the same reason.
HAZARD_SHARE_STEP = 0.01
# Prior masses kept, one per centre step in use.
HAZARD_PRIOR_ENTRIES = 256
# Past this share of the mass still to come, the density says nothing more: no return is planned for.
HAZARD_MIN_AWAY = 1e-9


@dataclass(frozen=True, slots=True)
class _Schedule:
    """One gap's plan on the grid: where the pages belong on the device, and the return-time CDF."""

    on: np.ndarray  # bool per grid point: the return hazard there is worth the residency
    cdf: np.ndarray  # the share of returns before each grid point (cell midpoints)


class HazardIdlePredictor:
    """Return-hazard predictor: pages on the device exactly while a return is likely enough.

    At a turn end the session's return time gets a density over log seconds:
    the prior's log-normal (centre from the turn-end features plus a slow
    global drift) mixed with Laplace kernels on the session's own latest gaps,
    which gain weight as the session shows more of them. Its hazard (the
    chance per second that a user who is still away returns now) decides: the
    pages belong on the device while the hazard is at least
    ``1 / warm_return_worth_s``, the worth scaled by ``1 - announced_share``
    (a return the client announces is warm without residency). The hazard of
    real think times falls, rises again near the gaps a session keeps
    repeating, and falls after them (a
    Laplace kernel's tail, unlike a normal one's, does not say "late, so surely
    back any second"), so one gap may hold, offload, prewarm before a likely
    return, and offload again when the user does not come. ``lower_s`` is when
    the pages should be back on the device (the idle time so far while they
    belong there, ``inf`` when no return is worth waiting for), ``point_s``
    the conditional median of the return.
    """

    def __init__(self, prior: IdlePrior | None = None, max_sessions: int = 100_000):
        self.prior = prior or IdlePrior()
        config = self.prior.config
        self._decay = 0.5 ** (1.0 / config.session_half_life_gaps)
        self._worth_s = config.warm_return_worth_s
        # A Laplace kernel on the grid, out to where it has fallen below a millionth.
        self._reach = math.ceil(14.0 * config.gap_kernel_log_width / _LOG_STEP)
        offsets = np.arange(-self._reach, self._reach + 1)
        kernel = np.exp(-np.abs(offsets) * _LOG_STEP / config.gap_kernel_log_width)
        self._kernel = kernel / kernel.sum()  # one unit of mass per gap
        self._max_sessions = max_sessions
        self._global_bias = 0.0
        # Each session's latest log gaps, oldest first; least recently observed session first.
        self._sessions: OrderedDict[str, list[float]] = OrderedDict()
        # Each recent session's last schedule, under the centre and announced-share steps it was computed for.
        self._schedules: OrderedDict[str, tuple[tuple[int, int], _Schedule]] = OrderedDict()
        # Each recent session's own return-time masses (grid, past the grid) and their share of the mix.
        self._own: OrderedDict[str, tuple[np.ndarray, float, float]] = OrderedDict()
        # The prior's masses (grid, past the grid) by centre step.
        self._prior_masses: OrderedDict[int, tuple[np.ndarray, float]] = OrderedDict()

    def observe_gap(self, session_id: str, features: TurnEndFeatures, gap_s: float) -> None:
        if not math.isfinite(gap_s):
            return
        log_gap = math.log(max(gap_s, MIN_GAP_S))
        self._global_bias += self.prior.config.global_rate * (log_gap - self.prior.centre(features) - self._global_bias)
        gaps = self._sessions.pop(session_id, None) or []
        gaps.append(log_gap)
        del gaps[:-HAZARD_HISTORY_GAPS]
        self._sessions[session_id] = gaps
        self._forget(session_id)
        if len(self._sessions) > self._max_sessions:
            dropped, _ = self._sessions.popitem(last=False)
            self._forget(dropped)

    def _forget(self, session_id: str) -> None:
        """Drop what was derived from a session's gaps."""
        self._schedules.pop(session_id, None)
        self._own.pop(session_id, None)

    def masses(self, session_id: str, features: TurnEndFeatures) -> tuple[np.ndarray, float]:
        """The session's return-time distribution: the mass of each grid cell, and the mass past the grid."""
        return self._masses(session_id, self._centre_step(features))

    def _centre_step(self, features: TurnEndFeatures) -> int:
        return round((self.prior.centre(features) + self._global_bias) / HAZARD_CENTRE_STEP)

    def _masses(self, session_id: str, centre_step: int) -> tuple[np.ndarray, float]:
        mass, beyond = self._prior(centre_step)
        own = self._own_masses(session_id)
        if own is None:
            return mass, beyond
        own_mass, own_beyond, share = own
        return share * own_mass + (1.0 - share) * mass, share * own_beyond + (1.0 - share) * beyond

    def _prior(self, centre_step: int) -> tuple[np.ndarray, float]:
        """The prior's log-normal around the centre step, as masses."""
        cached = self._prior_masses.get(centre_step)
        if cached is not None:
            return cached
        centre, sigma = centre_step * HAZARD_CENTRE_STEP, self.prior.log_std
        mass = np.exp(-0.5 * ((_LOG_GRID - centre) / sigma) ** 2) * (_LOG_STEP / (sigma * math.sqrt(2.0 * math.pi)))
        mass[0] += _STANDARD_NORMAL.cdf((-0.5 * _LOG_STEP - centre) / sigma)  # back within the first second
        beyond = 1.0 - _STANDARD_NORMAL.cdf((_GRID_END - centre) / sigma)
        self._prior_masses[centre_step] = (mass, beyond)
        if len(self._prior_masses) > HAZARD_PRIOR_ENTRIES:
            self._prior_masses.popitem(last=False)
        return mass, beyond

    def _own_masses(self, session_id: str) -> tuple[np.ndarray, float, float] | None:
        """The session's own return-time masses from its gaps, and their share of the mix (None: no gaps)."""
        cached = self._own.get(session_id)
        if cached is not None:
            self._own.move_to_end(session_id)
            return cached
        gaps = self._sessions.get(session_id)
        if not gaps:
            return None
        weights = self._decay ** np.arange(len(gaps) - 1, -1, -1, dtype=np.float64)
        total = float(weights.sum())
        # Spread each gap over its two neighbouring grid points, then lay the kernel over them.
        far = _HAZARD_GRID_POINTS + self._reach  # a gap beyond this adds nothing to the grid
        position = np.minimum(np.asarray(gaps) / _LOG_STEP, float(far))
        below = position.astype(np.int64)
        above_share = position - below
        points = np.bincount(below, weights * (1.0 - above_share), minlength=far + 2)
        points += np.bincount(below + 1, weights * above_share, minlength=far + 2)
        spread = np.convolve(points, self._kernel) / total  # index reach + k is grid point k
        own = spread[self._reach : self._reach + _HAZARD_GRID_POINTS].copy()
        own[0] += spread[: self._reach].sum()
        own_beyond = float(spread[self._reach + _HAZARD_GRID_POINTS :].sum())
        share = total / (total + self.prior.config.shrinkage_gaps)
        self._own[session_id] = (own, own_beyond, share)
        if len(self._own) > HAZARD_CACHE_ENTRIES:
            self._own.popitem(last=False)
        return own, own_beyond, share

    def _schedule(self, session_id: str, features: TurnEndFeatures) -> _Schedule:
        centre_step = self._centre_step(features)
        share_step = round(min(max(features.announced_share, 0.0), 1.0) / HAZARD_SHARE_STEP)
        key = (centre_step, share_step)
        cached = self._schedules.get(session_id)
        if cached is not None and cached[0] == key:
            self._schedules.move_to_end(session_id)
            return cached[1]
        mass, beyond = self._masses(session_id, centre_step)
        # Residency one warm return is worth: less the share of returns that come announced anyway.
        worth_s = self._worth_s * max(1.0 - share_step * HAZARD_SHARE_STEP, 0.0)
        # Still away on reaching a grid point: the mass from that point on, summed from the far end
        # so that a thin tail keeps its size.
        away = np.cumsum(mass[::-1])[::-1] + beyond
        total = max(float(away[0]), 1e-300)
        # The hazard per second, mass / (cell width in seconds) / away, against the threshold.
        on = (mass * _PER_SECOND * worth_s >= away) & (away > HAZARD_MIN_AWAY * total)
        schedule = _Schedule(on, 1.0 - (away - 0.5 * mass) / total)
        self._schedules.pop(session_id, None)
        self._schedules[session_id] = (key, schedule)
        if len(self._schedules) > HAZARD_CACHE_ENTRIES:
            self._schedules.popitem(last=False)
        return schedule

    def predict(self, session_id: str, features: TurnEndFeatures) -> IdlePrediction:
        schedule = self._schedule(session_id, features)
        elapsed = features.idle_so_far_s
        log_elapsed = math.log(max(elapsed, MIN_GAP_S))
        index = min(round(log_elapsed / _LOG_STEP), _HAZARD_GRID_POINTS - 1)
        ahead = np.flatnonzero(schedule.on[index:])
        if ahead.size == 0:
            back_by_s = math.inf
        else:
            back_by_s = max(elapsed, float(_GRID_S[index + int(ahead[0])]) * math.exp(-0.5 * _LOG_STEP))
        passed = float(np.interp(log_elapsed, _LOG_GRID, schedule.cdf)) if elapsed > 0 else 0.0
        median_index = int(np.searchsorted(schedule.cdf, passed + 0.5 * (1.0 - passed)))
        point_s = float(_GRID_S[median_index]) if median_index < _HAZARD_GRID_POINTS else math.exp(_GRID_END)
        return IdlePrediction(max(point_s, elapsed), back_by_s)

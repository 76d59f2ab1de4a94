"""Online calibration of the cost model against the energy each step measured.

The last ``window_steps`` steps are kept (``step_totals`` and the joules
measured). The model is fitted once ``min_steps`` are in, then again every
``refit_every`` steps: for each knee of a grid, the linear coefficients
(``PARAMETERS``) by non-negative least squares (exact: with six unknowns
every support is tried, in one batched solve), and the knee whose fit leaves the least residual wins (ties: the
smaller knee, the model with less sharing). A knee of 1 is the additive
model, so the fit only shares the dense layers' cost when the measurements
say steps are memory bound. Until the first fit the defaults stand.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

import numpy as np

from .cost_model import PARAMETERS, CostCoefficients, RequestWork, step_totals

KNEES_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
NUM_PARAMETERS = len(PARAMETERS)
# Every non-empty subset of the parameters as a 0/1 mask: the supports tried by the exact NNLS.
SUPPORTS = np.array(
    [mask for mask in itertools.product((0.0, 1.0), repeat=NUM_PARAMETERS) if any(mask)], dtype=np.float64
)


class OnlineCalibrator:
    def __init__(
        self,
        defaults: CostCoefficients,
        window_steps: int = 2048,
        refit_every: int = 512,
        min_steps: int = 32,
        knees_tokens: Seq[int] = KNEES_TOKENS,
    ) -> None:
        if not 1 <= min_steps <= window_steps:
            raise ValueError(f"need 1 <= min_steps <= window_steps, got {min_steps} and {window_steps}")
        if refit_every < 1:
            raise ValueError(f"refit_every must be >= 1, got {refit_every}")
        self.coefficients = defaults
        self.refit_every = refit_every
        self.min_steps = min_steps
        self.knees_tokens = np.array(sorted(knees_tokens), dtype=np.float64)
        # A ring of rows: ``step_totals``, then the measured joules. Rows arrive as Python tuples (one every step)
        # and join the array only when fitting.
        self._window = np.zeros((window_steps, 6))
        self._arrived: list[tuple[float, ...]] = []
        self._num_observed = 0
        self.num_fits = 0

    @property
    def num_steps(self) -> int:
        """Steps in the window now."""
        return min(self._num_observed, len(self._window))

    def observe(self, works: Seq[RequestWork], energy_j: float) -> None:
        """Record one step's composition and measured energy; refit when it is time."""
        self._arrived.append((*step_totals(works), energy_j))
        self._num_observed += 1
        if len(self._arrived) >= len(self._window):  # no fit for a whole window (a long first wait): fold them in
            self._take_arrived()
        if self._num_observed >= self.min_steps and (self._num_observed - self.min_steps) % self.refit_every == 0:
            self.refit()

    def refit(self) -> None:
        """Fit the coefficients and the knee to the steps in the window."""
        self._take_arrived()
        rows = self._window[: self.num_steps]
        energy_j = rows[:, -1]
        # The regressors: column 1 (the dense layers' tokens, max(knee, T)) is the only one that depends on
        # the knee, so the Gram matrix is shared but for its row and column 1. Each column is scaled to at most 1.
        regressors = np.empty((len(rows), NUM_PARAMETERS))
        regressors[:, 0] = 1.0
        regressors[:, 1] = 0.0
        regressors[:, 2:] = rows[:, 1:5]
        dense = np.maximum(self.knees_tokens[:, None], rows[None, :, 0])  # (knees, steps)
        gram = np.repeat((regressors.T @ regressors)[None], len(self.knees_tokens), axis=0)
        cross = dense @ regressors
        gram[:, 1, :] = cross
        gram[:, :, 1] = cross
        gram[:, 1, 1] = np.einsum("ks,ks->k", dense, dense)
        moment = np.repeat((regressors.T @ energy_j)[None], len(self.knees_tokens), axis=0)
        moment[:, 1] = dense @ energy_j
        scale = np.repeat(np.abs(regressors).max(axis=0)[None], len(self.knees_tokens), axis=0)
        scale[:, 1] = dense.max(axis=1)  # regressors are >= 0
        scale[scale == 0] = 1.0
        gram /= scale[:, :, None] * scale[:, None, :]
        moment /= scale
        parameters, residual = _nnls_by_support(gram, moment, float(energy_j @ energy_j))
        best = int(np.argmin(residual))  # argmin keeps the first (smallest knee) of equal fits
        self.coefficients = self.coefficients.with_parameters(
            parameters[best] / scale[best], int(self.knees_tokens[best])
        )
        self.num_fits += 1

    def _take_arrived(self) -> None:
        """Write the rows that arrived since the last fit into the ring (the latest ``window_steps`` of them)."""
        arrived = np.array(self._arrived[-len(self._window) :], dtype=np.float64).reshape(-1, 6)
        self._arrived.clear()
        first = self._num_observed - len(arrived)
        rows = (first + np.arange(len(arrived))) % len(self._window)
        self._window[rows] = arrived


def _nnls_by_support(gram: np.ndarray, moment: np.ndarray, energy_sq: float) -> tuple[np.ndarray, np.ndarray]:
    """Per knee: the least-squares parameters that are all >= 0, and their residual sum of squares.

    Solves the normal equations on every support at once (parameters off the
    support pinned to 0) and keeps, per knee, the feasible support with the
    least residual. Measured energy and regressors are >= 0, so a one-parameter support
    is always feasible.
    """
    num_knees = gram.shape[0]
    on = SUPPORTS[None, :, :, None] * SUPPORTS[None, :, None, :]
    ridge = 1e-12 * np.trace(gram, axis1=1, axis2=2)[:, None, None, None] * np.eye(NUM_PARAMETERS)
    system = gram[:, None] * on + np.eye(NUM_PARAMETERS) * (1.0 - SUPPORTS[None, :, :, None]) + ridge
    rhs = moment[:, None, :] * SUPPORTS[None]
    solution = np.linalg.solve(system, rhs[..., None])[..., 0] * SUPPORTS[None]
    residual = energy_sq - 2.0 * np.einsum("kmp,kp->km", solution, moment) + ((solution @ gram) * solution).sum(axis=2)
    residual = np.where((solution >= 0).all(axis=2), residual, np.inf)
    best = np.argmin(residual, axis=1)
    picked = solution[np.arange(num_knees), best]
    return picked, residual[np.arange(num_knees), best]

"""The engine's energy accounts: each step measured, split among its requests, summed per request and session.

Per step (``LLMEngine._run``)::

    step(chunks) --enter: each chunk's work, meter read--> the model runs
        --exit: meter read--> queued; every ``flush_steps`` steps, and whenever
        an account is read: record, in order: Shapley split of the step's joules
        (cost model with the current coefficients), token split beside it, both
        added to each request and its session; then the calibrator sees the step

Why queued: on a small model a step's split is Python right after the model
ran, with the interpreter's data out of the caches; the same splits made back
to back cost a third as much (``bench/energy_attribution.py``'s
``accounting_*`` figures). Recording in order keeps every figure what it would
be step by step: each split uses the coefficients the steps before it left.

A request's account opens when it is queued (``open``, with its session) and
is dropped when its finished output has been reported (``annotate``) or it is
aborted (``close``); a session's total outlives its requests (the most recent
``max_sessions`` sessions are kept). Every output reported carries the
request's joules so far and the meter's name: complete for a finished output
(its steps are recorded first), and at most ``flush_steps - 1`` steps behind
for one still running (never decreasing). Reading an account
(``request_energy``, ``session_energy_j``, ``stats``) or closing one records
the queued steps first; the running totals (``energy_j``, ``num_steps``,
``step_s``, ``accounting_s``) count recorded steps only (``flush`` records
the rest). The time the accounting takes (work, split,
calibration, accounts) is kept beside the steps' own time.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..outputs import RequestOutput
from .calibration import OnlineCalibrator
from .cost_model import CostCoefficients, RequestWork
from .meters import EnergyMeter, select_meter
from .shapley import proportional_split, shapley_split

if TYPE_CHECKING:
    from ..scheduler import ScheduledChunk

# Until the first fit. CPU (the power model, 5 W per busy core): `bench/energy_attribution.py`'s fit of the
# `tiny` preset on a 2-core AMD EPYC. Accelerator: an 8B model on an H100-class board, from its bandwidth,
# arithmetic and power (weights read in ~5 ms at ~500 W, ~27 us of arithmetic a token, 128 KiB of KV a token).
CPU_DEFAULTS = CostCoefficients(
    fixed_j=0.007, token_j=1e-4, knee_tokens=1, request_j=5e-4, context_j=1e-7, attention_j=1e-8, page_move_j=1e-4
)
ACCELERATOR_DEFAULTS = CostCoefficients(
    fixed_j=0.5, token_j=0.0135, knee_tokens=128, request_j=0.01, context_j=2e-5, attention_j=4e-7, page_move_j=1e-3
)
MAX_SESSIONS = 4096
FLUSH_STEPS = 16
"""Steps queued before they are recorded together (see the module docstring)."""


@dataclass(slots=True)
class RequestEnergy:
    session_id: str | None
    shapley_j: float = 0.0
    proportional_j: float = 0.0
    loads_charged: bool = False
    saves_charged: bool = False


@dataclass(frozen=True, slots=True)
class StepAttribution:
    """One step's joules and how they were split, in the order of the step's works."""

    energy_j: float
    shapley_j: list[float]
    proportional_j: list[float]
    exact: bool


class EnergyLedger:
    def __init__(
        self,
        meter: EnergyMeter,
        page_size: int,
        calibrator: OnlineCalibrator,
        moves_pages: bool = False,
        seed: int = 0,
        max_sessions: int = MAX_SESSIONS,
        flush_steps: int = FLUSH_STEPS,
    ) -> None:
        if flush_steps < 1:
            raise ValueError(f"flush_steps must be >= 1, got {flush_steps}")
        self.meter = meter
        self.page_size = page_size
        self.calibrator = calibrator
        # Whether the engine saves and loads pages through a KV store (whose moves the model charges).
        self.moves_pages = moves_pages
        self.max_sessions = max_sessions
        self.flush_steps = flush_steps
        self._queued: list[tuple[Seq[RequestWork], float, float]] = []
        self._rng = np.random.default_rng(seed)
        self._requests: dict[str, RequestEnergy] = {}
        self._sessions: OrderedDict[str, float] = OrderedDict()
        self.num_steps = 0
        self.num_sampled_steps = 0
        self.energy_j = 0.0
        self.step_s = 0.0
        self.accounting_s = 0.0

    @classmethod
    def for_device(cls, device: torch.device, page_size: int, moves_pages: bool = False) -> EnergyLedger:
        """The ledger of an engine on ``device``: its best meter, and defaults for its kind until the first fit."""
        defaults = CPU_DEFAULTS if device.type == "cpu" else ACCELERATOR_DEFAULTS
        return cls(select_meter(device), page_size, OnlineCalibrator(defaults), moves_pages)

    def scratch(self) -> EnergyLedger:
        """A ledger of no account on the same meter (a meter may hold a thread: no second one is opened), with
        this ledger's coefficients: for steps that must not count, such as the start-up warm-up's."""
        self.flush()
        return EnergyLedger(
            self.meter,
            self.page_size,
            OnlineCalibrator(self.calibrator.coefficients),
            self.moves_pages,
            flush_steps=self.flush_steps,
        )

    # -- accounts -----------------------------------------------------------

    def open(self, request_id: str, session_id: str | None) -> None:
        self._requests[request_id] = RequestEnergy(session_id)

    def close(self, request_id: str) -> None:
        """Drop an aborted request's account (its session keeps what it spent)."""
        self.flush()
        self._requests.pop(request_id, None)

    def request_energy(self, request_id: str) -> RequestEnergy | None:
        self.flush()
        return self._requests.get(request_id)

    def session_energy_j(self, session_id: str) -> float:
        self.flush()
        return self._sessions.get(session_id, 0.0)

    def annotate(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The outputs, fresh from this step, with each request's joules so far; finished requests' accounts are
        dropped."""
        if self._queued and any(output.finished for output in outputs):
            self.flush()  # a finished output carries all its joules, and its account goes
        start_s = time.perf_counter()
        meter_name = self.meter.name
        for output in outputs:
            account = self._requests.get(output.request_id)
            if output.finished:
                self._requests.pop(output.request_id, None)
            # Set in place: the engine made these outputs this step and nobody holds them yet (a copy of each,
            # through dataclasses.replace, was a tenth of the step's accounting).
            object.__setattr__(output, "energy_j", account.shapley_j if account is not None else 0.0)
            object.__setattr__(output, "energy_meter", meter_name)
        self.accounting_s += time.perf_counter() - start_s
        return outputs

    # -- steps --------------------------------------------------------------

    def step(self, chunks: Seq[ScheduledChunk]) -> _StepMeasurement:
        """Measure the model run of one step (entered before the chunks advance) and split it; a step that raises
        is not recorded."""
        start_s = time.perf_counter()
        works = [self._work(chunk) for chunk in chunks]
        self.accounting_s += time.perf_counter() - start_s
        return _StepMeasurement(self, works)

    def queue(self, works: Seq[RequestWork], energy_j: float, step_s: float) -> None:
        """Keep one step's measurement for :meth:`record`, which runs once ``flush_steps`` are queued."""
        self._queued.append((works, energy_j, step_s))
        if len(self._queued) >= self.flush_steps:
            self.flush()

    def flush(self) -> None:
        """Record the queued steps, in the order they ran."""
        queued, self._queued = self._queued, []
        for works, energy_j, step_s in queued:
            self.record(works, energy_j, step_s)

    def record(self, works: Seq[RequestWork], energy_j: float, step_s: float) -> StepAttribution:
        """Split one step's measured joules among its works, add them to the accounts, calibrate; steps queued
        before it are recorded first."""
        if self._queued:
            self.flush()
        start_s = time.perf_counter()
        split = shapley_split(works, self.calibrator.coefficients, self._rng)
        modelled_j = sum(split.values_j)
        proportional_j = proportional_split(works, energy_j)
        scale = energy_j / modelled_j if modelled_j > 0 else 0.0
        shapley_j = [value * scale for value in split.values_j] if modelled_j > 0 else proportional_j
        requests = self._requests
        for work, shapley, proportional in zip(works, shapley_j, proportional_j):
            account = requests.get(work.request_id)
            if account is None:
                account = requests[work.request_id] = RequestEnergy(None)
            account.shapley_j += shapley
            account.proportional_j += proportional
            if account.session_id is not None:
                self._add_to_session(account.session_id, shapley)
        self.calibrator.observe(works, energy_j)
        self.num_steps += 1
        self.num_sampled_steps += not split.exact
        self.energy_j += energy_j
        self.step_s += step_s
        self.accounting_s += time.perf_counter() - start_s
        return StepAttribution(energy_j, shapley_j, proportional_j, split.exact)

    def stats(self) -> dict[str, float | int | str]:
        self.flush()
        coefficients = self.calibrator.coefficients
        return {
            "meter": self.meter.name,
            "steps": self.num_steps,
            "sampled_steps": self.num_sampled_steps,
            "energy_j": self.energy_j,
            "accounting_fraction": self.accounting_s / self.step_s if self.step_s > 0 else 0.0,
            "fits": self.calibrator.num_fits,
            **{f"model_{field.name}": getattr(coefficients, field.name) for field in dataclasses.fields(coefficients)},
        }

    def _work(self, chunk: ScheduledChunk) -> RequestWork:
        """A chunk's work, read before it runs: its tokens, their context, and the pages it moves."""
        seq = chunk.seq
        account = self._requests.setdefault(seq.request_id, RequestEnergy(None))
        cached = seq.num_cached_prompt_tokens or 0
        pages_moved = 0
        if seq.num_loaded_prompt_tokens and not account.loads_charged:
            pages_moved += -(-seq.num_loaded_prompt_tokens // self.page_size)
            account.loads_charged = True
        if self.moves_pages and not account.saves_charged and chunk.samples and seq.num_output_tokens == 0:
            pages_moved += seq.num_prompt_tokens // self.page_size - cached // self.page_size
            account.saves_charged = True
        # Draft tokens being verified (speculative decoding) run through the model as the chunk's own do.
        return RequestWork.chunk(
            seq.request_id, seq.num_computed_tokens, chunk.num_scheduled_tokens, max(pages_moved, 0)
        )

    def _add_to_session(self, session_id: str, energy_j: float) -> None:
        self._sessions[session_id] = self._sessions.get(session_id, 0.0) + energy_j
        self._sessions.move_to_end(session_id)
        if len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)


class _StepMeasurement:
    """``with ledger.step(chunks):`` around a model run: the meter read on entry and exit, then the split."""

    __slots__ = ("_ledger", "_run_start_s", "_start_j", "_works")

    def __init__(self, ledger: EnergyLedger, works: list[RequestWork]) -> None:
        self._ledger = ledger
        self._works = works
        self._run_start_s = 0.0
        self._start_j = 0.0

    def __enter__(self) -> None:
        self._run_start_s = time.perf_counter()
        self._start_j = self._ledger.meter.read_j()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            energy_j = self._ledger.meter.read_j() - self._start_j
            self._ledger.queue(self._works, energy_j, time.perf_counter() - self._run_start_s)

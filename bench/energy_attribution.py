"""Per-request energy: the Shapley split of each step against splitting it by tokens, on two ground truths.

(a) Synthetic: workloads of 6-10 agent calls (32-2,000 new prompt tokens
after 2k-100k cached ones, half of them loaded from the store, 16-300
output tokens, staggered arrivals) are scheduled like the engine does (512
tokens a step, decodes first, prompts chunked into what is left). A step's
true cost is a known function (``TrueCost``: an 8B model on an H100-class
board) whose form the model does not share: a smooth roofline for the dense
layers, ``token_j * (knee^4 + T^4)^(1/4)``, and per request the larger of
its KV read and its attention arithmetic, plus a fixed cost, per-request
bookkeeping and page moves. The meter reads it with 5% noise. Ground truth:
each request's share of a step is its exact Shapley value of the *true*
function (every coalition enumerated); of a workload, the sum over its
steps. The engine's calibrator learns the cost model online from the noisy
step totals only, and the attribution splits each measured step by Shapley
values of the fitted model.

(b) This machine: requests of mixed prompt lengths and output lengths, each
run alone through the offline engine and then all together, every step
measured by the engine's own meter (``meter`` in the result), with a small
token budget per step (``--step-tokens``) so prompt chunks share steps with
decodes. Ground truth: each request's share of the energy its isolated runs
took. Both the isolated energies and the batched run's attributions are
averaged over the repeats (``isolated_run_l1_to_their_mean`` says how far a
single isolated run is from that mean: the host's noise). The ledger is the
engine's: it calibrates online across the isolated and batched runs.

(c) This machine, by coalitions (``coalition_truth``): an isolated run pays
every step's fixed cost alone, which a batch shares, so it is not the share
Shapley values claim. Every coalition of the first six requests is run and
measured; the truth is the exact Shapley values of those measured energies.

The error of a split is the L1 distance of its normalised shares to the true
ones (0: equal, 2: disjoint): per request over a workload (``shapley_l1``,
``proportional_l1``), and in (a) per step of two requests or more
(``step_...``); each also on the workloads or steps where the token split is
off by 0.40 or more (``..._where_proportional_at_least_floor``). The cost of
attribution: the ledger's own time (work, split, calibration, accounts; steps
recorded ``flush_steps`` at a time, as a served engine's ledger does) over
the steps' model-run time (wall clock) and over the whole engine steps
(scheduling, sampling and outputs too), the same in CPU time where the meter
is the power model, and the split alone on bigger batches.

    python bench/energy_attribution.py [--quick] [--model tiny] [--threads 1]

The last line of stdout is one JSON object: ``synthetic`` and ``engine`` each
with ``shapley_l1`` and ``proportional_l1``; targets: Shapley L1 <= 0.15 where
token-proportional is >= 0.40, ``accounting_fraction`` < 0.02.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence as Seq
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
import torch
from _common import peak_rss_mb

from rayturn.engine import LLMEngine, SamplingParams
from rayturn.engine.energy import (
    CostCoefficients,
    EnergyLedger,
    ModelMeter,
    OnlineCalibrator,
    RequestWork,
    StepAttribution,
    exact_shapley,
    proportional_split,
    shapley_split,
)
from rayturn.engine.energy.ledger import ACCELERATOR_DEFAULTS, CPU_DEFAULTS
from rayturn.replay.harness import Progress, add_out_argument, emit, machine

STEP_TOKENS = 512
PAGE_SIZE = 16
NOISE = 0.05
L1_TARGET = 0.15
PROPORTIONAL_FLOOR = 0.40
ACCOUNTING_TARGET = 0.02


@dataclass(frozen=True, slots=True)
class TrueCost:
    """The synthetic ground truth, in the orders of magnitude of an 8B model on an H100-class board.

    The dense layers: a smooth roofline (4-norm of the weights' read and the
    arithmetic), not the model's hard ``max``. Attention: each request's own
    roofline, the larger of reading its KV cache and the arithmetic, not the
    model's sum of both.
    """

    fixed_j: float = 0.5
    token_j: float = 0.0135
    knee_tokens: float = 180.0
    request_j: float = 0.01
    kv_read_j: float = 2e-5  # per context token read
    attention_j: float = 4.4e-7  # per token attended
    page_move_j: float = 0.01

    def cost_j(self, works: Seq[RequestWork]) -> float:
        if not works:
            return 0.0
        total = sum(work.new_tokens for work in works)
        dense = self.token_j * (self.knee_tokens**4 + total**4) ** 0.25
        own = sum(
            self.request_j
            + max(self.kv_read_j * work.context_tokens, self.attention_j * work.attended_tokens)
            + self.page_move_j * work.pages_moved
            for work in works
        )
        return self.fixed_j + dense + own


@dataclass(slots=True)
class SimRequest:
    request_id: str
    cached_tokens: int
    prompt_tokens: int
    output_tokens: int
    arrival_step: int
    loads_prefix: bool
    computed: int = 0
    generated: int = 0

    @property
    def done(self) -> bool:
        return self.generated >= self.output_tokens


def synthetic_workload(rng: np.random.Generator, index: int) -> list[SimRequest]:
    """An agent's calls: long cached prefixes (half of them loaded from the store), short suffixes, short outputs."""
    return [
        SimRequest(
            f"w{index}r{i}",
            cached_tokens=log_uniform(rng, 2_000, 100_000) // PAGE_SIZE * PAGE_SIZE,
            prompt_tokens=log_uniform(rng, 32, 2_000),
            output_tokens=log_uniform(rng, 16, 300),
            arrival_step=int(rng.integers(0, 60)),
            loads_prefix=bool(rng.random() < 0.5),
        )
        for i in range(int(rng.integers(6, 11)))
    ]


def log_uniform(rng: np.random.Generator, low: int, high: int) -> int:
    return int(np.exp(rng.uniform(np.log(low), np.log(high))))


def schedule(requests: list[SimRequest]) -> list[list[RequestWork]]:
    """The steps the engine's scheduler would run: decodes first, then prompt chunks in arrival order."""
    steps: list[list[RequestWork]] = []
    while not all(request.done for request in requests):
        live = [r for r in requests if r.arrival_step <= len(steps) and not r.done]
        budget, works = STEP_TOKENS, []
        for request in sorted(live, key=lambda r: (r.computed < r.prompt_tokens, r.arrival_step)):
            context = request.cached_tokens + request.computed + request.generated
            if request.computed >= request.prompt_tokens:
                works.append(RequestWork.chunk(request.request_id, context, 1))
                request.generated += 1
                budget -= 1
            elif budget > 0:
                chunk = min(budget, request.prompt_tokens - request.computed)
                loaded = request.cached_tokens // PAGE_SIZE if request.computed == 0 and request.loads_prefix else 0
                works.append(RequestWork.chunk(request.request_id, context, chunk, loaded))
                request.computed += chunk
                budget -= chunk
                request.generated += request.computed == request.prompt_tokens  # the chunk's sample
        steps.append(works)  # an idle step too: arrivals count in steps
    return [works for works in steps if works]


def l1(estimate: dict[str, float], truth: dict[str, float]) -> float:
    """L1 distance of the normalised shares of two per-request energy maps."""
    estimate_total, truth_total = sum(estimate.values()), sum(truth.values())
    return sum(abs(estimate[rid] / estimate_total - truth[rid] / truth_total) for rid in truth)


def add(accounts: dict[str, float], works: Seq[RequestWork], values: Seq[float]) -> None:
    for work, value in zip(works, values):
        accounts[work.request_id] = accounts.get(work.request_id, 0.0) + float(value)


def true_shapley(truth_model: TrueCost, works: Seq[RequestWork]) -> Seq[float]:
    """Every coalition of the step enumerated under the true cost."""
    return exact_shapley(lambda players: truth_model.cost_j([works[i] for i in players]), len(works)).tolist()


def synthetic(num_workloads: int, seed: int) -> dict[str, Any]:
    truth_model, rng = TrueCost(), np.random.default_rng(seed)
    calibrator = OnlineCalibrator(CostCoefficients(1.0, 0.01, 1, 0.0, 0.0, 0.0, 0.0))  # uninformed start
    per_request: list[tuple[float, float]] = []  # (Shapley, token) L1 of each workload's request shares
    per_step: list[tuple[float, float]] = []  # the same for each step of two requests or more
    split_s = 0.0
    for index in range(num_workloads):
        truth: dict[str, float] = {}
        shapley: dict[str, float] = {}
        proportional: dict[str, float] = {}
        for works in schedule(synthetic_workload(rng, index)):
            measured_j = truth_model.cost_j(works) * (1.0 + NOISE * rng.standard_normal())
            true_j = true_shapley(truth_model, works)
            start_s = time.thread_time()
            split = shapley_split(works, calibrator.coefficients, rng)
            calibrator.observe(works, measured_j)
            split_s += time.thread_time() - start_s
            shapley_j = [value * measured_j / sum(split.values_j) for value in split.values_j]
            proportional_j = proportional_split(works, measured_j)
            add(truth, works, true_j)
            add(shapley, works, shapley_j)
            add(proportional, works, proportional_j)
            if len(works) > 1:
                per_step.append((share_l1(shapley_j, true_j), share_l1(proportional_j, true_j)))
        per_request.append((l1(shapley, truth), l1(proportional, truth)))
    return {
        "workloads": num_workloads,
        "steps": len(per_step),
        **summary_l1("", per_request),
        **summary_l1("step_", per_step),
        "split_and_calibration_cpu_us_per_step": round(split_s / len(per_step) * 1e6, 1),
        "true_cost": asdict(truth_model),
        "fitted": asdict(calibrator.coefficients),
    }


def share_l1(estimate: Seq[float], truth: Seq[float]) -> float:
    estimate_total, truth_total = sum(estimate), sum(truth)
    return sum(abs(e / estimate_total - t / truth_total) for e, t in zip(estimate, truth))


def summary_l1(prefix: str, errors: Seq[tuple[float, float]]) -> dict[str, float | int]:
    """Mean L1 of both splits, and the Shapley L1 where the token split is off by the target's floor or more."""
    hard = [shapley for shapley, proportional in errors if proportional >= PROPORTIONAL_FLOOR]
    return {
        f"{prefix}shapley_l1": round(statistics.mean(shapley for shapley, _ in errors), 4),
        f"{prefix}proportional_l1": round(statistics.mean(proportional for _, proportional in errors), 4),
        f"{prefix}count_where_proportional_at_least_floor": len(hard),
        f"{prefix}shapley_l1_where_proportional_at_least_floor": round(statistics.mean(hard), 4) if hard else None,
    }


class RecordingLedger(EnergyLedger):
    """The engine's ledger, keeping every step's split for the comparison."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[tuple[list[RequestWork], StepAttribution]] = []
        # Whole engine steps (scheduling, the model run, sampling, outputs, the accounting), timed by ``run_steps``.
        self.engine_step_s = 0.0
        self.engine_steps = 0

    def record(self, works: Seq[RequestWork], energy_j: float, step_s: float) -> StepAttribution:
        attribution = super().record(works, energy_j, step_s)
        self.steps.append((list(works), attribution))
        return attribution


ENGINE_REQUESTS = [(3000, 8), (1500, 24), (600, 48), (120, 96), (40, 64), (2000, 4)]
MORE_ENGINE_REQUESTS = [(900, 32), (250, 16), (3500, 12), (60, 120)]


def run_steps(
    engine: LLMEngine, ledger: RecordingLedger, prompts: Seq[tuple[list[int], int]], ids: Seq[int] | None = None
) -> float:
    """Run requests together to completion (named ``ids``, by default their positions); returns the joules the
    ledger measured."""
    start_j = ledger.energy_j
    for index, (prompt, max_tokens) in zip(ids or range(len(prompts)), prompts):
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), str(index))
    while engine.has_unfinished_requests():
        step_start_s = time.perf_counter()
        engine.step()
        ledger.engine_step_s += time.perf_counter() - step_start_s
        ledger.engine_steps += 1
    return ledger.energy_j - start_j


def on_engine(model: str, repeats: int, full: bool, step_tokens: int, seed: int) -> dict[str, Any]:
    specs = ENGINE_REQUESTS + (MORE_ENGINE_REQUESTS if full else [])
    engine = LLMEngine.from_pretrained(model, max_num_batched_tokens=step_tokens, enable_prefix_caching=False)
    ledger = RecordingLedger(engine.energy.meter, engine.page_size, OnlineCalibrator(CPU_DEFAULTS))
    engine.energy = ledger
    rng = np.random.default_rng(seed)
    progress = Progress("energy on the engine", repeats * (len(specs) + 1))
    isolated_j: dict[str, list[float]] = {str(index): [] for index in range(len(specs))}
    batched: list[tuple[dict[str, float], dict[str, float]]] = []
    run_steps(engine, ledger, [([7] * 64, 8)])  # warm the kernels' shapes out of the figures
    for _ in range(repeats):
        prompts = [([int(t) for t in rng.integers(10, 200, size=length)], out) for length, out in specs]
        for index, prompt in enumerate(prompts):
            isolated_j[str(index)].append(run_steps(engine, ledger, [prompt]))
            progress.advance()
        first_step = len(ledger.steps)
        run_steps(engine, ledger, prompts)
        progress.advance()
        shapley: dict[str, float] = {}
        proportional: dict[str, float] = {}
        for works, attribution in ledger.steps[first_step:]:
            add(shapley, works, attribution.shapley_j)
            add(proportional, works, attribution.proportional_j)
        batched.append((shapley, proportional))
    # Both sides averaged over the repeats: single runs on a shared host are noisy.
    truth = {rid: statistics.mean(runs) for rid, runs in isolated_j.items()}
    noise = [l1({rid: runs[i] for rid, runs in isolated_j.items()}, truth) for i in range(repeats)]
    mean_shapley = {rid: statistics.mean(shapley[rid] for shapley, _ in batched) for rid in truth}
    mean_proportional = {rid: statistics.mean(proportional[rid] for _, proportional in batched) for rid in truth}
    coalition_truth = coalitions(engine, ledger, repeats if full else 1, seed)
    stats = ledger.stats()
    return {
        **accounting_cpu(ledger),
        "coalition_truth": coalition_truth,
        "model": model,
        "meter": ledger.meter.name,
        "step_tokens": step_tokens,
        "requests": [{"prompt_tokens": length, "output_tokens": out} for length, out in specs],
        "repeats": repeats,
        "shapley_l1": round(l1(mean_shapley, truth), 4),
        "proportional_l1": round(l1(mean_proportional, truth), 4),
        "shapley_l1_each_repeat": [round(l1(shapley, truth), 4) for shapley, _ in batched],
        "proportional_l1_each_repeat": [round(l1(proportional, truth), 4) for _, proportional in batched],
        "isolated_run_l1_to_their_mean": round(statistics.mean(noise), 4),
        "isolated_shares": [round(j / sum(truth.values()), 4) for j in truth.values()],
        "steps": ledger.num_steps,
        "model_run_ms_per_step": round(ledger.step_s / ledger.num_steps * 1e3, 3),
        "accounting_us_per_step": round(ledger.accounting_s / ledger.num_steps * 1e6, 1),
        "accounting_fraction": round(float(stats["accounting_fraction"]), 5),
        "flush_steps": ledger.flush_steps,  # steps the ledger records together, as in a served engine
        # The same time over whole engine steps (every step of the run), not only their model runs.
        "engine_step_ms_per_step": round(ledger.engine_step_s / ledger.engine_steps * 1e3, 3),
        "accounting_fraction_of_engine_step": round(ledger.accounting_s / ledger.engine_step_s, 5),
        "fitted": {field.name: stats[f"model_{field.name}"] for field in fields(CostCoefficients)},
    }


def coalitions(engine: LLMEngine, ledger: RecordingLedger, repeats: int, seed: int) -> dict[str, Any]:
    """The ground truth Shapley values stand for: every coalition of ``ENGINE_REQUESTS`` run together and
    measured, the requests' exact Shapley values of those measured energies, against the attributions of
    the batched run of all of them (the last coalition run). Averaged over the repeats, each with its own
    prompts; the coalitions run in a fresh random order each time, so the host's drift spreads over all."""
    rng = np.random.default_rng(seed + 1)
    num_players = len(ENGINE_REQUESTS)
    everyone = (1 << num_players) - 1
    measured_j: dict[int, list[float]] = {mask: [] for mask in range(1, everyone + 1)}
    batched: list[tuple[dict[str, float], dict[str, float]]] = []
    progress = Progress("energy by coalitions", repeats * everyone)
    for _ in range(repeats):
        prompts = [([int(t) for t in rng.integers(10, 200, size=length)], out) for length, out in ENGINE_REQUESTS]
        for mask in [*rng.permutation(np.arange(1, everyone)).tolist(), everyone]:
            players = [i for i in range(num_players) if mask >> i & 1]
            first_step = len(ledger.steps)
            measured_j[mask].append(run_steps(engine, ledger, [prompts[i] for i in players], players))
            progress.advance()
        shapley: dict[str, float] = {}
        proportional: dict[str, float] = {}
        for works, attribution in ledger.steps[first_step:]:
            add(shapley, works, attribution.shapley_j)
            add(proportional, works, attribution.proportional_j)
        batched.append((shapley, proportional))
    mean_j = {mask: statistics.mean(runs) for mask, runs in measured_j.items()}
    values = shapley_of(mean_j, num_players)
    truth = {str(i): float(value) for i, value in enumerate(values)}
    mean_shapley = {rid: statistics.mean(shapley[rid] for shapley, _ in batched) for rid in truth}
    mean_proportional = {rid: statistics.mean(proportional[rid] for _, proportional in batched) for rid in truth}
    noise = [
        share_l1(shapley_of({mask: runs[r] for mask, runs in measured_j.items()}, num_players), values)
        for r in range(repeats)
    ]
    return {
        "requests": [{"prompt_tokens": length, "output_tokens": out} for length, out in ENGINE_REQUESTS],
        "coalitions": everyone,
        "repeats": repeats,
        "shapley_l1": round(l1(mean_shapley, truth), 4),
        "proportional_l1": round(l1(mean_proportional, truth), 4),
        "shapley_l1_each_repeat": [round(l1(shapley, truth), 4) for shapley, _ in batched],
        "proportional_l1_each_repeat": [round(l1(proportional, truth), 4) for _, proportional in batched],
        "repeat_truth_l1_to_their_mean": round(statistics.mean(noise), 4),
        "true_shares": [round(value / float(values.sum()), 4) for value in values],
        # What being in a batch saved: the coalition of all against the sum of the requests run alone.
        "batch_over_isolated_energy": round(mean_j[everyone] / sum(mean_j[1 << i] for i in range(num_players)), 4),
    }


def shapley_of(energy_j: dict[int, float], num_players: int) -> np.ndarray:
    """The exact Shapley values of measured coalition energies, keyed by the coalition's bit mask."""
    return exact_shapley(lambda players: energy_j[sum(1 << i for i in players)] if players else 0.0, num_players)


def accounting_cpu(ledger: RecordingLedger) -> dict[str, float]:
    """The CPU time of splitting, calibrating and accounting the recorded steps again, over the steps' CPU time.

    Only where the meter is the power model on CPU seconds: its joules over its power are the steps' CPU seconds.
    """
    meter = ledger.meter
    if not (isinstance(meter, ModelMeter) and meter.clock is time.process_time):
        return {}
    replay = EnergyLedger(meter, ledger.page_size, OnlineCalibrator(CPU_DEFAULTS))
    start_s = time.thread_time()
    for works, attribution in ledger.steps:
        replay.record(works, attribution.energy_j, 0.0)
    accounting_s = time.thread_time() - start_s
    step_cpu_s = sum(attribution.energy_j for _, attribution in ledger.steps) / meter.power_w
    return {
        "step_cpu_ms": round(step_cpu_s / len(ledger.steps) * 1e3, 3),
        "accounting_cpu_us_per_step": round(accounting_s / len(ledger.steps) * 1e6, 1),
        "accounting_cpu_fraction": round(accounting_s / step_cpu_s, 5),
    }


def split_cost_us(batch_sizes: Seq[int], repeats: int, seed: int) -> dict[str, dict[str, float]]:
    """The split alone on decode batches with a few prompt chunks, under the accelerator defaults (a knee of 128).

    Exact by kinds, or sampled past the bound on coalitions.
    """
    rng = np.random.default_rng(seed)
    figures = {}
    for size in batch_sizes:
        prefills = max(1, size // 16)
        works = [RequestWork.chunk(f"d{i}", int(rng.integers(10, 4000)), 1) for i in range(size - prefills)]
        works += [
            RequestWork.chunk(f"p{i}", int(rng.integers(0, 2000)), int(rng.integers(8, 64))) for i in range(prefills)
        ]
        start_s = time.thread_time()
        for _ in range(repeats):
            split = shapley_split(works, ACCELERATOR_DEFAULTS, rng)
        figures[str(size)] = {
            "cpu_us": round((time.thread_time() - start_s) / repeats * 1e6, 1),
            "exact": split.exact,
        }
    return figures


def main(argv: Seq[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer workloads and one engine round")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (one: CPU time is work, not spinning)")
    parser.add_argument("--step-tokens", type=int, default=64, help="the engine's token budget per step")
    parser.add_argument("--seed", type=int, default=0)
    add_out_argument(parser, "energy_attribution")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    synthetic_result = synthetic(10 if args.quick else 40, args.seed)
    engine_result = on_engine(args.model, 2 if args.quick else 5, not args.quick, args.step_tokens, args.seed)
    result: dict[str, Any] = {
        "bench": "energy_attribution",
        "quick": args.quick,
        "synthetic": synthetic_result,
        "engine": engine_result,
        "split_cost_us_by_batch": split_cost_us((8, 32, 64, 128, 256), 20 if args.quick else 100, args.seed),
        "targets": {
            "shapley_l1_max": L1_TARGET,
            "where_proportional_l1_at_least": PROPORTIONAL_FLOOR,
            "accounting_fraction_max": ACCOUNTING_TARGET,
        },
        "targets_met": {
            "synthetic_steps": (synthetic_result["step_shapley_l1_where_proportional_at_least_floor"] or 1.0)
            <= L1_TARGET,
            "synthetic_requests": synthetic_result["shapley_l1"] <= L1_TARGET,
            "engine": engine_result["shapley_l1"] <= L1_TARGET
            and engine_result["proportional_l1"] >= PROPORTIONAL_FLOOR,
            "accounting_wall": engine_result["accounting_fraction"] < ACCOUNTING_TARGET,
            "accounting_wall_of_engine_step": engine_result["accounting_fraction_of_engine_step"] < ACCOUNTING_TARGET,
            "accounting_cpu": engine_result.get("accounting_cpu_fraction", 1.0) < ACCOUNTING_TARGET,
        },
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "machine": machine(),
        "load_average": [round(load, 2) for load in os.getloadavg()],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "energy_attribution_quick" if args.quick else "energy_attribution"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    emit(result)


if __name__ == "__main__":
    main()

"""Energy meters: cumulative joules the engine reads around each step.

``select_meter`` picks one once, at engine start, and logs it; its ``name``
travels with every figure it produced:

- ``nvml``: an NVIDIA GPU's energy counter (``nvmlDeviceGetTotalEnergyConsumption``,
  Volta and later), through ``nvidia-ml-py`` when it is installed. One read
  took 3.6 ms on an H200 host, two a step doubled a small model's decode
  step, so it is read on a thread of its own (:class:`SampledMeter`) and a
  step's joules are the counter's latest power times the step's time;
- ``rapl``: Linux RAPL package counters (``/sys/class/powercap/intel-rapl:N/energy_uj``,
  AMD's too), when readable (often root only); each wraps at its
  ``max_energy_range_uj``, which the meter unwraps;
- ``model``: no counter; a power model: the process's CPU seconds times a
  nominal power per busy core on a CPU, wall seconds times a nominal board
  power on an accelerator. The per-step cost model is calibrated against it
  as against a counter, so its shares are the model's and its totals
  estimates.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

POWERCAP_ROOT = Path("/sys/class/powercap")
# A busy core of a server CPU package draws a few watts (package power / cores, uncore included).
NOMINAL_CPU_WATTS_PER_CORE = 5.0
NOMINAL_GPU_WATTS = 300.0
_PACKAGE_DOMAIN = re.compile(r"intel-rapl:\d+")


class EnergyMeter(ABC):
    name: str

    @abstractmethod
    def read_j(self) -> float:
        """Joules since an arbitrary origin of this meter; only differences mean something."""


class ModelMeter(EnergyMeter):
    """Seconds of a clock times a nominal power."""

    name = "model"

    def __init__(self, clock: Callable[[], float], power_w: float) -> None:
        if not power_w > 0:
            raise ValueError(f"power_w must be > 0, got {power_w}")
        self.clock = clock
        self.power_w = power_w

    def read_j(self) -> float:
        return self.clock() * self.power_w


class NvmlMeter(EnergyMeter):
    name = "nvml"

    def __init__(self, nvml: Any, handle: Any) -> None:
        self._nvml = nvml
        self._handle = handle

    @classmethod
    def open(cls, device: torch.device) -> NvmlMeter | None:
        """The meter of this CUDA device, or None without ``nvidia-ml-py``, a driver, or an energy counter."""
        try:
            pynvml: Any = importlib.import_module("pynvml")  # optional: never a dependency of rayturn
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
            handle = _nvml_handle(pynvml, device)
            meter = cls(pynvml, handle)
            meter.read_j()
        except (pynvml.NVMLError, RuntimeError, ValueError) as error:  # no driver, device, or counter
            logger.info("no NVML energy counter for %s: %s", device, error)
            return None
        return meter

    def read_j(self) -> float:
        return float(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)) / 1e3


class SampledMeter(EnergyMeter):
    """A counter too slow to read every step, read every ``period_s`` on a daemon thread of its own.

    ``read_j`` reads nothing: it is the last sample plus the power between the last two samples times
    the time since the last, and never less than it returned before (a sample below an extrapolation
    holds the reading until the counter passes it). Over spans longer than the period the joules are
    the counter's; a step's are the power the counter saw over its last period times the step's time.
    Each sample is timed at the middle of its read. The thread stops at :meth:`close` or once the
    meter is garbage; a failed read stops it too (logged), and readings then extrapolate from the
    last two samples.
    """

    def __init__(
        self, counter: EnergyMeter, period_s: float = 0.05, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        if not period_s > 0:
            raise ValueError(f"period_s must be > 0, got {period_s}")
        self.name = counter.name
        self.counter = counter
        self.period_s = period_s
        self._clock = clock
        read_at_s, energy_j = self._read_counter()
        # (previous sample's time and joules, last sample's): replaced whole, so a reader sees one pair or the next.
        self._samples = (read_at_s, energy_j, read_at_s, energy_j)
        self._returned_j = energy_j
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_sample_until_stopped,
            args=(weakref.ref(self), self._stop, period_s),
            name=f"rayturn-{self.name}-meter",
            daemon=True,
        )
        self._thread.start()

    def read_j(self) -> float:
        previous_s, previous_j, last_s, last_j = self._samples
        power_w = max(last_j - previous_j, 0.0) / (last_s - previous_s) if last_s > previous_s else 0.0
        self._returned_j = max(self._returned_j, last_j + power_w * max(self._clock() - last_s, 0.0))
        return self._returned_j

    def sample(self) -> None:
        """Read the counter now (the thread's work; tests call it to step the meter)."""
        read_at_s, energy_j = self._read_counter()
        _, _, last_s, last_j = self._samples
        self._samples = (last_s, last_j, read_at_s, energy_j)

    def close(self) -> None:
        """Stop the sampling thread (readings go on extrapolating from the last two samples)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _read_counter(self) -> tuple[float, float]:
        start_s = self._clock()
        energy_j = self.counter.read_j()
        return (start_s + self._clock()) / 2, energy_j


def _sample_until_stopped(meter_ref: weakref.ref[SampledMeter], stop: threading.Event, period_s: float) -> None:
    while not stop.wait(period_s):
        meter = meter_ref()
        if meter is None:
            return
        try:
            meter.sample()
        except Exception as error:  # the driver went away: keep the meter, stop reading it
            logger.warning("energy meter %s: a read failed, sampling stops: %s", meter.name, error)
            return
        del meter  # hold no reference while waiting: the meter must be collectable


@dataclass(slots=True)
class _RaplDomain:
    energy_path: Path
    max_range_uj: int
    last_uj: int


class RaplMeter(EnergyMeter):
    """The sum of every package domain's counter, unwrapped."""

    name = "rapl"

    def __init__(self, domains: list[_RaplDomain]) -> None:
        self._domains = domains
        self._total_uj = 0

    @classmethod
    def open(cls, root: Path = POWERCAP_ROOT) -> RaplMeter | None:
        """The meter of every readable package domain under ``root``, or None when there is none."""
        domains = []
        for directory in sorted(root.glob("intel-rapl:*")) if root.is_dir() else ():
            if not _PACKAGE_DOMAIN.fullmatch(directory.name):
                continue  # a core or uncore sub-domain: already in its package
            try:
                max_range_uj = int((directory / "max_energy_range_uj").read_text())
                energy_uj = int((directory / "energy_uj").read_text())
            except (OSError, ValueError) as error:
                logger.info("RAPL domain %s unreadable: %s", directory.name, error)
                continue
            domains.append(_RaplDomain(directory / "energy_uj", max_range_uj, energy_uj))
        return cls(domains) if domains else None

    def read_j(self) -> float:
        for domain in self._domains:
            energy_uj = int(domain.energy_path.read_text())
            delta_uj = energy_uj - domain.last_uj
            if delta_uj < 0:  # the counter wrapped past its range
                delta_uj += domain.max_range_uj + 1
            self._total_uj += delta_uj
            domain.last_uj = energy_uj
        return self._total_uj / 1e6


def select_meter(device: torch.device, powercap_root: Path = POWERCAP_ROOT) -> EnergyMeter:
    """The best meter for an engine on ``device``: a counter where there is one, else the power model."""
    meter: EnergyMeter | None
    if device.type == "cuda":
        nvml = NvmlMeter.open(device)
        meter = SampledMeter(nvml) if nvml is not None else ModelMeter(time.perf_counter, NOMINAL_GPU_WATTS)
    elif device.type == "cpu":
        meter = RaplMeter.open(powercap_root) or ModelMeter(time.process_time, NOMINAL_CPU_WATTS_PER_CORE)
    else:
        meter = ModelMeter(time.perf_counter, NOMINAL_GPU_WATTS)
    logger.info("rayturn energy meter for %s: %s", device, meter.name)
    return meter


def joined_meter_names(*names: str | None) -> str | None:
    """The name of a figure summed from several meters' (a call's prefill and decode replicas): the distinct
    names, sorted and ``+``-joined (``model+nvml``); one name when they agree, None when there are none."""
    distinct = sorted({part for name in names if name for part in name.split("+")})
    return "+".join(distinct) or None


def _nvml_handle(pynvml: Any, device: torch.device) -> Any:
    """The NVML handle of a CUDA device: by its UUID where torch reports one (NVML ignores CUDA_VISIBLE_DEVICES)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is not None:
        return pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    if index < len(visible) and visible[index].strip().isdigit():
        index = int(visible[index])
    return pynvml.nvmlDeviceGetHandleByIndex(index)

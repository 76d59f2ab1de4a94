"""Energy meters: RAPL counters (wrap-around, unreadable domains), NVML through a stand-in module, the power model,
and the sampled meter a slow counter is read through."""

from __future__ import annotations

import gc
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch

from rayturn.engine.energy import (
    EnergyMeter,
    ModelMeter,
    NvmlMeter,
    RaplMeter,
    SampledMeter,
    joined_meter_names,
    select_meter,
)


def rapl_domain(root: Path, name: str, energy_uj: int | str, max_range_uj: int = 1000) -> Path:
    directory = root / name
    directory.mkdir(parents=True)
    (directory / "energy_uj").write_text(f"{energy_uj}\n")
    (directory / "max_energy_range_uj").write_text(f"{max_range_uj}\n")
    return directory / "energy_uj"


def test_rapl_sums_packages_unwraps_their_counters_and_skips_sub_domains(tmp_path: Path) -> None:
    package0 = rapl_domain(tmp_path, "intel-rapl:0", 900)
    package1 = rapl_domain(tmp_path, "intel-rapl:1", 100)
    rapl_domain(tmp_path, "intel-rapl:0:0", 0)  # the cores of package 0: counted in package 0 already
    meter = RaplMeter.open(tmp_path)
    assert meter is not None and meter.name == "rapl"
    start_j = meter.read_j()
    package0.write_text("50\n")  # wrapped: 900 -> 1000 (its range) -> 0 -> 50
    package1.write_text("400\n")
    assert meter.read_j() - start_j == pytest.approx((101 + 50 + 300) / 1e6)


def test_rapl_is_absent_without_readable_domains(tmp_path: Path) -> None:
    assert RaplMeter.open(tmp_path / "missing") is None
    rapl_domain(tmp_path, "intel-rapl:0", "not a number")
    assert RaplMeter.open(tmp_path) is None
    (tmp_path / "intel-rapl:1").mkdir()  # no counter files at all (as when only root may read them)
    assert RaplMeter.open(tmp_path) is None


def test_select_meter_prefers_rapl_on_a_cpu_and_falls_back_to_the_power_model(tmp_path: Path) -> None:
    assert select_meter(torch.device("cpu"), tmp_path).name == "model"
    rapl_domain(tmp_path, "intel-rapl:0", 5)
    assert select_meter(torch.device("cpu"), tmp_path).name == "rapl"


def test_model_meter_is_seconds_times_power() -> None:
    ticks = iter([10.0, 12.5])
    meter = ModelMeter(lambda: next(ticks), power_w=4.0)
    assert meter.name == "model"
    start_j = meter.read_j()
    assert meter.read_j() - start_j == pytest.approx(10.0)
    with pytest.raises(ValueError, match="power_w"):
        ModelMeter(lambda: 0.0, power_w=0.0)


def test_nvml_reads_millijoules_as_joules_and_is_absent_without_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    class NVMLError(Exception):
        pass

    counter_mj = iter([5_000, 7_500])
    nvml = types.SimpleNamespace(
        nvmlDeviceGetTotalEnergyConsumption=lambda handle: next(counter_mj), NVMLError=NVMLError
    )
    meter = NvmlMeter(nvml, handle=object())
    assert meter.name == "nvml"
    start_j = meter.read_j()
    assert meter.read_j() - start_j == pytest.approx(2.5)

    def no_driver() -> None:
        raise NVMLError("driver not loaded")

    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlInit=no_driver, NVMLError=NVMLError))
    assert NvmlMeter.open(torch.device("cuda", 0)) is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    assert NvmlMeter.open(torch.device("cuda", 0)) is None


def test_joined_meter_names_are_distinct_sorted_and_none_without_any() -> None:
    assert joined_meter_names("rapl", "rapl") == "rapl"
    assert joined_meter_names("nvml", None, "model") == "model+nvml"
    assert joined_meter_names("model+nvml", "rapl", "nvml") == "model+nvml+rapl"
    assert joined_meter_names(None, "") is None
    assert joined_meter_names() is None


class SlowCounter(EnergyMeter):
    """A counter whose joules follow a settable power on a settable clock, counting its reads and their threads."""

    name = "nvml"

    def __init__(self) -> None:
        self.now_s = 0.0
        self.energy_j = 0.0
        self.reads: list[str] = []

    def advance(self, seconds: float, power_w: float) -> None:
        self.now_s += seconds
        self.energy_j += seconds * power_w

    def read_j(self) -> float:
        self.reads.append(threading.current_thread().name)
        return self.energy_j


def test_a_sampled_meter_reads_its_counter_only_on_its_thread_and_extrapolates_the_last_power() -> None:
    counter = SlowCounter()
    meter = SampledMeter(counter, period_s=3600.0, clock=lambda: counter.now_s)  # the thread never wakes here
    try:
        assert meter.name == "nvml" and counter.reads == [threading.current_thread().name]  # the first sample
        counter.advance(1.0, power_w=200.0)
        meter.sample()  # 200 J over the first second
        counter.advance(0.5, power_w=200.0)
        reads_before = len(counter.reads)
        assert meter.read_j() == pytest.approx(300.0)  # 200 J + 200 W * 0.5 s, no read
        counter.advance(0.25, power_w=200.0)
        assert meter.read_j() == pytest.approx(350.0)
        assert len(counter.reads) == reads_before  # read_j never touched the counter
        # The power drops to 0 W, then to 100 W: readings follow the samples, lag them, and never go back.
        counter.advance(0.25, power_w=0.0)
        meter.sample()  # 350 J at 2.0 s: 150 J over the last period of 1 s
        assert meter.read_j() == pytest.approx(350.0)
        counter.advance(1.0, power_w=100.0)
        assert meter.read_j() == pytest.approx(500.0)  # extrapolated at 150 W
        counter_j = counter.energy_j
        meter.sample()  # 450 J at 3.0 s: below the 500 J returned, so readings hold at 500 J ...
        assert meter.read_j() == pytest.approx(500.0)
        counter.advance(1.0, power_w=100.0)
        meter.sample()  # ... until the counter passes them: 550 J at 4.0 s
        assert counter.energy_j == pytest.approx(counter_j + 100.0)
        assert meter.read_j() == pytest.approx(550.0)
    finally:
        meter.close()


def test_a_sampled_meter_samples_on_its_own_thread_and_stops() -> None:
    counter = SlowCounter()
    meter = SampledMeter(counter, period_s=0.005)
    wait_for_thread_reads(counter, 3)
    thread = meter._thread
    meter.close()
    assert not thread.is_alive()
    with pytest.raises(ValueError, match="period_s"):
        SampledMeter(counter, period_s=0.0)


def wait_for_thread_reads(counter: SlowCounter, count: int) -> None:
    deadline = time.monotonic() + 10.0
    while counter.reads.count("rayturn-nvml-meter") < count and time.monotonic() < deadline:
        time.sleep(0.005)
    assert counter.reads.count("rayturn-nvml-meter") >= count


def test_a_sampled_meters_thread_ends_once_the_meter_is_garbage() -> None:
    counter = SlowCounter()
    meter = SampledMeter(counter, period_s=0.005)
    thread = meter._thread
    wait_for_thread_reads(counter, 2)  # the thread has held the meter between its waits
    del meter
    gc.collect()
    thread.join(timeout=10.0)
    assert not thread.is_alive()


def test_a_failed_read_stops_the_sampling_and_readings_go_on(caplog: pytest.LogCaptureFixture) -> None:
    counter = SlowCounter()
    meter = SampledMeter(counter, period_s=0.005)
    counter.read_j = lambda: (_ for _ in ()).throw(RuntimeError("driver gone"))  # type: ignore[method-assign]
    meter._thread.join(timeout=10.0)
    assert not meter._thread.is_alive()
    assert "a read failed, sampling stops: driver gone" in caplog.text
    assert meter.read_j() == 0.0


def test_select_meter_samples_nvml_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    counter_mj = iter(range(1_000, 10**9, 1_000))
    nvml = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetTotalEnergyConsumption=lambda handle: next(counter_mj),
        NVMLError=RuntimeError,
    )
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr("rayturn.engine.energy.meters._nvml_handle", lambda pynvml, device: object())
    meter = select_meter(torch.device("cuda", 0))
    try:
        assert isinstance(meter, SampledMeter) and isinstance(meter.counter, NvmlMeter) and meter.name == "nvml"
    finally:
        meter.close()  # type: ignore[attr-defined]

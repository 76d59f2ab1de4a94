"""Energy meters: RAPL counters (wrap-around, unreadable domains), NVML through a stand-in module, the power model."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

from rayturn.engine.energy import ModelMeter, NvmlMeter, RaplMeter, joined_meter_names, select_meter


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

"""Per-request energy: meters, the per-step cost model, its calibration, Shapley attribution, the engine's ledger.

``meters.py`` reads joules (NVML, RAPL, or a power model), ``cost_model.py``
says what a step of given requests costs, ``calibration.py`` fits it to the
steps measured, ``shapley.py`` splits a step among its requests, and
``ledger.py`` keeps the accounts per request and session for the engine.
"""

from .calibration import OnlineCalibrator
from .cost_model import CostCoefficients, RequestWork
from .ledger import EnergyLedger, RequestEnergy, StepAttribution
from .meters import (
    EnergyMeter,
    ModelMeter,
    NvmlMeter,
    RaplMeter,
    SampledMeter,
    joined_meter_names,
    select_meter,
)
from .shapley import Split, exact_shapley, proportional_split, shapley_split

__all__ = [
    "CostCoefficients",
    "EnergyLedger",
    "EnergyMeter",
    "ModelMeter",
    "NvmlMeter",
    "OnlineCalibrator",
    "RaplMeter",
    "RequestEnergy",
    "RequestWork",
    "SampledMeter",
    "Split",
    "StepAttribution",
    "exact_shapley",
    "joined_meter_names",
    "proportional_split",
    "select_meter",
    "shapley_split",
]

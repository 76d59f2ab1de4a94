"""Kernel backend registry and the once-per-process choice of backend.

Backends register a factory under a name; factories import their module
lazily, so choosing ``torch`` never imports Triton. CPUs get ``cpu`` (the
torch backend plus native kernels, built on first use) unless no C compiler
can build them; CUDA and ROCm devices get ``triton``. ``select_backend`` runs
once when an engine (or actor) starts: it honours an explicit name, then the
``RAYTURN_KERNEL_BACKEND`` environment variable, then picks from the device,
and logs one line saying what it chose and why.
"""

from __future__ import annotations

import logging
import os

import torch

from rayturn.registry import Registry

from .backend import KernelBackend

logger = logging.getLogger(__name__)

ENV_VAR = "RAYTURN_KERNEL_BACKEND"


def _torch_factory() -> KernelBackend:
    from .torch_backend import TorchBackend

    return TorchBackend()


def _cpu_factory() -> KernelBackend:
    from .cpu_backend import CpuBackend

    return CpuBackend()


def _triton_factory() -> KernelBackend:
    from .triton_backend import TritonBackend

    return TritonBackend()


BACKENDS: Registry[KernelBackend] = Registry("kernel backend")
BACKENDS.register("torch", _torch_factory)
BACKENDS.register("cpu", _cpu_factory)
BACKENDS.register("triton", _triton_factory)


def default_backend_name(device: torch.device) -> str:
    """The backend a device gets when nobody asks for one."""
    return _default_backend(device)[0]


def _default_backend(device: torch.device) -> tuple[str, str]:
    """(name, why) of the default backend for ``device``."""
    if device.type == "cuda":  # CUDA and ROCm (HIP builds report "cuda" too)
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch", "Triton is not installed"
        return "triton", ""
    if device.type == "cpu":
        from .native import load, unavailable_reason

        if load() is None:
            return "torch", f"native CPU kernels unavailable: {unavailable_reason()}"
        return "cpu", ""
    return "torch", ""


def select_backend(device: torch.device, name: str | None = None) -> KernelBackend:
    """Pick the kernel backend for ``device`` once, and log the choice."""
    if name is not None:
        reason = "requested"
    elif os.environ.get(ENV_VAR):
        name, reason = os.environ[ENV_VAR], f"from ${ENV_VAR}"
    else:
        name, why = _default_backend(device)
        reason = f"default for {_describe(device)}" + (f"; {why}" if why else "")
    backend = BACKENDS.create(name)
    if described := backend.describe():
        reason += f"; {described}"
    logger.info("rayturn kernel backend: %s (%s, device %s)", backend.name, reason, device)
    return backend


def _describe(device: torch.device) -> str:
    if device.type == "cuda":
        return "ROCm" if torch.version.hip else "CUDA"
    return device.type.upper()

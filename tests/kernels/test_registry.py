"""Backend registry: lazy factories, the once-per-process choice, overrides, errors."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from rayturn.kernels import BACKENDS, Registry, default_backend_name, native, select_backend


def test_default_backend_per_device() -> None:
    assert default_backend_name(torch.device("cpu")) == "cpu"  # this host has a C compiler
    assert default_backend_name(torch.device("cuda")) in ("triton", "torch")  # triton when importable


def test_cpu_without_native_kernels_falls_back_to_torch_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("RAYTURN_KERNEL_BACKEND", raising=False)
    monkeypatch.setattr(native, "_compiler", lambda: None)
    native.load.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="rayturn.kernels.registry"):
            backend = select_backend(torch.device("cpu"))
        with pytest.raises(RuntimeError, match="needs its native kernels: no C compiler found"):
            BACKENDS.create("cpu")
    finally:
        native.load.cache_clear()
        native._unavailable.clear()
    assert backend.name == "torch"
    assert caplog.records[-1].getMessage() == (
        "rayturn kernel backend: torch (default for CPU; native CPU kernels unavailable: "
        "no C compiler found (set $CC), device cpu)"
    )


def test_select_backend_logs_one_line_and_honours_overrides(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("RAYTURN_KERNEL_BACKEND", raising=False)
    with caplog.at_level(logging.INFO, logger="rayturn.kernels.registry"):
        backend = select_backend(torch.device("cpu"))
    assert backend.name == "cpu"
    bits = backend.native.vector_bits  # type: ignore[attr-defined]
    prefill = {512: "native", 256: "native up to 1536 keys, torch flash beyond"}.get(bits, "torch flash")
    assert [r.getMessage() for r in caplog.records] == [
        f"rayturn kernel backend: cpu (default for CPU; {bits}-bit vectors, prefill attention {prefill}, device cpu)"
    ]
    assert BACKENDS.create("torch").describe() == ""  # nothing to add: the line names the backend alone
    caplog.clear()
    monkeypatch.setenv("RAYTURN_KERNEL_BACKEND", "torch")
    with caplog.at_level(logging.INFO, logger="rayturn.kernels.registry"):
        select_backend(torch.device("cpu"))
    assert "from $RAYTURN_KERNEL_BACKEND" in caplog.records[0].getMessage()
    # An explicit name beats the environment.
    monkeypatch.setenv("RAYTURN_KERNEL_BACKEND", "no-such-backend")
    assert select_backend(torch.device("cpu"), "torch").name == "torch"
    with pytest.raises(ValueError, match="unknown kernel backend 'no-such-backend'; known: cpu, torch, triton"):
        select_backend(torch.device("cpu"))


def test_registry_rejects_duplicates_and_unknown_names() -> None:
    registry: Registry[int] = Registry("widget")
    registry.register("one", lambda: 1)
    with pytest.raises(ValueError, match="widget 'one' is already registered"):
        registry.register("one", lambda: 2)
    assert registry.create("one") == 1 and registry.names() == ["one"]
    with pytest.raises(ValueError, match="unknown widget 'two'"):
        registry.create("two")
    assert BACKENDS.names() == ["cpu", "torch", "triton"]


def test_choosing_torch_never_imports_triton() -> None:
    code = (
        "import sys, torch; from rayturn.kernels import select_backend; "
        "select_backend(torch.device('cpu'), 'torch'); print('triton' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

"""``rayturn generate``: the offline engine from the command line, warmed up as a served replica is where that
builds kernels or records decode graphs (Triton on a GPU)."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
from rayturn_cli import rayturn_command

from rayturn import cli
from rayturn.engine import warm_up
from rayturn.kernels.backend import KernelBackend


def test_generate_prints_each_answer_and_the_rate() -> None:
    result = subprocess.run(
        [*rayturn_command(), "generate", "def add(a, b):", "hello", "--max-tokens", "6"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert ">>> def add(a, b):" in result.stdout and ">>> hello" in result.stdout
    assert result.stdout.count("[6 tokens, length]") == 2
    assert "2 requests, 12 tokens in" in result.stdout
    # The CPU backend builds nothing ahead and records no graphs: no warm-up before generating.
    assert "warmed up" not in result.stdout


class WarmUps:
    """Stands in for ``warm_up_kernels``: what the engine looked like each time it was called."""

    def __init__(self) -> None:
        self.engines: list[dict[str, Any]] = []

    def __call__(self, engine: Any) -> int:
        self.engines.append({"enforce_eager": engine.enforce_eager, "busy": engine.has_unfinished_requests()})
        return 0


@pytest.mark.parametrize("flags", [[], ["--enforce-eager"]], ids=["default", "enforce-eager"])
def test_generate_warms_up_first_where_the_backend_records_graphs(
    flags: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    warm_ups = WarmUps()
    monkeypatch.setattr(warm_up, "warm_up_kernels", warm_ups)
    monkeypatch.setattr(KernelBackend, "captures_cuda_graphs", lambda self: True)
    assert cli.main(["generate", "hi", "--max-tokens", "2", *flags]) == 0
    # Once, before any request, with the flag reaching the engine (which then records no graphs).
    assert warm_ups.engines == [{"enforce_eager": bool(flags), "busy": False}]
    out = capsys.readouterr().out
    assert "warmed up in" in out and "(eager)" in out
    assert out.index("warmed up in") < out.index(">>> hi")


def test_generate_skips_the_warm_up_where_nothing_is_built_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    warm_ups = WarmUps()
    monkeypatch.setattr(warm_up, "warm_up_kernels", warm_ups)
    assert cli.main(["generate", "hi", "--max-tokens", "2"]) == 0
    assert warm_ups.engines == []

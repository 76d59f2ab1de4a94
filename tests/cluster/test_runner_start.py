"""While the application starts, ``rayturn serve`` says how far its replicas are, and ends on a failed deployment
with Serve's reason (Serve's status stood in for: the loop's own logic; a real stuck start-up is in
``test_serve_cli``)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from ray import serve

from rayturn.cluster import runner


@dataclass
class Deployment:
    replica_states: dict[str, int]
    status: str = "HEALTHY"
    message: str = ""


@dataclass
class App:
    status: str
    deployments: dict[str, Deployment] = field(default_factory=dict)
    message: str = ""


@dataclass
class Status:
    applications: dict[str, App]


def statuses(*apps: App | None) -> Iterator[Status]:
    for app in apps:
        yield Status({} if app is None else {"rayturn": app})


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "START_POLL_S", 0.01)
    monkeypatch.setattr(runner, "START_REPORT_EVERY_S", 0.025)


def serve_status(monkeypatch: pytest.MonkeyPatch, *apps: App | None) -> list[Any]:
    """``serve.status()`` answers each of ``apps`` in turn (None: not deployed yet), then the last for ever."""
    asked: list[Any] = []
    answers = statuses(*apps)
    last: list[Status] = []

    def status() -> Status:
        answer = next(answers, None)
        if answer is not None:
            last[:] = [answer]
        asked.append(last[0])
        return last[0]

    monkeypatch.setattr(serve, "status", status)
    return asked


STARTING = App(
    "DEPLOYING",
    {
        "prefill": Deployment({"RUNNING": 1}),
        "decode": Deployment(
            {"STARTING": 1}, "UPDATING", "has 1 replicas that have taken more than 30s to be scheduled"
        ),
    },
)


def test_a_start_up_that_waits_says_how_far_each_deployment_is(
    quick: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    asked = serve_status(monkeypatch, None, *[STARTING] * 8, App("RUNNING"))
    with caplog.at_level(logging.INFO, logger=runner.__name__):
        runner._wait_until_running("rayturn")
    assert asked[-1].applications["rayturn"].status == "RUNNING"
    lines = [record.getMessage() for record in caplog.records if "still starting" in record.getMessage()]
    assert lines, "no progress while the replicas started"
    assert lines[-1].endswith(
        "decode: 0 running, 1 starting (has 1 replicas that have taken more than 30s to be scheduled); "
        "prefill: 1 running"
    )


def test_a_failed_deployment_ends_the_wait_with_serves_reason(quick: None, monkeypatch: pytest.MonkeyPatch) -> None:
    serve_status(monkeypatch, STARTING, App("DEPLOY_FAILED", message="replica constructor raised ValueError"))
    with pytest.raises(RuntimeError, match="Deploying application rayturn failed: replica constructor raised"):
        runner._wait_until_running("rayturn")


def test_before_serve_has_the_application_the_line_says_so() -> None:
    assert runner._replicas_so_far(None) == "the application is not deployed yet"

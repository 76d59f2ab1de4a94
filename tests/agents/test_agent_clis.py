"""Claude Code, Codex and OpenCode, as their users run them, against a real ``rayturn serve``.

One server per module, on its own ports, on a model whose answers end
(``agent_server.py``).

Each CLI runs with a private HOME, offline, with the server's URL and key
(``agent_clis.py``); the CLIs are installed with npm on first use, and the
tests skip, saying why, where that cannot be done.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_clis import AgentClis, AgentRun, AgentsUnavailable, Server, installed_clis
from agent_server import rayturn_serve

HTTP_PORT, GRPC_PORT = 28491, 29491
API_KEY = "sk-agents-5c1f"
RUN_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def clis() -> AgentClis:
    try:
        return installed_clis()
    except AgentsUnavailable as error:
        pytest.skip(f"coding-agent CLIs unavailable: {error}")


@pytest.fixture(scope="module")
def rayturn_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with rayturn_serve(tmp_path_factory.mktemp("rayturn-agents"), HTTP_PORT, GRPC_PORT, API_KEY) as server:
        yield server


def workspace(tmp_path_factory: pytest.TempPathFactory, name: str) -> tuple[Path, Path]:
    """A private HOME and an empty working directory for one CLI."""
    base = tmp_path_factory.mktemp(name)
    (base / "home").mkdir()
    (base / "work").mkdir()
    return base / "home", base / "work"


@pytest.fixture(scope="module")
def claude_runs(
    clis: AgentClis, rayturn_server: Server, tmp_path_factory: pytest.TempPathFactory
) -> tuple[AgentRun, AgentRun]:
    """``claude -p`` and then ``claude -p --continue`` in the same HOME and directory: one session."""
    home, workdir = workspace(tmp_path_factory, "claude-code")
    first = clis.claude(rayturn_server, "say hi", home=home, workdir=workdir, timeout_s=RUN_TIMEOUT_S)
    second = clis.claude(
        rayturn_server, "and again", home=home, workdir=workdir, continue_session=True, timeout_s=RUN_TIMEOUT_S
    )
    return first, second


@pytest.fixture(scope="module")
def codex_run(clis: AgentClis, rayturn_server: Server, tmp_path_factory: pytest.TempPathFactory) -> AgentRun:
    home, workdir = workspace(tmp_path_factory, "codex")
    return clis.codex(rayturn_server, "say hi", home=home, workdir=workdir, timeout_s=RUN_TIMEOUT_S)


@pytest.fixture(scope="module")
def opencode_run(clis: AgentClis, rayturn_server: Server, tmp_path_factory: pytest.TempPathFactory) -> AgentRun:
    home, workdir = workspace(tmp_path_factory, "opencode")
    return clis.opencode(rayturn_server, "say hi", home=home, workdir=workdir, timeout_s=RUN_TIMEOUT_S)


def test_claude_code_continues_its_session_from_the_cached_prefix(claude_runs: tuple[AgentRun, AgentRun]) -> None:
    first, second = claude_runs
    assert first.returncode == 0, first.describe()
    assert second.returncode == 0, second.describe()
    first_result, second_result = first.json(), second.json()
    assert second_result["session_id"] == first_result["session_id"], second.describe()
    # The continued call repeats the first one's system prompt, tools and turn: a prefix the server holds.
    assert second_result["usage"]["cache_read_input_tokens"] > 0, second.describe()


def test_codex_exec_completes_a_turn(codex_run: AgentRun) -> None:
    assert codex_run.returncode == 0, codex_run.describe()


def test_opencode_run_completes(opencode_run: AgentRun) -> None:
    assert opencode_run.returncode == 0, opencode_run.describe()

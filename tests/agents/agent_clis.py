"""The coding-agent CLIs (Claude Code, Codex, OpenCode) at pinned versions, run offline against one server.

Installed with npm, once per set of versions, outside the repository::

    ${RAYTURN_AGENTS_DIR:-${RAYTURN_CACHE_DIR:-~/.cache/rayturn}/agents}/<versions>/
        node_modules/.bin/{claude,codex,opencode}
        opencode-config/     OpenCode's own config-directory dependency, pre-installed
        .installed           the stamp: present once everything above is in place

``make agents`` (``python tests/agents/agent_clis.py install``) does it, and so does
``installed_clis()`` when the tests find it missing. Each run gets the caller's private
HOME (so no user settings, sessions or keys leak in or out), only the server's URL
and key, and every switch each CLI has that stops it calling home: telemetry, error
reports, update checks, model catalogues, plugin and marketplace fetches. Each CLI
then makes no connection but to the server (checked in a network namespace with
nothing else reachable); what each one sends is summarised in ``README.md``.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CLAUDE_CODE_VERSION = "2.1.328"
CODEX_VERSION = "0.169.0"
OPENCODE_VERSION = "1.18.33"
PACKAGES = (
    f"@anthropic-ai/claude-code@{CLAUDE_CODE_VERSION}",
    f"@openai/codex@{CODEX_VERSION}",
    f"opencode-ai@{OPENCODE_VERSION}",
)
# OpenCode installs this into each of its config directories on start-up unless its
# package-lock.json already lists it; offline that install fails after a few seconds.
OPENCODE_CONFIG_PACKAGES = (f"@opencode-ai/plugin@{OPENCODE_VERSION}",)
INSTALL_TIMEOUT_S = 900.0
# A failing server should fail a run in seconds, not after minutes of back-off.
MAX_RETRIES = 1


def _agents_root() -> Path:
    explicit = os.environ.get("RAYTURN_AGENTS_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("RAYTURN_CACHE_DIR")
    return (Path(base) if base else Path.home() / ".cache" / "rayturn") / "agents"


# Read once, at import: the test session later points RAYTURN_CACHE_DIR at a
# per-session directory for the model presets, and a 1 GB install must outlive it.
AGENTS_ROOT = _agents_root()


class AgentsUnavailable(RuntimeError):
    """The CLIs cannot be installed or run here (no npm, no registry, an unsupported platform)."""


@dataclass(frozen=True, slots=True)
class Server:
    """Where the CLIs send their model calls: ``base_url`` without ``/v1``."""

    base_url: str
    api_key: str
    model: str
    max_output_tokens: int


@dataclass(frozen=True, slots=True)
class AgentRun:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool

    def json(self) -> Any:
        """The run's stdout as one JSON document (Claude Code's ``--output-format json``)."""
        return json.loads(self.stdout)

    def describe(self) -> str:
        head = f"{' '.join(self.argv[:2])} exited {self.returncode} after {self.duration_s:.1f}s"
        if self.timed_out:
            head += " (timed out)"
        return f"{head}\n--- stdout\n{self.stdout[-4000:]}\n--- stderr\n{self.stderr[-4000:]}"


def install_dir(root: Path = AGENTS_ROOT) -> Path:
    return root / f"claude-code-{CLAUDE_CODE_VERSION}_codex-{CODEX_VERSION}_opencode-{OPENCODE_VERSION}"


def _npm() -> str:
    npm = shutil.which("npm")
    if npm is None:
        raise AgentsUnavailable("npm is not on PATH: install Node.js 20+ to run the coding-agent CLI tests")
    return npm


def _npm_install(npm: str, prefix: Path, packages: Sequence[str]) -> None:
    prefix.mkdir(parents=True, exist_ok=True)
    command = [
        npm,
        "install",
        "--prefix",
        str(prefix),
        "--no-audit",
        "--no-fund",
        "--save-exact",
        "--loglevel=error",
        *packages,
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        raise AgentsUnavailable(f"{' '.join(command)} took over {INSTALL_TIMEOUT_S:.0f}s") from error
    if done.returncode != 0:
        raise AgentsUnavailable(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")


def install(root: Path = AGENTS_ROOT) -> Path:
    """Install the pinned CLIs under ``root`` unless they are there already; safe across processes."""
    target = install_dir(root)
    stamp = target / ".installed"
    if stamp.is_file():
        return target
    npm = _npm()
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".install.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent installer finishes first; then the stamp is there
        if stamp.is_file():
            return target
        _npm_install(npm, target, PACKAGES)
        _npm_install(npm, target / "opencode-config", OPENCODE_CONFIG_PACKAGES)
        clis = AgentClis(target)
        for name, version in (
            ("claude", CLAUDE_CODE_VERSION),
            ("codex", CODEX_VERSION),
            ("opencode", OPENCODE_VERSION),
        ):
            clis.check_version(name, version)
        stamp.write_text("\n".join(PACKAGES + OPENCODE_CONFIG_PACKAGES) + "\n")
    return target


def installed_clis(root: Path = AGENTS_ROOT) -> AgentClis:
    """The CLIs, installed first if needed; raises ``AgentsUnavailable`` saying why they cannot be."""
    return AgentClis(install(root))


def _base_env(home: Path) -> dict[str, str]:
    """A clean environment: nothing of the caller's keys, proxies or agent settings."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        "TMPDIR": str(home / "tmp"),
        "NO_PROXY": "127.0.0.1,localhost",
    }


class AgentClis:
    """Runs the installed CLIs, each in the private HOME and working directory the caller gives."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def binary(self, name: str) -> Path:
        path = self.root / "node_modules" / ".bin" / name
        if not path.exists():
            raise AgentsUnavailable(f"{path} is missing: npm installed no {name} for this platform")
        return path

    def check_version(self, name: str, version: str) -> None:
        home = self.root / "version-check-home"
        (home / "tmp").mkdir(parents=True, exist_ok=True)
        run = self._run([str(self.binary(name)), "--version"], _base_env(home), self.root, timeout_s=60.0)
        if run.returncode != 0 or version not in run.stdout:
            raise AgentsUnavailable(f"{name} does not run here:\n{run.describe()}")

    def claude(
        self,
        server: Server,
        prompt: str,
        *,
        home: Path,
        workdir: Path,
        continue_session: bool = False,
        timeout_s: float = 120.0,
    ) -> AgentRun:
        """``claude -p PROMPT --output-format json``; ``continue_session`` adds ``--continue``."""
        env = {
            **_base_env(home),
            "ANTHROPIC_BASE_URL": server.base_url,
            "ANTHROPIC_API_KEY": server.api_key,
            "ANTHROPIC_MODEL": server.model,
            # Every role a model name can stand for; the small one names title and summary calls.
            "ANTHROPIC_DEFAULT_OPUS_MODEL": server.model,
            "ANTHROPIC_DEFAULT_SONNET_MODEL": server.model,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": server.model,
            "ANTHROPIC_SMALL_FAST_MODEL": server.model,
            "CLAUDE_CODE_SUBAGENT_MODEL": server.model,
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(server.max_output_tokens),
            "CLAUDE_CODE_MAX_RETRIES": str(MAX_RETRIES),
            "API_TIMEOUT_MS": str(int(timeout_s * 1000)),
            "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        }
        argv = [str(self.binary("claude")), "-p", *(["--continue"] if continue_session else []), prompt]
        return self._run([*argv, "--output-format", "json"], env, workdir, timeout_s)

    def codex(self, server: Server, prompt: str, *, home: Path, workdir: Path, timeout_s: float = 120.0) -> AgentRun:
        """``codex exec --skip-git-repo-check PROMPT`` with a ``rayturn`` Responses provider."""
        codex_home = home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        (codex_home / "config.toml").write_text(codex_config(server))
        env = {**_base_env(home), "CODEX_HOME": str(codex_home), "RAYTURN_API_KEY": server.api_key}
        argv = [str(self.binary("codex")), "exec", "--strict-config", "--skip-git-repo-check", prompt]
        return self._run(argv, env, workdir, timeout_s)

    def opencode(self, server: Server, prompt: str, *, home: Path, workdir: Path, timeout_s: float = 120.0) -> AgentRun:
        """``opencode run PROMPT`` with a ``rayturn`` provider through ``@ai-sdk/openai-compatible``."""
        config = home / "opencode.json"
        config.write_text(json.dumps(opencode_config(server), indent=2))
        self._seed_opencode_config_dir(home / ".config" / "opencode")
        env = {
            **_base_env(home),
            "OPENCODE_CONFIG": str(config),
            "RAYTURN_API_KEY": server.api_key,
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
            "OPENCODE_DISABLE_SHARE": "1",
            "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
            "OPENCODE_DISABLE_CLAUDE_CODE": "1",
            "OPENCODE_DISABLE_EXTERNAL_SKILLS": "1",
            "OPENCODE_DISABLE_PROJECT_CONFIG": "1",
            "OPENCODE_DISABLE_TERMINAL_TITLE": "1",
        }
        return self._run([str(self.binary("opencode")), "run", prompt], env, workdir, timeout_s)

    def _seed_opencode_config_dir(self, config_dir: Path) -> None:
        """Give OpenCode's config directory the dependency it would otherwise fetch on every start."""
        config_dir.mkdir(parents=True, exist_ok=True)
        installed = self.root / "opencode-config"
        for name in ("package.json", "package-lock.json"):
            shutil.copyfile(installed / name, config_dir / name)
        modules = config_dir / "node_modules"
        if not modules.exists():
            modules.symlink_to(installed / "node_modules", target_is_directory=True)

    @staticmethod
    def _run(argv: Sequence[str], env: Mapping[str, str], workdir: Path, timeout_s: float) -> AgentRun:
        """Run to completion in its own process group, killed whole on time-out (the CLIs spawn helpers)."""
        Path(env["TMPDIR"]).mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        process = subprocess.Popen(
            list(argv),
            cwd=workdir,
            env=dict(env),
            stdin=subprocess.DEVNULL,  # codex exec reads a piped stdin as part of the prompt
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        timed_out = False
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
        return AgentRun(tuple(argv), process.returncode, stdout, stderr, time.monotonic() - started, timed_out)


def codex_config(server: Server) -> str:
    """``$CODEX_HOME/config.toml``: the server as the only provider, nothing else switched on that calls out."""
    return f"""\
model = "{server.model}"
model_provider = "rayturn"
approval_policy = "never"
sandbox_mode = "read-only"
check_for_update_on_startup = false

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"
trace_exporter = "none"
metrics_exporter = "none"

# Plugins sync a marketplace from github.com and chatgpt.com at start-up.
[features]
plugins = false

[model_providers.rayturn]
name = "rayturn"
base_url = "{server.base_url}/v1"
wire_api = "responses"
env_key = "RAYTURN_API_KEY"
request_max_retries = {MAX_RETRIES}
stream_max_retries = {MAX_RETRIES}
"""


def opencode_config(server: Server) -> dict[str, Any]:
    model = f"rayturn/{server.model}"
    return {
        "$schema": "https://opencode.ai/config.json",
        "model": model,
        "small_model": model,  # the title call; unset, OpenCode picks a hosted model
        "autoupdate": False,
        "share": "disabled",
        "provider": {
            "rayturn": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "rayturn",
                "options": {"baseURL": f"{server.base_url}/v1", "apiKey": "{env:RAYTURN_API_KEY}"},
                "models": {
                    server.model: {
                        "name": server.model,
                        "limit": {"context": 131072, "output": server.max_output_tokens},
                    }
                },
            }
        },
    }


def main(argv: Sequence[str]) -> int:
    if list(argv) != ["install"]:
        print(f"usage: {Path(__file__).name} install", file=sys.stderr)
        return 2
    try:
        target = install()
    except AgentsUnavailable as error:
        print(error, file=sys.stderr)
        return 1
    for name in ("claude", "codex", "opencode"):
        print(target / "node_modules" / ".bin" / name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

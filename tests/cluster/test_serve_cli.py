"""``rayturn serve`` as a user runs it: a process that serves until SIGTERM, then leaves nothing behind.

The command starts its own Ray; every process of that Ray descends from it,
so the tests snapshot the command's process tree before stopping it and check
that, once the command has exited, none of those processes (nor anything in
its process group) is still alive, and that the KV store segments they
created are gone from /dev/shm. That holds whether the signal comes while it
serves or while it is still starting. The serving test runs the command as a
``vllm serve`` user would: the model positional (a Hugging Face id, found in
a hub cache laid out under ``HF_HOME``), the flags after the subcommand, the
key from ``RAYTURN_API_KEY``; its console carries no access log and none of
the warnings Ray prints when Serve is started twice or shut down by waiting
on its controller. Bad input exits with code 2 before Ray starts, naming
what is wrong.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hf_cache import cache_model
from rayturn_cli import rayturn_command

from rayturn.engine.presets import preset_dir

openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")

HTTP_PORT, GRPC_PORT = 28451, 29451
API_KEY = "sk-from-the-environment-7e2d"
MODEL_ID = "rayturn-test/tiny-from-the-hub"
SERVED_NAME = "tiny-served"
# What a start and stop printed before: Serve started twice (``serve.start``, then ``serve.run`` again), and Ray
# reporting the controller's shutdown call as failed; per-request access lines; Ray's notice of token auth.
UNWANTED_LINES = (
    "will not be applied",
    "graceful_shutdown failed",
    "GET /v1/models",
    "POST /v1/chat/completions",
    "Token authentication is enabled",
    "Traceback",
)
STARTUP_TIMEOUT_S = 180.0
SHUTDOWN_TIMEOUT_S = 90.0
STOP_WHILE_STARTING_S = 15.0
# Small pools, as the other cluster tests use, so the command starts quickly on a laptop or CI runner.
SMALL_CONFIG = """\
model:
  num_pages: 512
prefill:
  num_cpus: 0.25
decode:
  num_cpus: 0.25
kvstore:
  segment_bytes: 32MiB
"""

# A process as (pid, start time in clock ticks since boot): pids are reused, the pair is not.
Process = tuple[int, int]


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) from /proc, or None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses
    return int(fields[1]), fields[0], int(fields[19])


def descendants(root: int) -> set[Process]:
    children: dict[int, list[Process]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            children.setdefault(stat[0], []).append((int(entry.name), stat[2]))
    found: set[Process] = set()
    pending = [root]
    while pending:
        for child in children.get(pending.pop(), []):
            found.add(child)
            pending.append(child[0])
    return found


def alive(processes: set[Process]) -> set[Process]:
    """The processes still running (a zombie has exited; only its exit status is left)."""
    return {
        (pid, started)
        for pid, started in processes
        if (stat := _stat(pid)) is not None and stat[2] == started and stat[1] != "Z"
    }


def environment(pid: int) -> bytes:
    """A process's environment as it started (``/proc/<pid>/environ``); empty when it is gone."""
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def kv_segments(processes: set[Process]) -> list[str]:
    """KV store segments in /dev/shm created by these processes (named ``rayturn-kv-<pid>-<hex>``)."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return []
    pids = {str(pid) for pid, _ in processes}
    return sorted(name for name in os.listdir(shm) if name.startswith("rayturn-kv-") and name.split("-")[2] in pids)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member exists but belongs to someone else
        return True
    return True


@pytest.fixture
def small_config(tmp_path: Path) -> Path:
    path = tmp_path / "rayturn.yaml"
    path.write_text(SMALL_CONFIG)
    return path


def start_serve(
    tmp_path: Path, *arguments: str, env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """``rayturn serve ARGUMENTS`` in its own session (so its process group is its own); killed if a test fails."""
    log = tmp_path / "serve.log"
    command = [*rayturn_command(), "serve", *arguments]
    with log.open("wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        yield process, log
    finally:
        if process.poll() is None:
            tree = descendants(process.pid)
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            for pid, _ in alive(tree):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def server(tmp_path: Path, small_config: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """The model from a Hugging Face cache, flags after the subcommand, the key from the environment."""
    cache_model(tmp_path / "hf" / "hub", MODEL_ID, preset_dir("tiny"))
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "RAYTURN_API_KEY": API_KEY}
    env.pop("HF_HUB_CACHE", None)
    env.pop("HUGGINGFACE_HUB_CACHE", None)
    yield from start_serve(
        tmp_path,
        MODEL_ID,
        "--config",
        str(small_config),
        "--port",
        str(HTTP_PORT),
        "--grpc-port",
        str(GRPC_PORT),
        "--served-model-name",
        SERVED_NAME,
        "--max-model-len",
        "1k",
        "--log-level",
        "INFO",
        env=env,
    )


@pytest.fixture
def stuck_server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """A server whose start-up cannot finish: its decode pool asks for a resource no node offers.

    Ray starts, Serve starts and the prefill pool comes up; the decode replica waits to be
    scheduled for ever, so a stop signal always lands while the cluster is still starting.
    """
    config = tmp_path / "stuck.yaml"
    config.write_text(SMALL_CONFIG.replace("decode:\n", "decode:\n  resources: {no_such_node: 1}\n"))
    assert "no_such_node" in config.read_text()
    # The flags' older names, before the model (the default, tiny).
    yield from start_serve(
        tmp_path, "--config", str(config), "--http-port", str(HTTP_PORT), "--grpc-port", str(GRPC_PORT)
    )


def healthy() -> bool:
    try:
        health = requests.get(f"http://127.0.0.1:{HTTP_PORT}/health", timeout=10)
    except requests.RequestException:
        return False
    return health.status_code == 200 and health.json()["status"] == "ok"


def wait_for(ready: Callable[[], bool], process: subprocess.Popen[bytes], log: Path, what: str) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not ready():
        assert process.poll() is None, f"rayturn serve exited with {process.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"rayturn serve: no {what} in time:\n{log.read_text()}"
        time.sleep(0.5)


def stop_and_check_nothing_is_left(
    process: subprocess.Popen[bytes], log: Path, within_s: float = SHUTDOWN_TIMEOUT_S
) -> None:
    started = descendants(process.pid)  # Ray's GCS, raylet and every worker (the replicas among them)
    assert len(started) >= 2
    process.send_signal(signal.SIGTERM)
    try:
        returncode = process.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"rayturn serve still runs {within_s:.0f} s after SIGTERM:\n{log.read_text()}")
    assert returncode == 0, log.read_text()
    assert "rayturn stopped" in log.read_text()

    deadline = time.monotonic() + 30.0
    while alive(started) or group_alive(process.pid):
        assert time.monotonic() < deadline, f"left running: {sorted(alive(started))}"
        time.sleep(0.5)
    assert kv_segments(started) == []


def test_serve_answers_then_stops_cleanly_on_sigterm(server: tuple[subprocess.Popen[bytes], Path]) -> None:
    process, log = server
    wait_for(healthy, process, log, "healthy /health")
    wait_for(lambda: "rayturn is serving" in log.read_text(), process, log, "serving banner")
    assert f"rayturn is serving {SERVED_NAME!r}" in log.read_text()
    stranger = openai.OpenAI(base_url=f"http://127.0.0.1:{HTTP_PORT}/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):  # RAYTURN_API_KEY made keys required: a 401
        stranger.models.list()
    workers = descendants(process.pid)  # Ray's GCS, raylet and workers, the ingress among them
    assert len(workers) >= 2
    leaked = [pid for pid, _ in workers if API_KEY.encode() in environment(pid)]
    assert leaked == [], "the API key is in the environment of Ray's processes"
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{HTTP_PORT}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    (model,) = client.models.list().data
    assert model.id == SERVED_NAME
    assert model.model_extra is not None and model.model_extra["max_model_len"] == 1000  # 1k
    response = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
    )
    assert response.choices[0].finish_reason in ("length", "stop")
    assert response.usage is not None and response.usage.completion_tokens > 0
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1000 tokens"):
        client.completions.create(model=SERVED_NAME, prompt=[1] * 1001, max_tokens=1)
    stop_and_check_nothing_is_left(process, log)
    printed = log.read_text()
    assert API_KEY not in printed  # nor anywhere the command printed or logged
    assert [line for line in printed.splitlines() if any(unwanted in line for unwanted in UNWANTED_LINES)] == []


def test_sigterm_during_startup_abandons_it_and_stops_cleanly(
    stuck_server: tuple[subprocess.Popen[bytes], Path],
) -> None:
    process, log = stuck_server
    # Serve is starting the deployments: Ray and its workers run, the application is not up yet
    # (and cannot come up: the decode replica waits for a resource nobody has).
    wait_for(lambda: "Started Serve" in log.read_text(), process, log, "Serve start")
    # The command says how far the replicas are while it waits: the decode replica is asked for, and waits.
    waiting = re.compile(r"still starting after \d+ s: decode: 0 running, 1 starting")
    wait_for(lambda: waiting.search(log.read_text()) is not None, process, log, "progress")
    assert "rayturn is serving" not in log.read_text()
    # The decode replica that waits for a node has nothing to drain: the stop does not wait out Serve's
    # 20 s grace period for its answer (a pod told to stop while it starts is gone well within Kubernetes' 30 s).
    stop_and_check_nothing_is_left(process, log, within_s=STOP_WHILE_STARTING_S)
    assert "rayturn is serving" not in log.read_text()
    assert "stopped SERVE_REPLICA::rayturn#decode#" in log.read_text()


def run_rayturn(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*rayturn_command(), *args], capture_output=True, text=True, timeout=120, env=env)


def test_serve_names_a_missing_model_and_exits_2() -> None:
    result = run_rayturn("serve", "--model", "/nonexistent", "--http-port", str(HTTP_PORT))
    assert result.returncode == 2, result.stderr
    assert "/nonexistent" in result.stderr and "error" in result.stderr


def test_a_context_longer_than_the_models_is_an_error_naming_both() -> None:
    result = run_rayturn("serve", "tiny", "--max-model-len", "99999", "--port", str(HTTP_PORT))
    assert result.returncode == 2, result.stderr
    assert "99999" in result.stderr and "4096" in result.stderr and "max_model_len" in result.stderr
    assert "Traceback" not in result.stderr and "Started a local Ray" not in result.stderr + result.stdout


def test_serve_names_the_hub_cache_it_looked_in_for_an_absent_id(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf")}
    env.pop("HF_HUB_CACHE", None)
    env.pop("HUGGINGFACE_HUB_CACHE", None)
    result = run_rayturn("serve", "org/absent", "--port", str(HTTP_PORT), env=env)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        "rayturn: error: model 'org/absent' is neither a preset (tiny, small, tiny-bpe), a directory, nor in the "
        f"Hugging Face cache at {tmp_path / 'hf' / 'hub'}; download it first, e.g. "
        "`huggingface-cli download org/absent`"
    )
    assert "Ray" not in result.stdout  # refused before Ray started


def test_serve_names_the_file_a_model_directory_lacks(tmp_path: Path) -> None:
    directory = Path(shutil.copytree(preset_dir("tiny"), tmp_path / "model"))
    for missing in ("config.json", "tokenizer.json"):
        (directory / missing).unlink()
        result = run_rayturn("serve", str(directory), "--port", str(HTTP_PORT))
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith(f"rayturn: error: {directory / missing}: missing"), result.stderr
        assert "Traceback" not in result.stderr
        shutil.copy(preset_dir("tiny") / missing, directory / missing)


@pytest.mark.parametrize(
    ("arguments", "problem"),
    [
        (["--port", "http"], "argument --port/--http-port: invalid port number: 'http'"),
        (["--grpc-port", "70000"], "argument --grpc-port: must be a port number in 0-65535, got 70000"),
        (["--log-level", "LOUD"], "argument --log-level: invalid choice: 'loud'"),
        (["--max-model-len", "0"], "argument --max-model-len: must be >= 1, got '0'"),
        (["--max-num-seqs", "many"], "argument --max-num-seqs: expected a whole number, got 'many'"),
        (["--max-num-batched-tokens", "0k"], "argument --max-num-batched-tokens: must be >= 1, got '0k'"),
        (["--dtype", "double"], "argument --dtype: invalid choice: 'double'"),
        (["tiny", "--model", "small"], "two models given: 'tiny' and --model 'small'; give one"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_bad_serve_flags_get_argparse_errors(arguments: list[str], problem: str) -> None:
    result = run_rayturn("serve", *arguments)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("usage: rayturn serve [MODEL] [options]\n"), result.stderr
    assert f"rayturn serve: error: {problem}" in result.stderr


def test_help_reads_like_vllm_serve_and_holds_no_markup() -> None:
    top, serve = run_rayturn("--help"), run_rayturn("serve", "--help")
    assert top.returncode == serve.returncode == 0
    assert "``" not in top.stdout + serve.stdout
    assert serve.stdout.startswith("usage: rayturn serve [MODEL] [options]\n")
    flags = (
        "  MODEL ", "  --model MODEL ", "  --config FILE ", "  --host HOST ", "  --port PORT, --http-port PORT\n",
        "  --grpc-port GRPC_PORT\n", "  --api-key API_KEY ", "  --served-model-name NAME\n",
        "  --max-model-len MAX_MODEL_LEN\n", "  --dtype {auto,bfloat16,float,float16,float32,half}\n",
        "  --max-num-seqs MAX_NUM_SEQS\n", "  --max-num-batched-tokens MAX_NUM_BATCHED_TOKENS\n",
        "  --tool-call-parser NAME\n", "  --enforce-eager ", "  --address ADDRESS ",
        "  --log-level {debug,info,warning,error,critical}\n",
    )  # fmt: skip
    assert [flag for flag in flags if flag not in serve.stdout] == []
    assert "RAYTURN_API_KEY" in serve.stdout and "(default: 8000" in serve.stdout


@pytest.mark.parametrize("command", ["bench", "replay", "generate"])
def test_every_commands_help_is_plain_text(command: str) -> None:
    result = run_rayturn(command, "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: rayturn" in result.stdout and "``" not in result.stdout


def test_serve_names_an_unknown_config_key_and_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("decode:\n  min_replica: 2\n")
    result = run_rayturn("serve", "--config", str(bad), "--log-level", "warning")  # the level after the subcommand
    assert result.returncode == 2, result.stderr
    assert "decode.min_replica" in result.stderr


def test_serve_refuses_a_port_another_server_holds_before_starting_anything() -> None:
    """A port held the way Serve's proxies hold theirs (SO_REUSEPORT): a second cluster must not share it."""
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", GRPC_PORT))
        holder.listen()
        started = time.monotonic()
        result = run_rayturn("serve", "--http-port", str(HTTP_PORT), "--grpc-port", str(GRPC_PORT))
    assert result.returncode == 2, result.stderr
    assert f"address already in use: 127.0.0.1:{GRPC_PORT} (server.grpc_port)" in result.stderr
    assert "Ray" not in result.stderr + result.stdout  # refused before Ray started
    assert time.monotonic() - started < 60


def test_serve_flags_set_only_the_config_keys_given() -> None:
    from rayturn.cli import build_parser, config_overrides

    parser, _ = build_parser()
    given = parser.parse_args(
        ["serve", "--enforce-eager", "--max-model-len", "4k", "--port", "8100", "--max-num-batched-tokens", "1K"]
        + ["--max-num-seqs", "16"]
    )
    assert config_overrides(given, "small") == {
        "model.name": "small",
        "model.max_model_len": 4000,
        "model.max_num_seqs": 16,
        "model.max_num_batched_tokens": 1024,
        "model.enforce_eager": True,
        "server.http_port": 8100,
    }
    assert config_overrides(parser.parse_args(["serve"]), None) == {}  # all left to --config and its defaults

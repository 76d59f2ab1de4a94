"""The agents themselves against ``rayturn serve``: time to first token of a session's cold call and of its next.

Two clients, each making two calls of one session against a fresh ``rayturn
serve`` on the agent preset (``tiny-bpe``: a real BPE vocabulary and a 128k
context; a copy whose answers end, ``tests/agents/agent_server.py``):

* **Claude Code** itself (the pinned CLI from npm, ``make agents``):
  ``claude -p`` (its first prompt: system prompt and tools, ~15k tokens, cold)
  and then ``claude -p --continue`` (the same prefix plus the answer and a new
  turn). TTFT is measured at a pass-through proxy between the CLI and the
  server: from the request's first byte to the response's first byte, which
  the server sends with the first token. The cached fraction is the continued
  call's ``cache_read_input_tokens`` over its whole prompt, from Claude Code's
  own JSON result.
* **The Anthropic SDK** with a long prompt (the project's own sources; 20k
  tokens, 5k with ``--quick``): a cold streamed call, then the conversation
  continued by one turn. TTFT is the first stream event.

The baseline is each client's own cold call, in the same run:
``claude_code_continue_over_cold_ttft`` (target <= 0.2) and
``claude_code_cached_fraction`` (target >= 0.9).

    python bench/agent_clients.py [--quick]

The last line of stdout is one JSON object. Without npm (no Claude Code) the
Claude Code figures are null and ``claude_code_skipped`` says why.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "agents"))

import anthropic  # noqa: E402
from agent_clis import AgentsUnavailable, Server, installed_clis  # noqa: E402
from agent_server import rayturn_serve  # noqa: E402

from rayturn.replay.harness import emit, machine  # noqa: E402

HTTP_PORT, GRPC_PORT = 28531, 29531
API_KEY = "sk-bench-agents"
SOURCES = ("api", "engine", "decode", "router", "kvstore")
CLAUDE_CODE_FIGURES = (
    "claude_code_cold_prompt_tokens",
    "claude_code_continue_prompt_tokens",
    "claude_code_cold_ttft_s",
    "claude_code_continue_ttft_s",
    "claude_code_continue_over_cold_ttft",
    "claude_code_cached_fraction",
    "claude_code_calls",
)
CHARS_PER_TOKEN = 3.4  # tiny-bpe on this project's Python (measured); the prompt's real size is counted


class FirstByteProxy:
    """A TCP pass-through that records, per connection, the time from the request's first byte to the
    response's first byte (of the first exchange: one call per CLI run)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.samples: list[float] = []
        self.port = _free_port()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        self._ready.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        self._ready.set()
        self._loop.run_forever()

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        sent_at: list[float] = []

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upstream: bool) -> None:
            first = True
            try:
                while chunk := await reader.read(65536):
                    now = time.perf_counter()
                    if first and upstream:
                        sent_at.append(now)
                    elif first and sent_at:
                        self.samples.append(now - sent_at[0])
                    first = False
                    writer.write(chunk)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        await asyncio.gather(pipe(client_reader, upstream_writer, True), pipe(upstream_reader, client_writer, False))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def claude_code(server: Server, base: Path) -> dict[str, Any]:
    try:
        clis = installed_clis()
    except AgentsUnavailable as error:
        return {"claude_code_skipped": str(error), **dict.fromkeys(CLAUDE_CODE_FIGURES)}
    proxy = FirstByteProxy(HTTP_PORT)
    via_proxy = Server(f"http://127.0.0.1:{proxy.port}", server.api_key, server.model, server.max_output_tokens)
    home, work = base / "home", base / "work"
    home.mkdir()
    work.mkdir()
    print("claude -p (cold) ...", file=sys.stderr, flush=True)
    cold = clis.claude(via_proxy, "say hi", home=home, workdir=work, timeout_s=300)
    print("claude -p --continue ...", file=sys.stderr, flush=True)
    warm = clis.claude(via_proxy, "and again", home=home, workdir=work, continue_session=True, timeout_s=300)
    for run in (cold, warm):
        if run.returncode != 0:
            raise RuntimeError(run.describe())
    if len(proxy.samples) < 2:
        raise RuntimeError(f"expected a call per run at the proxy, saw {len(proxy.samples)}")
    usage = warm.json()["usage"]
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"] + usage.get("cache_creation_input_tokens", 0)
    cold_ttft, warm_ttft = proxy.samples[0], proxy.samples[-1]
    cold_usage = cold.json()["usage"]
    return {
        "claude_code_cold_prompt_tokens": cold_usage["input_tokens"]
        + cold_usage["cache_read_input_tokens"]
        + cold_usage.get("cache_creation_input_tokens", 0),
        "claude_code_continue_prompt_tokens": prompt,
        "claude_code_cold_ttft_s": round(cold_ttft, 4),
        "claude_code_continue_ttft_s": round(warm_ttft, 4),
        "claude_code_continue_over_cold_ttft": round(warm_ttft / cold_ttft, 4),
        "claude_code_cached_fraction": round(usage["cache_read_input_tokens"] / prompt, 4),
        "claude_code_calls": len(proxy.samples),
    }


def long_prompt(tokens: int) -> str:
    text, budget = [], int(tokens * CHARS_PER_TOKEN)
    for directory in SOURCES:
        for path in sorted((ROOT / directory).glob("*.py")):
            text.append(f"# file: {directory}/{path.name}\n{path.read_text()}")
            budget -= len(text[-1])
            if budget <= 0:
                return "Review these files.\n\n" + "\n".join(text)[: int(tokens * CHARS_PER_TOKEN)]
    return "Review these files.\n\n" + "\n".join(text)


def sdk(server: Server, tokens: int) -> dict[str, Any]:
    client = anthropic.Anthropic(base_url=server.base_url, api_key=server.api_key, max_retries=0, timeout=600)
    prompt = long_prompt(tokens)

    def call(messages: list[dict[str, Any]]) -> tuple[float, Any]:
        started = time.perf_counter()
        first = None
        with client.messages.stream(
            model=server.model, max_tokens=server.max_output_tokens, messages=messages, extra_headers=SESSION
        ) as stream:
            for _ in stream:
                first = first or time.perf_counter()
            message = stream.get_final_message()
        return (first or time.perf_counter()) - started, message

    def user(text: str) -> dict[str, Any]:
        return {"role": "user", "content": [{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]}

    print(f"Anthropic SDK, ~{tokens}-token prompt (cold) ...", file=sys.stderr, flush=True)
    cold_ttft, cold = call([user(prompt)])
    answer = "".join(block.text for block in cold.content if block.type == "text") or "ok"
    print("Anthropic SDK, the next turn ...", file=sys.stderr, flush=True)
    warm_ttft, warm = call([user(prompt), {"role": "assistant", "content": answer}, user("Now fix the first bug.")])
    usage = warm.usage
    total = usage.input_tokens + usage.cache_read_input_tokens + (usage.cache_creation_input_tokens or 0)
    return {
        "sdk_prompt_tokens": total,
        "sdk_cold_ttft_s": round(cold_ttft, 4),
        "sdk_continue_ttft_s": round(warm_ttft, 4),
        "sdk_continue_over_cold_ttft": round(warm_ttft / cold_ttft, 4),
        "sdk_cached_fraction": round(usage.cache_read_input_tokens / total, 4),
    }


SESSION = {"x-claude-code-session-id": "bench-agent-clients-sdk"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a 5k-token SDK prompt instead of 20k")
    parser.add_argument("--sdk-tokens", type=int, default=None)
    args = parser.parse_args()
    tokens = args.sdk_tokens or (5000 if args.quick else 20000)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rayturn-agent-clients-") as scratch:
        base = Path(scratch)
        (base / "server").mkdir()
        print("starting rayturn serve on the agent preset ...", file=sys.stderr, flush=True)
        with rayturn_serve(base / "server", HTTP_PORT, GRPC_PORT, API_KEY) as server:
            result: dict[str, Any] = {"claude_code_skipped": None}
            (base / "claude").mkdir()
            result.update(claude_code(server, base / "claude"))
            result.update(sdk(server, tokens))
    result.update(
        {
            "bench": "agent_clients",
            "quick": args.quick,
            "model": "tiny-bpe",
            "machine": machine(),
            "wall_s": round(time.perf_counter() - started, 1),
        }
    )
    emit(result)


if __name__ == "__main__":
    main()

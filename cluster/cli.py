"""The ``rayturn`` command line.

``rayturn serve`` runs the cluster (embedded local Ray, or ``--address`` to
join one); ``rayturn generate`` runs the offline engine on prompts;
``rayturn bench [args]`` runs the agent-sessions benchmark
(``bench/agent_sessions.py`` of a source checkout) with those arguments;
``rayturn replay [args]`` replays recorded agent traces (``bench/replay.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

# Benchmarks live next to the package sources, not in it: only a source checkout has them.
BENCH_SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "agent_sessions.py"
BENCH_MODULE = "rayturn_bench_agent_sessions"
REPLAY_SCRIPT = BENCH_SCRIPT.with_name("replay.py")
REPLAY_MODULE = "rayturn_bench_replay"


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="preset name (tiny, small) or a Hugging Face model directory")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--backend", default=None, help="kernel backend (torch, triton); default: chosen per device")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)


def _generate(args: argparse.Namespace, prompts: Sequence[str], chat: bool) -> int:
    from rayturn.engine import LLMEngine, SamplingParams

    engine = LLMEngine.from_pretrained(args.model, backend=args.backend, dtype=args.dtype)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    if chat and engine.tokenizer.chat_template is not None:
        inputs: list[str | list[int]] = [
            engine.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts
        ]
    else:
        inputs = list(prompts)
    start = time.perf_counter()
    outputs = engine.generate(inputs, params)
    elapsed_s = time.perf_counter() - start
    num_tokens = sum(len(o.token_ids) for o in outputs)
    for prompt, output in zip(prompts, outputs):
        print(f"\n>>> {prompt}\n{output.text!r}  [{len(output.token_ids)} tokens, {output.finish_reason}]")
    print(f"\n{len(outputs)} requests, {num_tokens} tokens in {elapsed_s:.2f} s ({num_tokens / elapsed_s:.1f} tok/s)")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from .config import load_config
    from .runner import serve_forever

    flags = {
        "model.name": args.model,
        "server.http_port": args.http_port,
        "server.grpc_port": args.grpc_port,
        "server.host": args.host,
    }
    config = load_config(args.config, **{key: value for key, value in flags.items() if value is not None})
    if args.api_key:
        server = dataclasses.replace(config.server, api_keys=config.server.api_keys + tuple(args.api_key))
        config = dataclasses.replace(config, server=server)
    return serve_forever(config, args.address)


def load_bench(script: Path = BENCH_SCRIPT, module_name: str = BENCH_MODULE) -> ModuleType:
    """A benchmark script (default: agent sessions) as a module; FileNotFoundError outside a source checkout."""
    if not script.is_file():
        raise FileNotFoundError(
            f"benchmark not found at {script}; `rayturn bench` and `rayturn replay` run from a source checkout "
            "of rayturn installed in editable mode (pip install -e .)"
        )
    if str(script.parent) not in sys.path:
        sys.path.insert(0, str(script.parent))  # the benchmarks import their shared helpers as `_common`
    spec = importlib.util.spec_from_file_location(module_name, script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def _run_script(command: str, script: Path, module_name: str, argv: Sequence[str]) -> int:
    try:
        module = load_bench(script, module_name)
    except FileNotFoundError as err:
        print(f"rayturn: error: {err}", file=sys.stderr)
        return 2
    return int(module.main(list(argv), prog=f"rayturn {command}"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rayturn", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate offline with the engine")
    _add_engine_args(gen)
    gen.add_argument("prompts", nargs="+", help="prompts (raw text)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    serve = sub.add_parser("serve", help="run the cluster: OpenAI HTTP + gRPC on Ray Serve")
    serve.add_argument("--config", default=None, help="cluster YAML (see cluster/examples/rayturn.yaml)")
    serve.add_argument("--model", default=None, help="preset (tiny, small) or a Hugging Face model directory")
    serve.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    serve.add_argument("--http-port", type=int, default=None)
    serve.add_argument("--grpc-port", type=int, default=None)
    serve.add_argument("--host", default=None, help="HTTP and gRPC bind address (default from config: 127.0.0.1)")
    serve.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="an API key callers must present (repeatable; each a tenant of its own; adds to server.api_keys)",
    )
    # Every argument after `bench` is the benchmark's own (`rayturn bench --help` lists them).
    sub.add_parser("bench", help="run bench/agent_sessions.py: agent sessions, rayturn vs a baseline", add_help=False)
    # Likewise after `replay` (`rayturn replay --help`).
    sub.add_parser("replay", help="run bench/replay.py: replay recorded agent traces against a cluster", add_help=False)
    args, bench_args = parser.parse_known_args(argv)
    if bench_args and args.command not in ("bench", "replay"):
        parser.error(f"unrecognized arguments: {' '.join(bench_args)}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    try:
        if args.command == "generate":
            return _generate(args, args.prompts, args.chat)
        if args.command == "bench":
            return _run_script("bench", BENCH_SCRIPT, BENCH_MODULE, bench_args)
        if args.command == "replay":
            return _run_script("replay", REPLAY_SCRIPT, REPLAY_MODULE, bench_args)
        return _serve(args)
    except ValueError as err:
        print(f"rayturn: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

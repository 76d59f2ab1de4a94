"""The ``rayturn`` command line.

``rayturn serve`` runs the cluster (embedded local Ray, or ``--address`` to
join one); ``rayturn generate`` runs the offline engine on prompts;
``rayturn bench [args]`` runs the agent-sessions benchmark
(``rayturn.replay.agent_sessions``) with those arguments;
``rayturn replay [args]`` replays recorded agent traces (``rayturn.replay.cli``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from collections.abc import Sequence


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="preset (tiny, small, tiny-bpe) or a model directory")
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
    from rayturn.cluster.config import load_config
    from rayturn.cluster.runner import serve_forever

    flags = {
        "model.name": args.model,
        "server.http_port": args.http_port,
        "server.grpc_port": args.grpc_port,
        "server.host": args.host,
        "model.tool_call_parser": args.tool_call_parser,
    }
    config = load_config(args.config, **{key: value for key, value in flags.items() if value is not None})
    if args.api_key:
        server = dataclasses.replace(config.server, api_keys=config.server.api_keys + tuple(args.api_key))
        config = dataclasses.replace(config, server=server)
    return serve_forever(config, args.address)


def _bench(argv: Sequence[str]) -> int:
    from rayturn.replay.agent_sessions import main as bench_main

    return bench_main(list(argv), prog="rayturn bench")


def _replay(argv: Sequence[str]) -> int:
    from rayturn.replay.cli import main as replay_main

    return replay_main(list(argv), prog="rayturn replay")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rayturn", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate offline with the engine")
    _add_engine_args(gen)
    gen.add_argument("prompts", nargs="+", help="prompts (raw text)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    serve = sub.add_parser(
        "serve", help="run the cluster: OpenAI, Anthropic Messages and Responses HTTP + gRPC on Ray Serve"
    )
    serve.add_argument("--config", default=None, help="cluster YAML (see cluster/examples/rayturn.yaml)")
    serve.add_argument("--model", default=None, help="preset (tiny, small, tiny-bpe) or a model directory")
    serve.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    serve.add_argument("--http-port", type=int, default=None)
    serve.add_argument("--grpc-port", type=int, default=None)
    serve.add_argument("--host", default=None, help="HTTP and gRPC bind address (default from config: 127.0.0.1)")
    serve.add_argument(
        "--tool-call-parser",
        default=None,
        help="the format the model calls tools in (hermes, qwen3_coder, llama3_json, mistral); "
        "default: the one its chat template shows",
    )
    serve.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="an API key callers must present (repeatable; each a tenant of its own; adds to server.api_keys)",
    )
    # Every argument after `bench` is the benchmark's own (`rayturn bench --help` lists them).
    sub.add_parser("bench", help="run the agent-sessions benchmark: rayturn vs a baseline", add_help=False)
    # Likewise after `replay` (`rayturn replay --help`).
    sub.add_parser("replay", help="replay recorded agent traces against a cluster", add_help=False)
    args, bench_args = parser.parse_known_args(argv)
    if bench_args and args.command not in ("bench", "replay"):
        parser.error(f"unrecognized arguments: {' '.join(bench_args)}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    try:
        if args.command == "generate":
            return _generate(args, args.prompts, args.chat)
        if args.command == "bench":
            return _bench(bench_args)
        if args.command == "replay":
            return _replay(bench_args)
        return _serve(args)
    except ValueError as err:
        print(f"rayturn: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

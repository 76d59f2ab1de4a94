"""The ``rayturn`` command line: ``serve``, ``generate``, ``bench``, ``replay`` and ``deploy render``.

``rayturn serve [MODEL]`` takes the flags ``vllm serve`` users know under
the same names (``--host``, ``--port``, ``--api-key``, ``--served-model-name``,
``--max-model-len``, ``--dtype``, ``--max-num-seqs``, ``--max-num-batched-tokens``, ``--tool-call-parser``,
``--enforce-eager``); each one given
overrides the ``--config`` file's key. ``bench`` and ``replay`` pass every
argument after them to their own parsers (``rayturn.replay``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

DESCRIPTION = "rayturn: disaggregated LLM serving on Ray Serve for agentic coding workloads."
SERVE_DESCRIPTION = (
    "Start the rayturn API server on Ray Serve: the OpenAI API (chat completions, completions, "
    "Responses), Anthropic Messages and gRPC, over a prefill pool, a decode pool and a shared KV store. "
    "Without --address it starts a Ray of its own; Ctrl-C (or SIGTERM) stops everything it started."
)
API_KEY_ENV = "RAYTURN_API_KEY"
LOG_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}
# vLLM's --dtype names; "half" and "float" are other names of float16 and float32.
DTYPE_CHOICES = ("auto", "bfloat16", "float", "float16", "float32", "half")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
DEFAULT_DTYPE = "float32"
HTTP_CLIENT_LOGGERS = ("httpx", "httpx2")  # the openai client's transport, by release


def port_number(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in 0-65535, got {port}")
    return port


def positive_count(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return count


def token_count(text: str) -> int:
    """A positive number of tokens, as vLLM writes them: ``32768``, ``32k`` (x1000) or ``32K`` (x1024)."""
    multiplier = {"k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2}.get(text[-1:], 1)
    digits = text[:-1] if multiplier > 1 else text
    try:
        count = int(digits) * multiplier
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of tokens such as 32768, 32k or 32K, got {text!r}"
        ) from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return count


def _add_log_level(parser: argparse.ArgumentParser, default: Any) -> None:
    parser.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        default=default,
        help="Log level of rayturn, Ray and Serve on this console; debug adds Serve's access log and every "
        "Ray process's output. (default: info)",
    )


def _add_dtype(parser: argparse.ArgumentParser, default_note: str) -> None:
    parser.add_argument(
        "--dtype",
        type=str.lower,
        choices=DTYPE_CHOICES,
        default=None,
        help='Data type for model weights and activations. "auto" uses the torch_dtype in the model\'s '
        'config.json when it is float32, bfloat16 or float16, and float32 otherwise. "half" is float16, '
        f'"float" is float32. (default: {default_note})',
    )


def _add_enforce_eager(parser: argparse.ArgumentParser, captured: str, default: bool | None, default_note: str) -> None:
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        default=default,
        help="Always run the model eagerly: no CUDA graphs of decode steps, which a GPU backend otherwise "
        f"captures {captured}. (default: {default_note})",
    )


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="tiny",
        help="A preset (tiny, small, tiny-bpe), a model directory, or a Hugging Face model id in the local "
        "Hugging Face cache. (default: tiny)",
    )
    _add_dtype(parser, DEFAULT_DTYPE)
    parser.add_argument("--backend", default=None, help="Kernel backend (torch, triton). (default: chosen per device)")
    parser.add_argument("--max-tokens", type=int, default=32, help="Tokens to generate per prompt. (default: 32)")
    parser.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature. (default: 0.0)")
    _add_enforce_eager(parser, "before generating", False, "false")


def _add_serve_args(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="Name or path of the model: a preset (tiny, small, tiny-bpe), a model directory, or a Hugging "
        "Face model id (org/name) already in the local Hugging Face cache ($HF_HUB_CACHE, else "
        "$HF_HOME/hub); nothing is downloaded. (default: model.name in --config, else tiny)",
    )
    serve.add_argument("--model", default=None, metavar="MODEL", help="The same as MODEL.")
    serve.add_argument(
        "--config", default=None, metavar="FILE", help="Cluster YAML; see cluster/examples/rayturn.yaml."
    )
    serve.add_argument("--host", default=None, help="Host name. (default: 127.0.0.1, or server.host in --config)")
    serve.add_argument(
        "--port",
        "--http-port",
        dest="port",
        type=port_number,
        default=None,
        help="Port number (HTTP). (default: 8000, or server.http_port in --config)",
    )
    serve.add_argument(
        "--grpc-port",
        type=port_number,
        default=None,
        help="gRPC port number. (default: 9000, or server.grpc_port in --config)",
    )
    serve.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="If provided, the server will require one of these keys to be presented in the header "
        "(Authorization: Bearer KEY, or x-api-key). Repeatable; each key is a tenant of its own, added to "
        f"server.api_keys in --config. (default: ${API_KEY_ENV}, one key, taken whole)",
    )
    serve.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="The model name used in the API (the model field of requests and responses, GET /v1/models). "
        "(default: model.served_name in --config, else the preset's name, a Hugging Face id as given, "
        "or the last part of the model's path)",
    )
    serve.add_argument(
        "--max-model-len",
        type=token_count,
        default=None,
        help="Model context length (prompt plus output), e.g. 32768, 32k or 32K. (default: model.max_model_len "
        "in --config, else derived from the model's config.json)",
    )
    _add_dtype(serve, f"{DEFAULT_DTYPE}, or model.dtype in --config")
    serve.add_argument(
        "--max-num-seqs",
        type=positive_count,
        default=None,
        help="Most sequences a replica runs together. (default: model.max_num_seqs in --config, else 64)",
    )
    serve.add_argument(
        "--max-num-batched-tokens",
        type=token_count,
        default=None,
        help="Most tokens (prompt chunks and decode tokens) a replica computes in one step, e.g. 2048 or 2k. "
        "(default: model.max_num_batched_tokens in --config, else 2048)",
    )
    serve.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="The format the model writes tool calls in: hermes, qwen3_coder, llama3_json, mistral or harmony. "
        "(default: the one its chat template shows)",
    )
    serve.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help="Split the model's reasoning (<think>...</think>) from its answers: qwen3 or deepseek_r1. "
        "(default: model.reasoning_parser in --config, else none)",
    )
    _add_enforce_eager(serve, "at start", None, "model.enforce_eager in --config, else false")
    serve.add_argument("--address", default=None, help="Join the Ray cluster at this address instead of starting one.")
    _add_log_level(serve, argparse.SUPPRESS)


def _dtype(choice: str | None, model: str) -> str | None:
    """The engine's dtype for a ``--dtype`` choice: an alias's name, or for ``auto`` the checkpoint's."""
    if choice != "auto":
        return DTYPE_ALIASES.get(choice, choice) if choice else None
    from rayturn.engine.model_source import checkpoint_dtype
    from rayturn.engine.presets import resolve_model_dir

    return checkpoint_dtype(resolve_model_dir(model)) or DEFAULT_DTYPE


def _generate(args: argparse.Namespace, prompts: Sequence[str], chat: bool) -> int:
    from rayturn.engine import LLMEngine, SamplingParams
    from rayturn.engine.warm_up import warm_up_kernels

    dtype = _dtype(args.dtype, args.model) or DEFAULT_DTYPE
    engine = LLMEngine.from_pretrained(args.model, backend=args.backend, dtype=dtype, enforce_eager=args.enforce_eager)
    if engine.backend.compiles_kernels() or engine.backend.captures_cuda_graphs():
        # As a served replica starts (Triton on a GPU): kernels built and decode steps recorded as CUDA graphs
        # before the clock below starts. A CPU backend has nothing that needs it; its first steps build lazily.
        warm_up_start = time.perf_counter()
        warm_up_kernels(engine)
        graphs = "decode steps as CUDA graphs" if engine.runner.decode_graphs is not None else "eager"
        print(f"warmed up in {time.perf_counter() - warm_up_start:.1f} s ({graphs})")
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


def config_overrides(args: argparse.Namespace, model: str | None) -> dict[str, Any]:
    """The config keys the serve flags given set (a flag not given leaves its key to --config)."""
    flags = {
        "model.name": model,
        "model.served_name": args.served_model_name,
        "model.max_model_len": args.max_model_len,
        "model.max_num_seqs": args.max_num_seqs,
        "model.max_num_batched_tokens": args.max_num_batched_tokens,
        "model.tool_call_parser": args.tool_call_parser,
        "model.reasoning_parser": args.reasoning_parser,
        "model.enforce_eager": args.enforce_eager,
        "server.host": args.host,
        "server.http_port": args.port,
        "server.grpc_port": args.grpc_port,
    }
    return {key: value for key, value in flags.items() if value is not None}


def _serve(args: argparse.Namespace, model: str | None) -> int:
    if args.address is None and "ray" not in sys.modules:
        # The Ray this command starts uses token authentication, which Ray 2.60 turns on for a local
        # Ray anyway; asking for it spares the warning that it was turned on unasked. Ray reads the
        # variable once, when it is imported (set later, Ray and its GCS would disagree).
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    from rayturn.cluster.config import API_KEYS_ENV, load_config
    from rayturn.cluster.runner import serve_forever

    config = load_config(args.config, **config_overrides(args, model))
    dtype = _dtype(args.dtype, config.model.name)
    if dtype is not None:
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype=dtype))
    # As vLLM takes VLLM_API_KEY: the variable is one key, used when no --api-key is given.
    api_keys = args.api_key if args.api_key is not None else [os.environ.get(API_KEY_ENV, "")]
    api_keys = [key for key in api_keys if key]
    if api_keys:
        server = dataclasses.replace(config.server, api_keys=config.server.api_keys + tuple(api_keys))
        config = dataclasses.replace(config, server=server)
    # Read: the Ray this command starts (its raylet and every worker) would inherit them with the environment.
    for name in (API_KEY_ENV, API_KEYS_ENV):
        os.environ.pop(name, None)
    return serve_forever(config, args.address, LOG_LEVELS[args.log_level])


def _deploy_render(args: argparse.Namespace) -> int:
    from rayturn.cluster.render import render_command

    return render_command(args.config, args.image, args.out)


def _bench(argv: Sequence[str]) -> int:
    from rayturn.replay.agent_sessions import main as bench_main

    return bench_main(list(argv), prog="rayturn bench")


def _replay(argv: Sequence[str]) -> int:
    from rayturn.replay.cli import main as replay_main

    return replay_main(list(argv), prog="rayturn replay")


def _add_deploy(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    deploy = sub.add_parser("deploy", help="Render the Kubernetes (KubeRay) manifests for a cluster config.")
    actions = deploy.add_subparsers(dest="deploy_command", required=True, metavar="{render}")
    render = actions.add_parser(
        "render",
        help="Write the RayService, its ConfigMap and its gRPC Service for a config.",
        description="Turn the config `rayturn serve` reads into KubeRay manifests: a ConfigMap with the config, "
        "a RayService (head, prefill and decode worker groups sized from the pools, serveConfigV2) and a gRPC "
        "Service. API keys come from the Secret rayturn-api-keys, never from the config.",
    )
    render.add_argument("--config", default=None, metavar="FILE", help="Cluster YAML. (default: all defaults)")
    render.add_argument(
        "--image",
        default=None,
        metavar="IMG",
        help="Container image the pods run. (default: rayturn:VERSION, rayturn:VERSION-gpu when a pool uses GPUs)",
    )
    render.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="Write DIR/<config name>.yaml (rayservice.yaml without --config). (default: standard output)",
    )


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The ``rayturn`` parser and its ``serve`` subparser (whose errors name ``rayturn serve``)."""
    parser = argparse.ArgumentParser(prog="rayturn", description=DESCRIPTION)
    _add_log_level(parser, "info")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,generate,bench,replay,deploy}")
    serve = sub.add_parser(
        "serve",
        help="Start the API server (OpenAI, Anthropic Messages, Responses, gRPC) on Ray Serve.",
        description=SERVE_DESCRIPTION,
        usage="rayturn serve [MODEL] [options]",
    )
    _add_serve_args(serve)
    gen = sub.add_parser(
        "generate",
        help="Generate offline with the engine, no server.",
        description="Generate text for each prompt with the offline engine (no Ray, no server).",
    )
    _add_engine_args(gen)
    gen.add_argument("prompts", nargs="+", help="Prompts (raw text).")
    gen.add_argument("--chat", action="store_true", help="Wrap each prompt as a user message in the chat template.")
    _add_log_level(gen, argparse.SUPPRESS)
    # Every argument after `bench` is the benchmark's own (`rayturn bench --help` lists them).
    sub.add_parser("bench", help="Run the agent-sessions benchmark: rayturn against a baseline.", add_help=False)
    # Likewise after `replay` (`rayturn replay --help`).
    sub.add_parser("replay", help="Replay recorded agent traces against a cluster.", add_help=False)
    _add_deploy(sub)
    return parser, serve


def main(argv: Sequence[str] | None = None) -> int:
    parser, serve_parser = build_parser()
    args, passed_on = parser.parse_known_args(argv)
    if passed_on and args.command not in ("bench", "replay"):
        (serve_parser if args.command == "serve" else parser).error(f"unrecognized arguments: {' '.join(passed_on)}")
    model = None
    if args.command == "serve":
        if args.model_tag and args.model and args.model_tag != args.model:
            serve_parser.error(f"two models given: {args.model_tag!r} and --model {args.model!r}; give one")
        model = args.model_tag or args.model
    level = LOG_LEVELS[args.log_level]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level > logging.DEBUG:
        # The HTTP client's line per request (the calls `bench` and `replay` send) is an access log too.
        for name in HTTP_CLIENT_LOGGERS:
            logging.getLogger(name).setLevel(max(level, logging.WARNING))

    try:
        if args.command == "generate":
            return _generate(args, args.prompts, args.chat)
        if args.command == "bench":
            return _bench(passed_on)
        if args.command == "replay":
            return _replay(passed_on)
        if args.command == "deploy":
            return _deploy_render(args)
        return _serve(args, model)
    except ValueError as err:
        print(f"rayturn: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

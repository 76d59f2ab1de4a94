"""What rayturn's checks cost one agent call, against that call's time to first token.

Every call through the ingress pays for the caller's key (a SHA-256 and a
dict lookup), a bounded body read, the prompt-length bound, and a thread hop
for a body over 64 KiB; every lookup at the KV master that finds pages pays
for a read grant (one HMAC per segment over the sorted ranges), and every put
for a write grant. A read or write of another owner's segment (across nodes,
or with UCX forced) also pays the owner's check of its grant (an HMAC and a
sorted lookup of every range). Connections prove the store secret once, not
per call. Each piece is timed with the real functions on an agent call, in
the same run as the baselines: the per-call pieces against that call's time
to first token with its prefix cached, on the offline engine (less than the
cluster takes, so the ratio printed is an upper bound on their share); the
owner's checks against a memcpy of the pages they let through (less than
any transfer across processes takes).

The call: a prompt that fills ~75% of the model's context (a coding agent's
system prompt, tools and history) plus 100 new tokens; its body as the
OpenAI client sends it. ``--body-kib`` adds a second body of that size (a
100k-token conversation is ~400 KiB) whose checks are timed alone.

    python bench/security_overhead.py [--quick] [--model tiny] [--body-kib 400]

The last line of stdout is one JSON object; ``overhead_fraction_of_ttft`` is
the per-call checks over the median TTFT (target < 0.01), and
``cross_node_fraction_of_copy`` the owner's checks over the memcpy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np

from rayturn.api.request_limits import INLINE_BYTES, PromptBudget, off_loop, read_body
from rayturn.api.tenants import KeyTable, presented_key
from rayturn.engine import LLMEngine, SamplingParams
from rayturn.kvstore.access import StoreAuth, new_secret
from rayturn.replay.harness import Progress, emit, machine

API_KEYS = [f"sk-tenant-{i:03d}-{'x' * 24}" for i in range(100)]
NEW_TOKENS = 100
READ_CHUNK_BYTES = 64 << 10  # what the HTTP server hands the ingress at a time


def agent_body(num_chars: int) -> bytes:
    """A chat request whose messages hold about ``num_chars`` characters, shaped like a coding agent's."""
    tool = {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    }
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent. " * 8}]
    turn = "def handler(event):\n    return process(event)\n"
    while sum(len(m["content"]) for m in messages) < num_chars:
        messages.append({"role": "user", "content": turn * 8})
        messages.append({"role": "assistant", "content": "Reading the handler next."})
    return json.dumps({"model": "tiny", "messages": messages, "tools": [tool] * 20, "stream": True}).encode()


def median_us(work: Callable[[], Any], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


async def body_chunks(body: bytes) -> AsyncIterator[bytes]:
    for start in range(0, len(body), READ_CHUNK_BYTES):
        yield body[start : start + READ_CHUNK_BYTES]


def ingress_checks_us(body: bytes, budget: PromptBudget, repeats: int) -> dict[str, float]:
    """The ingress's added work for one body, per piece (each minus what the ingress did before)."""
    keys = KeyTable.build(API_KEYS, {})
    headers = {"authorization": f"Bearer {API_KEYS[-1]}", "content-length": str(len(body))}
    text = json.loads(body)["messages"][-1]["content"] * (len(body) // 400 + 1)
    loop = asyncio.new_event_loop()

    async def bounded() -> bytes:
        return await read_body(headers, body_chunks(body), 16 << 20)

    async def unbounded() -> bytes:
        return b"".join([chunk async for chunk in body_chunks(body)])

    async def hop() -> None:
        await off_loop(len(body), lambda: None)

    try:
        parts = {
            "api_key": median_us(lambda: keys.tenant_of(presented_key(headers)), repeats),
            "body_limit": max(
                0.0,
                median_us(lambda: loop.run_until_complete(bounded()), repeats)
                - median_us(lambda: loop.run_until_complete(unbounded()), repeats),
            ),
            "prompt_bound": median_us(lambda: budget.check(text, param="messages"), repeats),
            "thread_hop": median_us(lambda: loop.run_until_complete(hop()), repeats)
            if len(body) >= INLINE_BYTES
            else 0.0,
        }
    finally:
        loop.close()
    return parts


def store_checks_us(prompt_pages: int, new_pages: int, page_bytes: int, repeats: int) -> dict[str, float]:
    """Grants for reading a call's cached pages, and for writing its new ones; the owner's checks of them."""
    auth = StoreAuth(new_secret())
    offsets = np.arange(prompt_pages, dtype=np.int64) * page_bytes
    ranges = np.stack([offsets, np.full(prompt_pages, page_bytes, dtype=np.int64)], axis=1)
    asked = [(int(offset), page_bytes) for offset in offsets]
    read = auth.read_grant("segment", "epoch", ranges, 5.0)
    entries = [(f"key-{i}".encode() * 2, int(i * page_bytes), page_bytes) for i in range(new_pages)]
    write = auth.write_grant("segment", "epoch", "tenant", entries, 15.0)
    keys = [key for key, _, _ in entries]
    write_ranges = [(offset, length) for _, offset, length in entries]
    pages = np.ones(prompt_pages * page_bytes, dtype=np.uint8)
    landed = np.empty_like(pages)
    return {
        "read_grant": median_us(lambda: auth.read_grant("segment", "epoch", ranges, 5.0), repeats),
        "write_grant": median_us(lambda: auth.write_grant("segment", "epoch", "tenant", entries, 15.0), repeats),
        "read_check": median_us(lambda: auth.check_read("segment", "epoch", read, asked), repeats),
        "write_check": median_us(
            lambda: auth.check_write("segment", "epoch", "tenant", write, keys, write_ranges), repeats
        ),
        "memcpy_of_read_pages": median_us(lambda: np.copyto(landed, pages), max(repeats // 10, 20)),
    }


def cached_ttft_s(engine: LLMEngine, prompt: list[int], repeats: int) -> list[float]:
    """TTFT of ``prompt`` + 100 new tokens once ``prompt`` is cached (a fresh suffix each time)."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    engine.generate([prompt], params)
    samples = []
    for index in range(repeats):
        suffix = [(7 * index + i) % 200 + 20 for i in range(NEW_TOKENS)]
        start = time.perf_counter()
        (output,) = engine.generate([prompt + suffix], params)
        samples.append(time.perf_counter() - start)
        assert output.num_cached_prompt_tokens >= len(prompt) - engine.page_size
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--body-kib", type=int, default=400, help="a large body whose checks are timed alone")
    args = parser.parse_args()
    repeats, ttft_repeats = (300, 3) if args.quick else (3000, 10)

    engine = LLMEngine.from_pretrained(args.model, dtype="float32")
    budget = PromptBudget(engine.max_model_len, engine.tokenizer.max_token_chars)
    body = agent_body(int(engine.max_model_len * 0.75))
    messages = json.loads(body)["messages"]
    prompt = engine.tokenizer.encode_chat(messages)[: engine.max_model_len - NEW_TOKENS - 1]
    page_bytes = engine.runner.kv_cache[0].nbytes

    progress = Progress("security overhead", 4)
    ingress = ingress_checks_us(body, budget, repeats)
    progress.advance()
    store = store_checks_us(len(prompt) // engine.page_size, NEW_TOKENS // engine.page_size + 1, page_bytes, repeats)
    progress.advance()
    large = ingress_checks_us(agent_body(args.body_kib << 10), budget, max(repeats // 10, 30))
    progress.advance()
    ttft = cached_ttft_s(engine, prompt, ttft_repeats)
    progress.advance()

    per_call_us = sum(ingress.values()) + store["read_grant"] + store["write_grant"]
    cross_node_us = store["read_check"] + store["write_check"]
    ttft_ms = statistics.median(ttft) * 1e3
    emit(
        {
            "benchmark": "security_overhead",
            "model": args.model,
            "quick": args.quick,
            "prompt_tokens": len(prompt) + NEW_TOKENS,
            "body_bytes": len(body),
            "ingress_checks_us": {name: round(value, 2) for name, value in ingress.items()},
            "store_checks_us": {name: round(value, 2) for name, value in store.items()},
            "per_call_us": round(per_call_us, 1),
            "cross_node_us": round(cross_node_us, 1),
            "read_pages_bytes": (len(prompt) // engine.page_size) * page_bytes,
            "large_body_bytes": len(agent_body(args.body_kib << 10)),
            "large_body_ingress_checks_us": {name: round(value, 1) for name, value in large.items()},
            "cached_ttft_ms_median": round(ttft_ms, 2),
            "overhead_fraction_of_ttft": round(per_call_us / 1e3 / ttft_ms, 5),
            "cross_node_fraction_of_copy": round(cross_node_us / store["memcpy_of_read_pages"], 5),
            "target_fraction": 0.01,
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    main()

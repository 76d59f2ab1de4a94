"""A stand-in model server that records every request a coding-agent CLI sends and answers it plausibly.

Run it, point a CLI at it, and read what the CLI asked for::

    python tests/agents/capture_server.py --port 28493 --out /tmp/agent_captures/claude

Each request lands in ``OUT/NNN-METHOD-PATH.json`` (method, path, query, headers, the
body parsed as JSON where it is JSON, and the status answered). It answers the three
wire protocols the CLIs speak, always streaming when asked to:

* ``POST /v1/messages`` (Anthropic Messages; ``count_tokens`` too),
* ``POST /v1/responses`` (OpenAI Responses),
* ``POST /v1/chat/completions`` (OpenAI Chat Completions),
* ``GET /v1/models`` (both the OpenAI and the Anthropic list shapes in one object).

Anything else gets a 404 that is recorded like the rest; a ``CONNECT`` (a CLI that
honours ``HTTPS_PROXY`` reaching for the internet) gets a 403 and is recorded too.
``--fail-status 500 --fail-times 3`` answers the first three model calls with that
error instead, to see how a CLI retries (the request files' times show its back-off).
From the second Messages call on, answers report cached prompt tokens, so a client's
handling of ``cache_read_input_tokens`` shows up in its output.
"""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

REPLY_TEXT = "hi there"
PROMPT_TOKENS = 120
CACHED_TOKENS = 96

Answer = tuple[int, str, bytes]  # status, content type, body


def sse(events: list[tuple[str | None, dict[str, Any]]]) -> bytes:
    """Server-sent events; a None event name writes a data-only event (the Chat Completions style)."""
    lines = []
    for name, data in events:
        if name is not None:
            lines.append(f"event: {name}")
        lines.append(f"data: {json.dumps(data)}\n")
    return ("\n".join(lines) + "\n").encode()


class Replies:
    """The answers, per protocol; counts Messages calls so the later ones report cache hits."""

    def __init__(self) -> None:
        self._messages_calls = itertools.count()

    def messages(self, body: dict[str, Any]) -> Answer:
        cached = CACHED_TOKENS if next(self._messages_calls) > 0 else 0
        usage = {
            "input_tokens": PROMPT_TOKENS - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": 3,
        }
        message = {
            "id": f"msg_{time.monotonic_ns()}",
            "type": "message",
            "role": "assistant",
            "model": body.get("model", "tiny"),
            "content": [{"type": "text", "text": REPLY_TEXT}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": usage,
        }
        if not body.get("stream"):
            return 200, "application/json", json.dumps(message).encode()
        start = {**message, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}
        return (
            200,
            "text/event-stream",
            sse(
                [
                    ("message_start", {"type": "message_start", "message": start}),
                    (
                        "content_block_start",
                        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                    ),
                    ("ping", {"type": "ping"}),
                    (
                        "content_block_delta",
                        {
                            "type": "content_block_delta",
                            "index": 0,
                            "delta": {"type": "text_delta", "text": REPLY_TEXT},
                        },
                    ),
                    ("content_block_stop", {"type": "content_block_stop", "index": 0}),
                    (
                        "message_delta",
                        {
                            "type": "message_delta",
                            "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                            "usage": {"output_tokens": 3},
                        },
                    ),
                    ("message_stop", {"type": "message_stop"}),
                ]
            ),
        )

    def count_tokens(self, body: dict[str, Any]) -> Answer:
        return 200, "application/json", json.dumps({"input_tokens": len(json.dumps(body)) // 4}).encode()

    def responses(self, body: dict[str, Any]) -> Answer:
        response_id = f"resp_{time.monotonic_ns()}"
        item = {
            "type": "message",
            "id": f"msg_{time.monotonic_ns()}",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": REPLY_TEXT, "annotations": []}],
        }
        usage = {
            "input_tokens": PROMPT_TOKENS,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 3,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": PROMPT_TOKENS + 3,
        }
        base = {
            "id": response_id,
            "object": "response",
            "created_at": int(time.time()),
            "model": body.get("model", "tiny"),
        }
        done = {**base, "status": "completed", "output": [item], "usage": usage}
        if not body.get("stream"):
            return 200, "application/json", json.dumps(done).encode()
        part = {"type": "output_text", "text": "", "annotations": []}
        return (
            200,
            "text/event-stream",
            sse(
                [
                    (
                        "response.created",
                        {"type": "response.created", "response": {**base, "status": "in_progress", "output": []}},
                    ),
                    (
                        "response.output_item.added",
                        {
                            "type": "response.output_item.added",
                            "output_index": 0,
                            "item": {**item, "status": "in_progress", "content": []},
                        },
                    ),
                    (
                        "response.content_part.added",
                        {
                            "type": "response.content_part.added",
                            "item_id": item["id"],
                            "output_index": 0,
                            "content_index": 0,
                            "part": part,
                        },
                    ),
                    (
                        "response.output_text.delta",
                        {
                            "type": "response.output_text.delta",
                            "item_id": item["id"],
                            "output_index": 0,
                            "content_index": 0,
                            "delta": REPLY_TEXT,
                        },
                    ),
                    (
                        "response.output_text.done",
                        {
                            "type": "response.output_text.done",
                            "item_id": item["id"],
                            "output_index": 0,
                            "content_index": 0,
                            "text": REPLY_TEXT,
                        },
                    ),
                    (
                        "response.content_part.done",
                        {
                            "type": "response.content_part.done",
                            "item_id": item["id"],
                            "output_index": 0,
                            "content_index": 0,
                            "part": {**part, "text": REPLY_TEXT},
                        },
                    ),
                    (
                        "response.output_item.done",
                        {"type": "response.output_item.done", "output_index": 0, "item": item},
                    ),
                    ("response.completed", {"type": "response.completed", "response": done}),
                ]
            ),
        )

    def chat_completions(self, body: dict[str, Any]) -> Answer:
        base = {
            "id": f"chatcmpl-{time.monotonic_ns()}",
            "created": int(time.time()),
            "model": body.get("model", "tiny"),
        }
        usage = {
            "prompt_tokens": PROMPT_TOKENS,
            "completion_tokens": 3,
            "total_tokens": PROMPT_TOKENS + 3,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        if not body.get("stream"):
            choice = {"index": 0, "message": {"role": "assistant", "content": REPLY_TEXT}, "finish_reason": "stop"}
            answer = {**base, "object": "chat.completion", "choices": [choice], "usage": usage}
            return 200, "application/json", json.dumps(answer).encode()
        chunk = {**base, "object": "chat.completion.chunk"}
        events: list[tuple[str | None, dict[str, Any]]] = [
            (
                None,
                {
                    **chunk,
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
                },
            ),
            (None, {**chunk, "choices": [{"index": 0, "delta": {"content": REPLY_TEXT}, "finish_reason": None}]}),
            (None, {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
        ]
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append((None, {**chunk, "choices": [], "usage": usage}))
        return 200, "text/event-stream", sse(events) + b"data: [DONE]\n\n"

    def models(self) -> Answer:
        model = {
            "id": "tiny",
            "object": "model",
            "created": 0,
            "owned_by": "capture",
            "type": "model",
            "display_name": "tiny",
            "created_at": "2025-01-01T00:00:00Z",
        }
        listing = {"object": "list", "data": [model], "has_more": False, "first_id": "tiny", "last_id": "tiny"}
        return 200, "application/json", json.dumps(listing).encode()


class Recorder:
    """Writes one numbered JSON file per request into a folder."""

    def __init__(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.out_dir = out_dir
        self._lock = threading.Lock()
        self._next = itertools.count(1)

    def record(self, exchange: dict[str, Any]) -> None:
        with self._lock:
            number = next(self._next)
        slug = exchange["path"].strip("/").replace("/", "_") or "root"
        path = self.out_dir / f"{number:03d}-{exchange['method']}-{slug[:60]}.json"
        path.write_text(json.dumps({"seq": number, **exchange}, indent=2, ensure_ascii=False))


class Failures:
    """Answers the first ``times`` model calls with an error of ``status``."""

    def __init__(self, status: int, times: int) -> None:
        self.status = status
        self._left = times
        self._lock = threading.Lock()

    def next_failure(self) -> Answer | None:
        with self._lock:
            if self._left <= 0:
                return None
            self._left -= 1
        error = {"type": "error", "error": {"type": "api_error", "message": f"injected {self.status}"}}
        return self.status, "application/json", json.dumps(error).encode()


def make_handler(recorder: Recorder, replies: Replies, failures: Failures) -> type[BaseHTTPRequestHandler]:
    posts: dict[str, Callable[[dict[str, Any]], Answer]] = {
        "/v1/messages": replies.messages,
        "/v1/messages/count_tokens": replies.count_tokens,
        "/v1/responses": replies.responses,
        "/responses": replies.responses,
        "/v1/chat/completions": replies.chat_completions,
        "/chat/completions": replies.chat_completions,
    }

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            print(f"{self.command} {self.path} -> {args[1] if len(args) > 1 else ''}", flush=True)

        def _read_body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while (size := int(self.rfile.readline().split(b";")[0], 16)) > 0:
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                self.rfile.readline()
                return b"".join(chunks)
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _serve(self) -> None:
            raw = self._read_body()
            url = urlsplit(self.path)
            try:
                body: Any = json.loads(raw) if raw else None
            except (UnicodeDecodeError, json.JSONDecodeError):
                body = {"undecoded_bytes": len(raw), "head": raw[:200].decode("latin-1")}
            if self.command == "POST" and url.path in posts:
                failure = failures.next_failure() if url.path != "/v1/messages/count_tokens" else None
                status, content_type, payload = failure or posts[url.path](body if isinstance(body, dict) else {})
            elif self.command == "GET" and url.path in ("/v1/models", "/models"):
                status, content_type, payload = replies.models()
            else:
                error = {"type": "error", "error": {"type": "not_found_error", "message": f"no route {url.path}"}}
                status, content_type, payload = 404, "application/json", json.dumps(error).encode()
            recorder.record(
                {
                    "time": time.time(),
                    "method": self.command,
                    "path": url.path,
                    "query": parse_qs(url.query, keep_blank_values=True),
                    "headers": dict(self.headers.items()),
                    "body": body,
                    "status": status,
                }
            )
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _serve

        def do_CONNECT(self) -> None:
            recorder.record(
                {
                    "time": time.time(),
                    "method": "CONNECT",
                    "path": self.path,
                    "query": {},
                    "headers": dict(self.headers.items()),
                    "body": None,
                    "status": 403,
                }
            )
            self.send_response(403)
            self.send_header("Content-Length", "0")
            self.end_headers()

    return Handler


class QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A CLI that drops a refused proxy tunnel resets the socket; one line says so.
        print(f"{client_address}: {sys.exc_info()[1]!r}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True, help="folder the request files go to")
    parser.add_argument("--fail-status", type=int, default=500, help="HTTP status of the injected errors")
    parser.add_argument("--fail-times", type=int, default=0, help="model calls answered with an error first")
    args = parser.parse_args()
    handler = make_handler(Recorder(args.out), Replies(), Failures(args.fail_status, args.fail_times))
    server = QuietServer(("127.0.0.1", args.port), handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"recording to {args.out} on http://127.0.0.1:{args.port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()

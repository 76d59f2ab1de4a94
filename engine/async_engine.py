"""An ``LLMEngine`` driven by its own thread, for servers with an asyncio loop.

One thread owns the engine: it admits requests, runs ``step()`` while there
is work and hands each output to the coroutine waiting for it. Everything
that touches the engine runs on that thread (``call`` runs a function there
between steps), so the engine itself needs no locks. Before any request the
thread builds the kernels the backend keeps per matmul shape
(``warm_up_kernels``): the memory they take counts from the start. Where the
backend compiles its kernels per launch signature (Triton on a GPU), that
warm-up also runs every kind of step once (``warm_up``). A caller
that stops listening (client gone, task cancelled) aborts its request. While
no request runs, the thread still lets lapsed session holds go.

Servers use this facade only: what the engine is (``backend_name``,
``device``, ``model_id``, ``page_size``, ``bytes_per_page``, ``has_store``),
and the read-only lookups that run beside the engine thread rather than on it
(``prefix_residency``, ``session_residency``, ``has_unfinished_requests``,
``store_prefix_pages``): each only reads, so a racing step only makes its
answer an estimate.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .page_hash import PageHash
from .prefix_pins import Retention
from .priority import Priority
from .sampling_params import SamplingParams
from .sequence import TokenLogprob
from .tokenizer import Tokenizer
from .warm_up import warm_up_kernels

logger = logging.getLogger(__name__)

T = TypeVar("T")

_IDLE_WAIT_S = 0.05
_STATS_PERIOD_S = 0.5
_CACHED_HASHES_REPORTED = 2048


class _Finished:
    """Sentinel put on a request's queue after its last output."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._listeners: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[object]]] = {}
        self._stats: dict[str, Any] = {}
        self._stats_at = 0.0
        self._refresh_stats(force=True)
        self._running = True
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="rayturn-engine", daemon=True)
        self._thread.start()
        started = time.perf_counter()
        num_matmuls = self.call(warm_up_kernels).result()
        logger.info("engine thread warmed up: %d matmuls in %.2f s", num_matmuls, time.perf_counter() - started)

    # -- the engine thread ------------------------------------------------

    def _loop(self) -> None:
        engine = self._engine
        while self._running:
            try:
                block = not engine.has_unfinished_requests()
                self._run_commands(block)
                if engine.has_unfinished_requests():
                    for output in engine.step():
                        self._deliver(output.request_id, output)
                        if output.finished:
                            self._deliver(output.request_id, _Finished())
                            self._listeners.pop(output.request_id, None)
                    self._refresh_stats(force=not engine.has_unfinished_requests())
                else:
                    engine.expire_holds()
                    self._refresh_stats()
            except Exception as err:  # a bug in a step: fail every listener, keep serving new requests
                logger.exception("engine step failed")
                self._failure = err
                for request_id in list(self._listeners):
                    self._deliver(request_id, err)
                    self._listeners.pop(request_id, None)
                    engine.abort(request_id)

    def _run_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            command()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, request_id: str, item: object) -> None:
        listener = self._listeners.get(request_id)
        if listener is not None:
            loop, outputs = listener
            loop.call_soon_threadsafe(outputs.put_nowait, item)

    def _refresh_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._stats_at >= _STATS_PERIOD_S:
            engine = self._engine
            hashes = [h.hex()[:16] for h in engine.cached_page_hashes(_CACHED_HASHES_REPORTED)]
            self._stats = {
                **engine.load_stats(),
                **engine.session_stats(),
                **engine.prefix_pins.stats(),
                "speculation": engine.drafter.stats.as_dict(),
                "page_size": engine.page_size,
                "cached_page_hashes": hashes,
            }
            self._stats_at = now

    # -- callers (any thread, usually an asyncio loop) --------------------

    def call(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Run ``fn(engine)`` on the engine thread between steps."""
        future: Future[T] = Future()

        def command() -> None:
            if not future.set_running_or_notify_cancel():
                return  # the caller gave up before its turn came: nothing to run
            try:
                future.set_result(fn(self._engine))
            except Exception as err:
                future.set_exception(err)

        self._commands.put(command)
        return future

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str,
        cache_salt: str = "",
        output_prefix: Sequence[int] = (),
        output_prefix_logprobs: Sequence[TokenLogprob] | None = None,
        session_id: str | None = None,
        page_hashes: Sequence[PageHash] | None = None,
        retention: Retention | None = None,
        continues_turn: bool = False,
        priority: Priority | str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; raises ``ValueError`` for bad input before the first one.

        ``page_hashes``: the prompt's leading page hashes, computed by the
        serving layer (see ``LLMEngine.add_request``). ``retention``: what of
        the prompt to keep cached after the request (``prefix_pins.py``).
        ``continues_turn``, ``priority``: the request's class (``LLMEngine.add_request``).
        """
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[object] = asyncio.Queue()

        admitted = False

        def admit(engine: LLMEngine) -> None:
            nonlocal admitted
            engine.add_request(
                list(prompt_token_ids),
                params,
                request_id=request_id,
                cache_salt=cache_salt,
                output_prefix=output_prefix,
                output_prefix_logprobs=output_prefix_logprobs,
                session_id=session_id,
                page_hashes=page_hashes,
                retention=retention,
                continues_turn=continues_turn,
                priority=priority,
            )
            # Both on the engine thread, so no step runs in between and no output is missed.
            self._listeners[request_id] = (loop, outputs)
            admitted = True

        finished = False
        try:
            # Inside the try: a caller cancelled once the request is admitted still aborts it.
            await asyncio.wrap_future(self.call(admit))
            while True:
                item = await outputs.get()
                if isinstance(item, _Finished):
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise RuntimeError(f"request {request_id} failed in the engine: {item}") from item
                assert isinstance(item, RequestOutput)
                yield item
        finally:
            if not finished:
                # Queued behind the admission (commands run in order), so ``admitted`` is settled by then.
                self._commands.put(lambda: self._abort_now(request_id) if admitted else None)

    def abort(self, request_id: str) -> None:
        self._commands.put(lambda: self._abort_now(request_id))

    def _abort_now(self, request_id: str) -> None:
        self._listeners.pop(request_id, None)
        self._engine.abort(request_id)

    # -- what the engine is ------------------------------------------------

    @property
    def backend_name(self) -> str:
        return self._engine.backend.name

    @property
    def device(self) -> str:
        return str(self._engine.device)

    @property
    def model_id(self) -> str:
        return self._engine.model_id

    @property
    def tokenizer(self) -> Tokenizer:
        """The engine's tokenizer; safe to read beside the engine thread (it keeps no per-request state)."""
        return self._engine.tokenizer

    @property
    def page_size(self) -> int:
        return self._engine.page_size

    @property
    def bytes_per_page(self) -> int:
        return self._engine.bytes_per_page

    @property
    def has_store(self) -> bool:
        """Whether the engine loads from and saves to a KV store."""
        return self._engine.kv_connector is not None

    # -- read-only lookups, beside the engine thread ------------------------

    def prefix_residency(
        self, token_ids: Sequence[int], cache_salt: str = "", page_hashes: Sequence[PageHash] | None = None
    ) -> tuple[list[PageHash], int]:
        """A prompt's page hashes and how many lead pages the engine caches (``LLMEngine.prefix_residency``)."""
        return self._engine.prefix_residency(token_ids, cache_salt, page_hashes)

    def session_residency(self, session_id: str) -> tuple[int, int]:
        """(leading recorded pages of a session cached now, recorded pages)."""
        return self._engine.session_residency(session_id)

    def has_unfinished_requests(self) -> bool:
        return self._engine.has_unfinished_requests()

    def store_prefix_pages(self, page_hashes: Sequence[PageHash], cache_salt: str) -> int:
        """How many leading pages of ``page_hashes`` the KV store holds for ``cache_salt``'s tenant; 0 without one.

        Blocks on the store (run it with ``asyncio.to_thread``); a store
        failure raises, for the caller to weigh.
        """
        connector = self._engine.kv_connector
        return connector.longest_prefix(page_hashes, cache_salt) if connector is not None else 0

    def stats(self) -> dict[str, Any]:
        """The latest load, session-hold, prefix-pin and speculation figures and recently cached page hashes (16
        hex chars each)."""
        return dict(self._stats)

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive()

    def hand_off_sessions(self, timeout_s: float) -> int:
        """After ``shutdown``: put every recorded session's cached pages in the store (``LLMEngine.hand_off_sessions``)
        on the caller's thread; 0 while the engine thread still runs (it owns the engine)."""
        if self._thread.is_alive():
            logger.warning("the engine thread is still running: sessions are not handed off")
            return 0
        return self._engine.hand_off_sessions(timeout_s)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._running = False
        self._commands.put(lambda: None)
        self._thread.join(timeout_s)

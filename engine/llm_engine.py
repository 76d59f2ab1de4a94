"""The offline engine: wires tokenizer, scheduler, KV cache, model runner, sampler.

    engine = LLMEngine.from_pretrained("tiny")
    outs = engine.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))

``step()`` advances every running request by one scheduling step and returns
the requests that progressed, so a server can stream from it.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import queue
from collections import OrderedDict
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rayturn.kernels import KernelBackend, select_backend

from .config import ModelConfig
from .kv_cache_manager import KVCacheManager, pages_for
from .kv_connector import KVConnector
from .loader import load_model, parse_dtype
from .model_runner import ModelRunner
from .outputs import CompletionOutput, RequestOutput
from .page_hash import PageHash, hash_pages
from .page_pool import Page
from .presets import PRESETS, preset_dir
from .reservations import PrefixReservations
from .sampler import compute_logprobs, sample
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerConfig
from .sequence import Sequence, SequenceStatus, TokenLogprob
from .session_holds import SessionHolds, SessionMove
from .stop import StopChecker
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Prompt = str | list[int]

CPU_KV_CACHE_BYTES = 512 << 20  # default KV budget on CPU hosts
GPU_KV_CACHE_FRACTION = 0.85  # of the memory free after loading weights
# A prewarm never takes the last free pages: this share of the pool stays free (or evictable) for arrivals.
PREWARM_FREE_FRACTION = 0.25


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    session_id: str | None = None
    stops: dict[int, StopChecker] = field(default_factory=dict)  # by seq_id

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs) and len(self.seqs) == self.params.n


class LLMEngine:
    def __init__(
        self,
        model_dir: Path,
        *,
        backend: str | KernelBackend | None = None,
        dtype: str | torch.dtype = "float32",
        page_size: int = 16,
        num_pages: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        device: str | torch.device | None = None,
        model_id: str | None = None,
        kv_connector: KVConnector | None = None,
        kv_save: str = "sync",
        kv_load_min_tokens: int = 0,
        session_hold_s: float = 30.0,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if not session_hold_s >= 0:
            raise ValueError(f"session_hold_s must be >= 0, got {session_hold_s}")
        self.device = torch.device(device) if device is not None else _default_device()
        self.backend = backend if isinstance(backend, KernelBackend) else select_backend(self.device, backend)
        self.config = ModelConfig.from_file(model_dir / "config.json")
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.dtype = parse_dtype(dtype)
        self.model = load_model(model_dir, self.config, self.backend, self.dtype, self.device)
        self.max_model_len = min(max_model_len or self.config.max_model_len, self.config.max_model_len)
        self.model_id = model_id or model_identity(model_dir)
        self.page_size = page_size
        self.num_pages = num_pages or self._default_num_pages(max_num_seqs)
        self.kv_cache = KVCacheManager(self.num_pages, page_size, self.model_id, enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens), self.kv_cache)
        self.runner = ModelRunner(self.model, self.backend, self.num_pages, page_size, self.device)
        # A finished request of a session holds its pages this long (see session_holds.py).
        self.session_hold_s = session_hold_s
        self.session_holds = SessionHolds(
            self.kv_cache.pool, ModelRunner.bytes_per_page(self.model, page_size, self.dtype)
        )
        # Queued requests keep their cached prefix referenced until admission (reservations.py).
        self.reservations = PrefixReservations(self.kv_cache.pool)
        self.kv_cache.reclaim = self._reclaim
        self.eos_token_ids = frozenset(self.config.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        )
        # Pages missing locally are loaded from here at admission; finished
        # sequences publish their full pages here (prefix caching must be on).
        self.kv_connector = kv_connector if enable_prefix_caching else None
        # Fewer missing prompt tokens than this are computed without asking the connector.
        self.kv_load_min_tokens = kv_load_min_tokens
        if kv_save not in ("sync", "async"):
            raise ValueError(f"kv_save must be 'sync' or 'async', got {kv_save!r}")
        self._saver = (
            ThreadPoolExecutor(1, thread_name_prefix="rayturn-kv-save")
            if self.kv_connector is not None and kv_save == "async"
            else None
        )
        self._saved: queue.SimpleQueue[list[Page]] = queue.SimpleQueue()
        self._stored: OrderedDict[PageHash, None] = OrderedDict()
        self._requests: dict[str, _Request] = {}
        self._finished_on_arrival: list[_Request] = []
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        logger.info(
            "rayturn engine: %s (%s), %s on %s, %d KV pages of %d tokens",
            model_dir.name,
            self.config.architecture,
            self.dtype,
            self.device,
            self.num_pages,
            page_size,
        )

    @classmethod
    def from_pretrained(
        cls,
        model: str | Path,
        backend: str | KernelBackend | None = None,
        dtype: str | torch.dtype = "float32",
        page_size: int = 16,
        num_pages: int | None = None,
        **engine_args: object,
    ) -> LLMEngine:
        """Load a built-in preset (``"tiny"``, ``"small"``) or a Hugging Face model directory."""
        if isinstance(model, str) and model in PRESETS:
            model_dir = preset_dir(model)
        else:
            model_dir = Path(model)
            if not model_dir.is_dir():
                raise ValueError(f"model {str(model)!r} is neither a preset ({', '.join(PRESETS)}) nor a directory")
        return cls(
            model_dir,
            backend=backend,
            dtype=dtype,
            page_size=page_size,
            num_pages=num_pages,
            **engine_args,  # type: ignore[arg-type]
        )

    def _default_num_pages(self, max_num_seqs: int) -> int:
        bytes_per_page = ModelRunner.bytes_per_page(self.model, self.page_size, self.dtype)
        if self.device.type == "cuda":
            free_bytes, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free_bytes * GPU_KV_CACHE_FRACTION)
        else:
            budget = CPU_KV_CACHE_BYTES
        useful = max_num_seqs * pages_for(self.max_model_len, self.page_size)
        return max(1, min(budget // bytes_per_page, useful))

    # -- requests ---------------------------------------------------------

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt, validated; raises ``ValueError`` naming what is wrong."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            vocab_size = self.config.vocab_size
            bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"prompt token ids out of vocabulary [0, {vocab_size}): {bad[:5]}")
        if not token_ids:
            raise ValueError("prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens; the model's context (max_model_len) is {self.max_model_len}, "
                "which leaves no room to generate"
            )
        return token_ids

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str = "",
        output_prefix: Seq[int] = (),
        output_prefix_logprobs: Seq[TokenLogprob] | None = None,
        session_id: str | None = None,
    ) -> str:
        """Queue a request; returns its id.

        ``output_prefix``: tokens already generated for this request elsewhere
        (a prefill server's first token): they count as output, go through
        the stop checks, and decoding continues after them.
        ``session_id``: the agent session the request belongs to; when it
        finishes, its pages are held for the session (``session_hold_s``).
        """
        params = params or SamplingParams()
        token_ids = self.encode_prompt(prompt)
        if params.n > self.scheduler.config.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={self.scheduler.config.max_num_seqs}")
        prefix = list(output_prefix)
        if prefix:
            if params.n > 1:
                raise ValueError("output_prefix cannot be combined with n > 1")
            vocab_size = self.config.vocab_size
            bad = [t for t in prefix if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"output_prefix token ids out of vocabulary [0, {vocab_size}): {bad[:5]}")
            if len(token_ids) + len(prefix) >= self.max_model_len:
                raise ValueError(
                    f"prompt plus output_prefix is {len(token_ids) + len(prefix)} tokens; "
                    f"max_model_len is {self.max_model_len}"
                )
            if output_prefix_logprobs is not None and len(output_prefix_logprobs) != len(prefix):
                raise ValueError(
                    f"output_prefix_logprobs has {len(output_prefix_logprobs)} entries for {len(prefix)} tokens"
                )
        longest = min(len(token_ids) + params.max_tokens, self.max_model_len)
        if pages_for(longest, self.page_size) * params.n > self.num_pages:
            raise ValueError(
                f"request needs up to {pages_for(longest, self.page_size) * params.n} KV pages; "
                f"the cache has {self.num_pages}"
            )
        bad_stop = [t for t in params.stop_token_ids if t >= self.config.vocab_size]
        if bad_stop:
            raise ValueError(f"stop_token_ids out of vocabulary: {bad_stop}")
        request_id = request_id if request_id is not None else str(next(self._request_ids))
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = self._new_sequence(request_id, list(token_ids), len(token_ids), params, cache_salt, 0)
        request = _Request(request_id, list(token_ids), params, [seq], session_id)
        stops = StopChecker(self.tokenizer, params, self.eos_token_ids, token_ids)
        request.stops[seq.seq_id] = stops
        self._requests[request_id] = request
        for i, token in enumerate(prefix):
            seq.token_ids.append(token)
            if params.logprobs is not None and output_prefix_logprobs is not None:
                seq.logprobs.append(output_prefix_logprobs[i])
            verdict = stops.check(seq, self.max_model_len)
            if verdict is not None:  # done before any step: report it from the next one
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason, seq.stop_reason = verdict
                seq.num_cached_prompt_tokens = 0
                self._finished_on_arrival.append(request)
                return request_id
        if self.kv_connector is not None:
            # A request arriving with output already made (a remote prefill) finds its pages in the store.
            self._load_prefix(seq, 0 if prefix else self.kv_load_min_tokens)
        self.reservations.reserve(request_id, self.kv_cache.match_prefix(seq))
        self.scheduler.add(seq)
        return request_id

    def _reclaim(self, num_pages: int) -> int:
        """Free pages for an allocation that fell short: idle sessions' holds first, queued requests' last."""
        freed = self.session_holds.reclaim(num_pages)
        if freed < num_pages:
            freed += self.reservations.reclaim(num_pages - freed)
        return freed

    def _load_prefix(self, seq: Sequence, min_tokens: int) -> None:
        """Bring the pages of ``seq``'s prefix that the connector holds and this cache lacks into the cache."""
        max_pages = (seq.num_tokens - 1) // self.page_size  # the last token is always computed
        hashes = self.kv_cache.hash_prefix(seq, max_pages * self.page_size)[:max_pages]
        # The request needs these pages now: idle sessions' holds give way, as for any allocation.
        loaded = self._load_missing(hashes, min_tokens, reclaim=True, tenant=seq.cache_salt)
        seq.num_loaded_prompt_tokens = loaded * self.page_size

    def _load_missing(
        self, hashes: list[PageHash], min_tokens: int, reclaim: bool = False, keep_free: int = 0, tenant: str = ""
    ) -> int:
        """Load ``tenant``'s pages of the prefix ``hashes`` missing here from the connector; returns how many landed.

        They enter the prefix cache as free, cached pages at the tail of the
        free queue (evicted last), so admission finds them like any other hit.
        Only as many load as there are free pages (with ``reclaim``, after idle
        sessions' holds gave way; less ``keep_free``), and none when fewer than
        ``min_tokens`` tokens are missing. A failed or partial load only means
        more tokens to compute.
        """
        assert self.kv_connector is not None
        pool = self.kv_cache.pool
        local = pool.cached_prefix(hashes)
        missing = hashes[len(local) :]
        if not missing or len(missing) * self.page_size < min_tokens:
            return 0
        try:
            available = self.kv_connector.longest_prefix(missing, tenant)
        except Exception as err:  # the store is an optimisation: never fail a request over it
            logger.warning("KV store lookup failed, computing instead: %s", err)
            return 0
        pool.touch(local)  # keep local hits from being evicted by the allocation below
        if reclaim and available > pool.num_free_pages:
            # Idle holds only: requests queued before this one keep their reservations.
            self.session_holds.reclaim(available - pool.num_free_pages)
        pages = pool.allocate(max(0, min(available, pool.num_free_pages - keep_free)))
        try:
            cache = self.runner.kv_cache
            landed = self.kv_connector.load(missing[: len(pages)], [cache[page.page_id] for page in pages], tenant)
        except Exception as err:
            logger.warning("KV store load failed, computing instead: %s", err)
            landed = [False] * len(pages)
        num_loaded = next((i for i, ok in enumerate(landed) if not ok), len(landed))
        for page, page_hash in zip(pages[:num_loaded], missing):
            pool.cache(page, page_hash)
        self._remember_stored(missing[:num_loaded])
        pool.free(reversed(pages))
        pool.free(reversed(local))
        return num_loaded

    def _save_pages(self, seq: Sequence) -> None:
        """Publish the full pages ``seq`` has computed to the connector.

        With ``kv_save="sync"`` this returns once the connector has them (a
        prefill server answers only after its pages are in the store). With
        ``"async"`` the pages are pinned (an extra reference keeps them from
        being reallocated), written by a background thread, and released by a
        later step, so a decode loop never waits on the store.
        """
        hashes = self._computed_hashes(seq)
        owner = f"request {seq.request_id}"
        self._publish(owner, hashes, seq.pages[: len(hashes)], seq.cache_salt, wait=self._saver is None)

    def _computed_hashes(self, seq: Sequence) -> list[PageHash]:
        """The hashes of the full pages among ``seq``'s computed tokens."""
        num_full = seq.num_computed_tokens // self.page_size
        return self.kv_cache.hash_prefix(seq, num_full * self.page_size)[:num_full]

    def _store_now(self, hashes: list[PageHash], pages: list[Page], tenant: str) -> tuple[int, int]:
        """Make sure the store holds these pages: (how many leading ones it holds afterwards, how many were written).

        Asks the store rather than trusting what this engine remembers giving
        it: the store evicts on its own, and a page it lacks must not leave the device.
        """
        assert self.kv_connector is not None
        self.flush_saves()
        try:
            held = self.kv_connector.longest_prefix(hashes, tenant)
        except Exception as err:  # the store is an optimisation: keep the pages instead
            logger.warning("KV store lookup failed, keeping the pages: %s", err)
            return 0, 0
        if held == len(hashes):
            return held, 0
        written = self._publish("an offload", hashes[held:], pages[held:], tenant, wait=True, resend=True)
        try:
            return self.kv_connector.longest_prefix(hashes, tenant), written
        except Exception as err:
            logger.warning("KV store lookup failed, keeping the pages: %s", err)
            return held, written

    def _publish(
        self, owner: str, hashes: list[PageHash], pages: list[Page], tenant: str, wait: bool, resend: bool = False
    ) -> int:
        """Send ``tenant``'s pages the store lacks to the connector, now or in the background; returns how many.

        ``resend``: also those this engine remembers giving the store already.
        """
        assert self.kv_connector is not None
        # Pages this engine loaded from or gave to the store are not sent again:
        # an agent's next call re-saves only the pages its turn added.
        fresh = [i for i, page_hash in enumerate(hashes) if resend or page_hash not in self._stored]
        if not fresh:
            return 0
        keys = [hashes[i] for i in fresh]
        self._remember_stored(keys)
        fresh_pages = [pages[i] for i in fresh]
        cache = self.runner.kv_cache
        views = [cache[page.page_id] for page in fresh_pages]
        if wait:
            self._save(owner, keys, views, tenant)
            return len(keys)
        assert self._saver is not None
        self.kv_cache.pool.touch(fresh_pages)
        future = self._saver.submit(self._save, owner, keys, views, tenant)
        future.add_done_callback(lambda _: self._saved.put(fresh_pages))
        return len(keys)

    def _remember_stored(self, hashes: Iterable[PageHash]) -> None:
        for page_hash in hashes:
            self._stored[page_hash] = None
            self._stored.move_to_end(page_hash)
        while len(self._stored) > 4 * self.num_pages:  # a bounded memory of what the store has
            self._stored.popitem(last=False)

    def _save(self, owner: str, keys: list[PageHash], views: list[torch.Tensor], tenant: str) -> None:
        """Write pages (on the saver thread, or inline); keys that did not make it are forgotten as stored."""
        assert self.kv_connector is not None
        try:
            landed = self.kv_connector.save(keys, views, tenant)
        except Exception as err:  # the store is an optimisation: never fail a request over it
            logger.warning("KV store save failed for %s: %s", owner, err)
            landed = [False] * len(keys)
        for key, ok in zip(keys, landed):
            if not ok:
                # dict.pop is atomic under the GIL, so the saver thread may do this beside the engine thread.
                self._stored.pop(key, None)

    def _release_saved(self) -> None:
        while True:
            try:
                pages = self._saved.get_nowait()
            except queue.Empty:
                return
            self.kv_cache.pool.free(reversed(pages))

    def flush_saves(self) -> None:
        """Wait for background page saves to finish and release their pages."""
        if self._saver is not None:
            self._saver.submit(lambda: None).result()
        self._release_saved()

    def _new_sequence(
        self, request_id: str, token_ids: list[int], num_prompt: int, params: SamplingParams, salt: str, index: int
    ) -> Sequence:
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator().manual_seed(_derive_seed(params.seed, index))
        return Sequence(
            seq_id=next(self._seq_ids),
            request_id=request_id,
            token_ids=token_ids,
            num_prompt_tokens=num_prompt,
            params=params,
            cache_salt=salt,
            generator=generator,
            completion_index=index,
        )

    def abort(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        self.reservations.release(request_id)
        # Finished before any step: nothing left to report.
        self._finished_on_arrival = [r for r in self._finished_on_arrival if r is not request]
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def load_stats(self) -> dict[str, int]:
        """What a router weighs: queued prompt tokens, running sequences, free and total pages."""
        waiting = self.scheduler.waiting
        running = self.scheduler.running
        return {
            "queued_prompt_tokens": sum(seq.num_tokens - seq.num_computed_tokens for seq in waiting)
            + sum(max(seq.num_prompt_tokens - seq.num_computed_tokens, 0) for seq in running),
            "running_seqs": len(running),
            "waiting_seqs": len(waiting),
            "max_num_seqs": self.scheduler.config.max_num_seqs,
            "free_pages": self.kv_cache.num_free_pages,
            "total_pages": self.num_pages,
        }

    def prefix_residency(self, token_ids: Seq[int], cache_salt: str = "") -> tuple[list[PageHash], int]:
        """A prompt's page hashes (all but the always-computed last token) and how many lead pages are here.

        Only reads the prefix cache, so a server may call it beside the thread
        that steps the engine; the count is then an estimate.
        """
        usable = (len(token_ids) - 1) // self.page_size
        hashes = hash_pages(list(token_ids[: usable * self.page_size]), self.page_size, self.model_id, cache_salt)
        return hashes, len(self.kv_cache.pool.cached_prefix(hashes))

    def cached_page_hashes(self, limit: int) -> list[PageHash]:
        """Up to ``limit`` page hashes this engine holds, most recently cached last."""
        return self.kv_cache.pool.recent_hashes(limit)

    # -- session holds (the logic lives in session_holds.py) ---------------

    def hold_session(self, session_id: str, ttl_s: float, kind: str = "tool") -> int:
        """Hold the leading recorded pages of a session cached here for ``ttl_s``; returns how many."""
        return self.session_holds.hold(session_id, ttl_s, kind)

    def release_session(self, session_id: str) -> int:
        """Drop a session's hold (its pages stay cached, evictable); returns the pages released."""
        return self.session_holds.release(session_id)

    def offload_session(self, session_id: str) -> SessionMove:
        """Make sure the store has a session's cached pages, then evict those nobody else references."""
        self._require_connector("offload_session")
        return self.session_holds.offload(session_id, self._store_now)

    def prewarm_session(self, session_id: str, ttl_s: float, announced: bool = False) -> SessionMove:
        """Load a session's pages missing here from the store, then hold its cached prefix for ``ttl_s``.

        ``announced``: the client said the session's call is coming, so the
        pages load as for an arrived call (idle sessions' holds give way) and
        are held as for a tool wait.
        """
        self._require_connector("prewarm_session")
        # An unannounced prewarm is a guess: it leaves a share of the pool free for calls that have arrived.
        keep_free = 0 if announced else int(self.num_pages * PREWARM_FREE_FRACTION)
        return self.session_holds.prewarm(
            session_id,
            ttl_s,
            lambda hashes, tenant: self._load_missing(hashes, 0, reclaim=announced, keep_free=keep_free, tenant=tenant),
            kind="tool" if announced else "prewarm",
        )

    def session_residency(self, session_id: str) -> tuple[int, int]:
        """(leading recorded pages of a session cached here now, recorded pages)."""
        return self.session_holds.residency(session_id)

    def session_stats(self) -> dict[str, int]:
        return {**self.session_holds.stats(), **self.reservations.stats()}

    def expire_holds(self) -> int:
        """Release the session holds whose TTL has passed; returns how many."""
        return self.session_holds.expire()

    def _require_connector(self, method: str) -> None:
        if self.kv_connector is None:
            raise ValueError(f"{method} needs a kv_connector (and prefix caching on)")

    # -- the loop ---------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns the requests it advanced (finished ones last seen here)."""
        self._release_saved()
        self.session_holds.expire()
        arrived = [self._output(request) for request in self._finished_on_arrival]
        for output in arrived:
            del self._requests[output.request_id]
        self._finished_on_arrival.clear()
        scheduled = self.scheduler.schedule()
        if self.reservations:
            for chunk in scheduled.chunks:  # admitted: the sequence's own references take over
                self.reservations.release(chunk.seq.request_id)
        if not scheduled.chunks:
            return arrived
        self.runner.apply_page_copies(self.kv_cache.pending_copies)
        self.kv_cache.pending_copies.clear()
        sampled, logits = self.runner.run(scheduled.chunks)
        for chunk in scheduled.chunks:
            chunk.seq.num_computed_tokens += chunk.num_tokens
        if not sampled:  # only mid-prompt chunks ran
            return arrived
        seqs = [chunk.seq for chunk in sampled]
        rows = list(range(len(seqs)))
        for row, seq in enumerate(list(seqs)):
            request = self._requests[seq.request_id]
            if seq.num_output_tokens == 0 and len(request.seqs) < request.params.n:
                for child in self._fork(request, seq):
                    seqs.append(child)
                    rows.append(row)
        if len(rows) != logits.shape[0]:
            logits = logits[torch.tensor(rows, device=logits.device)]
        tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
        wants_logprobs = [s.params.logprobs is not None for s in seqs]
        logprobs = (
            compute_logprobs(logits, tokens, [s.params.logprobs or 0 for s in seqs]) if any(wants_logprobs) else None
        )
        touched: dict[str, _Request] = {}
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            seq.token_ids.append(token)
            if logprobs is not None and wants_logprobs[i]:
                seq.logprobs.append(logprobs[i])
            request = self._requests[seq.request_id]
            verdict = request.stops[seq.seq_id].check(seq, self.max_model_len)
            if verdict is not None:
                if self.kv_connector is not None:
                    self._save_pages(seq)
                if request.session_id is not None and seq.completion_index == 0:
                    # Held before the sequence frees its pages, so none is evictable in between.
                    hashes = self._computed_hashes(seq)
                    self.session_holds.record(request.session_id, hashes, self.session_hold_s, seq.cache_salt)
                self.scheduler.finish(seq, *verdict)
            touched[request.request_id] = request
        outputs = [self._output(request) for request in touched.values()]
        for output in outputs:
            if output.finished:
                del self._requests[output.request_id]
        return arrived + outputs

    def _fork(self, request: _Request, parent: Sequence) -> list[Sequence]:
        children = []
        for index in range(len(request.seqs), request.params.n):
            child = self._new_sequence(
                request.request_id,
                list(parent.token_ids),
                parent.num_prompt_tokens,
                request.params,
                parent.cache_salt,
                index,
            )
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_prompt_tokens = parent.num_cached_prompt_tokens
            self.kv_cache.fork(parent, child)
            self.scheduler.add_running(child)
            request.seqs.append(child)
            request.stops[child.seq_id] = StopChecker(
                self.tokenizer, request.params, self.eos_token_ids, request.prompt_token_ids
            )
            children.append(child)
        return children

    def _output(self, request: _Request) -> RequestOutput:
        completions = tuple(
            CompletionOutput(
                index=seq.completion_index,
                token_ids=seq.output_token_ids,
                text=request.stops[seq.seq_id].text,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                logprobs=tuple(seq.logprobs) if request.params.logprobs is not None else None,
            )
            for seq in request.seqs
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            num_cached_prompt_tokens=request.seqs[0].num_cached_prompt_tokens or 0,
            completions=completions,
            finished=request.finished,
            num_loaded_prompt_tokens=min(
                request.seqs[0].num_loaded_prompt_tokens, request.seqs[0].num_cached_prompt_tokens or 0
            ),
        )

    def generate(
        self,
        prompts: Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; one output per prompt, in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise ValueError("prompts must be a list of prompts (strings or token id lists), not a single prompt")
        per_prompt = [params or SamplingParams()] * len(prompts) if not isinstance(params, Seq) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        token_ids = [self.encode_prompt(prompt) for prompt in prompts]  # validate all before admitting any
        ids = [self.add_request(prompt_ids, p) for prompt_ids, p in zip(token_ids, per_prompt)]
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(ids):
            for output in self.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[request_id] for request_id in ids]


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def model_identity(model_dir: Path) -> str:
    """A name for the weights that is the same on every node: folder name + config digest."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()[:16]
    return f"{model_dir.name}@{digest}"


def _derive_seed(seed: int, completion_index: int) -> int:
    raw = hashlib.sha256(f"{seed}/{completion_index}".encode()).digest()
    return int.from_bytes(raw[:8], "little") & ((1 << 63) - 1)

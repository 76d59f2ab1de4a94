"""The offline engine: wires tokenizer, scheduler, KV cache, model runner, sampler.

    engine = LLMEngine.from_pretrained("tiny")
    outs = engine.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))

``step()`` advances every running request by one scheduling step and returns
the requests that progressed, so a server can stream from it. The pieces:
``RequestLimits`` checks a request, ``RequestTable`` keeps requests, forks
and outputs, ``Scheduler`` picks the chunks, ``KVCacheManager`` maps them to
pages, ``ModelRunner`` runs them, ``sample_sequences`` samples,
``KVTransfer`` moves pages to and from the KV store, and ``SessionHolds``,
``PrefixReservations`` and ``PrefixPins`` keep pages for sessions, queued
requests and retention contracts, and the ``Drafter`` proposes draft tokens
that a step verifies several at a time (``speculative/``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from rayturn.kernels import KernelBackend, select_backend

from . import kv_transfer
from .config import ModelConfig
from .energy import EnergyLedger
from .generation_config import end_of_turn_ids
from .kv_budget import kv_sizes
from .kv_cache_manager import KVCacheManager
from .kv_connector import KVConnector
from .kv_transfer import KVTransfer, check_kv_save
from .loader import load_model, parse_dtype
from .model_runner import ModelRunner
from .outputs import RequestOutput
from .page_hash import PageHash
from .prefix_pins import PrefixPins, Retention, reclaim_in_order
from .presets import resolve_model_dir
from .priority import Priority, resolve_priority
from .request import Request, RequestTable
from .request_limits import Prompt, RequestLimits
from .reservations import PrefixReservations
from .sampler import sample_sequences
from .sampling_params import SamplingParams
from .scheduler import ScheduledChunk, Scheduler, SchedulerConfig, prefill_cap
from .sequence import Sequence, TokenLogprob
from .session_holds import SessionHolds, SessionMove
from .speculative import Drafter, SpeculativeConfig, split_verified, verify_drafts
from .stop import Verdict
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)


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
        max_prefill_tokens_while_decoding: int | None = None,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        device: str | torch.device | None = None,
        model_id: str | None = None,
        kv_connector: KVConnector | None = None,
        kv_save: str = "sync",
        kv_load_min_tokens: int = 0,
        session_hold_s: float = 30.0,
        speculative: SpeculativeConfig | None = None,
        num_window_slots: int | None = None,
        enforce_eager: bool = False,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if not session_hold_s >= 0:
            raise ValueError(f"session_hold_s must be >= 0, got {session_hold_s}")
        self.device = torch.device(device) if device is not None else _default_device()
        self.backend = backend if isinstance(backend, KernelBackend) else select_backend(self.device, backend)
        self.config = ModelConfig.from_file(model_dir / "config.json")
        self.max_model_len = self.config.check_max_model_len(max_model_len)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.dtype = parse_dtype(dtype)
        self.model = load_model(model_dir, self.config, self.backend, self.dtype, self.device)
        self.model_id = model_id or model_identity(model_dir)
        self.page_size = page_size
        # Sliding-window layers keep only their window, in slots of their own (window_slots.py).
        self.num_pages, window_slots = kv_sizes(
            self.model, self.dtype, self.device, page_size, num_pages, num_window_slots, max_num_seqs,
            max_num_batched_tokens, self.max_model_len,
        )  # fmt: skip
        self.kv_cache = KVCacheManager(self.num_pages, page_size, self.model_id, enable_prefix_caching, window_slots)
        self.drafter = Drafter(speculative or SpeculativeConfig(), self.max_model_len)
        cap = prefill_cap(max_prefill_tokens_while_decoding, self.device.type)
        scheduler_config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_prefill_tokens_while_decoding=cap)
        self.scheduler = Scheduler(scheduler_config, self.kv_cache, self.drafter.propose)
        slots = window_slots.num_slots if window_slots is not None else 0
        self.runner = ModelRunner(self.model, self.backend, self.num_pages, page_size, self.device, slots)
        self.enforce_eager = enforce_eager  # no decode graphs, even where the backend could replay them
        # A finished request of a session holds its pages this long (see session_holds.py).
        self.session_hold_s = session_hold_s
        self.session_holds = SessionHolds(
            self.kv_cache.pool, ModelRunner.bytes_per_page(self.model, page_size, self.dtype)
        )
        # Queued requests keep their cached prefix referenced until admission (reservations.py).
        self.reservations = PrefixReservations(self.kv_cache.pool)
        self.eos_token_ids = end_of_turn_ids(self.config.eos_token_ids, self.tokenizer.eos_token_id, model_dir)
        # Pages missing locally are loaded from here at admission; finished
        # sequences publish their full pages here (prefix caching must be on).
        self.kv_connector = kv_connector if enable_prefix_caching else None
        # Fewer missing prompt tokens than this are computed without asking the connector.
        self.kv_load_min_tokens = kv_load_min_tokens
        check_kv_save(kv_save)
        self.kv_transfer = (
            KVTransfer(self.kv_connector, self.kv_cache, self.runner.page_views, self.session_holds.reclaim, kv_save)
            if self.kv_connector is not None
            else None
        )
        # Retention contracts (prefix_pins.py). Pressure frees: idle holds, pins the store takes, reservations, any pin.
        self.prefix_pins = PrefixPins(self.kv_cache.pool, page_size, self.kv_transfer)
        reclaimers = (self.session_holds.reclaim, self.prefix_pins.move_to_store, self.reservations.reclaim)
        self.kv_cache.reclaim = functools.partial(reclaim_in_order, (*reclaimers, self.prefix_pins.reclaim))
        self.limits = RequestLimits(
            self.tokenizer, self.config.vocab_size, self.max_model_len, max_num_seqs, self.num_pages, page_size
        )
        self.requests = RequestTable(self.tokenizer, self.eos_token_ids, self.limits)
        self.energy = EnergyLedger.for_device(self.device, page_size, moves_pages=self.kv_connector is not None)
        info = (model_dir.name, self.config.architecture, self.dtype, self.device, self.num_pages, page_size)
        logger.info("rayturn engine: %s (%s), %s on %s, %d KV pages of %d tokens", *info)

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
        """Load a built-in preset (``"tiny"``, ``"small"``, ``"tiny-bpe"``) or a Hugging Face model directory."""
        return cls(
            resolve_model_dir(model),
            backend=backend,
            dtype=dtype,
            page_size=page_size,
            num_pages=num_pages,
            **engine_args,  # type: ignore[arg-type]
        )

    # -- requests ---------------------------------------------------------

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str = "",
        output_prefix: Seq[int] = (),
        output_prefix_logprobs: Seq[TokenLogprob] | None = None,
        session_id: str | None = None,
        page_hashes: Seq[PageHash] | None = None,
        retention: Retention | None = None,
        continues_turn: bool = False,
        priority: Priority | str | None = None,
    ) -> str:
        """Queue a request; returns its id.

        ``output_prefix``: tokens already generated for this request elsewhere
        (a prefill server's first token): they count as output, go through
        the stop checks, and decoding continues after them.
        ``session_id``: the agent session the request belongs to; when it
        finishes, its pages are held for the session (``session_hold_s``).
        ``page_hashes``: the chained hashes (``page_hash.hash_pages`` with this
        engine's model id and ``cache_salt``) of the prompt's first
        ``len(page_hashes)`` full pages, computed by the serving layer's own
        code: they are trusted as given and never recomputed here, so they
        must not come from a client (a wrong hash would file KV under another
        prompt's name).
        ``retention``: keep the prompt's first pages cached after it finishes (``prefix_pins.py``).
        ``priority``: the request's class (``priority.py``); without one, a call that ``continues_turn`` (a
        tool's result) is a continuation, admitted before the new turns waiting (``scheduler.py``).
        """
        request_class = resolve_priority(priority, continues_turn)  # ValueError before anything is queued
        request = self.requests.open(
            self.limits.encode_prompt(prompt),
            params or SamplingParams(),
            request_id=request_id,
            cache_salt=cache_salt,
            session_id=session_id,
            output_prefix=list(output_prefix),
            output_prefix_logprobs=output_prefix_logprobs,
            page_hashes=page_hashes or (),
        )
        if request.finished:  # the output prefix did it: reported by the next step
            return request.request_id
        self.energy.open(request.request_id, session_id)
        self.prefix_pins.expect(request.request_id, retention)
        seq = request.seqs[0]
        seq.priority = request_class
        self.drafter.start(seq, session_id)
        if self.kv_transfer is not None:
            # A request arriving with output already made (a remote prefill) finds its pages in the store.
            self.kv_transfer.load_prefix(seq, 0 if output_prefix else self.kv_load_min_tokens)
        self.reservations.reserve(request.request_id, self.kv_cache.match_prefix(seq))
        self.scheduler.add(seq)
        return request.request_id

    def flush_saves(self) -> None:
        """Wait for background page saves to finish and release their pages."""
        if self.kv_transfer is not None:
            self.kv_transfer.flush()

    def abort(self, request_id: str) -> None:
        request = self.requests.pop(request_id)
        if request is None:
            return
        self.reservations.release(request_id)
        self.prefix_pins.forget(request_id)
        self.energy.close(request_id)
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def bytes_per_page(self) -> int:
        """The size of one KV page in the cache (all layers, keys and values)."""
        return ModelRunner.bytes_per_page(self.model, self.page_size, self.dtype)

    def load_stats(self) -> dict[str, int]:
        """What a router weighs: queued prompt tokens, running sequences, free and total pages."""
        return self.scheduler.load_stats()

    def prefix_residency(
        self, token_ids: Seq[int], cache_salt: str = "", page_hashes: Seq[PageHash] | None = None
    ) -> tuple[list[PageHash], int]:
        """A prompt's page hashes and how many lead pages are here (``KVCacheManager.prefix_residency``)."""
        return self.kv_cache.prefix_residency(token_ids, cache_salt, page_hashes or ())

    def cached_page_hashes(self, limit: int) -> list[PageHash]:
        """Up to ``limit`` page hashes this engine holds, most recently cached last."""
        return self.kv_cache.pool.recent_hashes(limit)

    # -- session holds (session_holds.py; their moves through the store: kv_transfer.py) --

    def hold_session(self, session_id: str, ttl_s: float, kind: str = "tool") -> int:
        """Hold the leading recorded pages of a session cached here for ``ttl_s``; returns how many."""
        return self.session_holds.hold(session_id, ttl_s, kind)

    def release_session(self, session_id: str) -> int:
        """Drop a session's hold (its pages stay cached, evictable); returns the pages released."""
        return self.session_holds.release(session_id)

    def offload_session(self, session_id: str) -> SessionMove:
        """Make sure the store has a session's cached pages, then evict those nobody else references."""
        return kv_transfer.offload_session(self.session_holds, self.kv_transfer, session_id)

    def prewarm_session(self, session_id: str, ttl_s: float, announced: bool = False) -> SessionMove:
        """Load a session's pages missing here from the store, then hold them (``kv_transfer.prewarm_session``)."""
        return kv_transfer.prewarm_session(self.session_holds, self.kv_transfer, session_id, ttl_s, announced)

    def hand_off_sessions(self, timeout_s: float) -> int:
        """Put every recorded session's cached pages in the store, for an engine about to stop; returns how many."""
        return kv_transfer.hand_off_sessions(self.session_holds, self.kv_transfer, timeout_s)

    def session_residency(self, session_id: str) -> tuple[int, int]:
        """(leading recorded pages of a session cached here now, recorded pages)."""
        return self.session_holds.residency(session_id)

    def session_stats(self) -> dict[str, int]:
        return {**self.session_holds.stats(), **self.reservations.stats()}

    def expire_holds(self) -> int:
        """Release the session holds and prefix pins whose TTL has passed; returns how many."""
        return self.session_holds.expire() + self.prefix_pins.expire()

    # -- the loop ---------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns the requests it advanced (finished ones last seen here)."""
        if self.kv_transfer is not None:
            self.kv_transfer.release_saved()
        self.expire_holds()
        arrived = self.energy.annotate(self.requests.take_arrived())
        chunks = self.scheduler.schedule().chunks
        if not chunks:
            return arrived
        sampled, logits = self._run(chunks)
        if not sampled:  # only mid-prompt chunks ran
            return arrived
        if self.kv_transfer is not None:
            self.kv_transfer.save_prompts(sampled)
        sampled, logits, verified = split_verified(sampled, logits)  # decodes that ran a draft: verified apart
        verified_outputs = verify_drafts(verified, self.drafter, self.requests, self.kv_cache, self._on_stop)
        seqs, rows = self.requests.fork_fresh([chunk.seq for chunk in sampled], self._start_fork)
        if len(rows) != logits.shape[0]:
            logits = logits[torch.tensor(rows, device=logits.device)]
        tokens, logprobs = sample_sequences(logits, seqs, self.eos_token_ids)
        sampled_outputs = verified_outputs + self.requests.append_samples(seqs, tokens, logprobs, self._on_stop)
        return arrived + self.energy.annotate(sampled_outputs)

    def _run(self, chunks: list[ScheduledChunk]) -> tuple[list[ScheduledChunk], torch.Tensor]:
        """Run the model over the scheduled chunks; returns those that sample, and their logits."""
        if self.reservations:
            for chunk in chunks:  # admitted: the sequence's own references take over
                self.reservations.release(chunk.seq.request_id)
        self.runner.apply_page_copies(*self.kv_cache.take_copies())
        with self.energy.step(chunks):
            out = self.runner.run(chunks)
        for chunk in chunks:
            chunk.seq.num_computed_tokens += chunk.num_tokens
        for scores in out.prompt_scores:
            scores.record()
        return out.sampled, out.logits

    def _start_fork(self, parent: Sequence, child: Sequence) -> None:
        self.kv_cache.fork(parent, child)
        self.scheduler.add_running(child)

    def _on_stop(self, request: Request, seq: Sequence, verdict: Verdict) -> None:
        if self.kv_transfer is not None:
            self.kv_transfer.save_pages(seq)
        # Held and pinned before the sequence frees its pages, so none is evictable in between.
        hashes = self.kv_cache.computed_hashes(seq)
        if request.session_id is not None and seq.completion_index == 0:
            self.session_holds.record(request.session_id, hashes, self.session_hold_s, seq.cache_salt)
        self.prefix_pins.finish(request.request_id, hashes, seq.num_prompt_tokens, seq.cache_salt)
        self.drafter.finish(seq)
        self.scheduler.finish(seq, *verdict)

    def generate(
        self,
        prompts: Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; one output per prompt, in order."""
        ids = [self.add_request(prompt_ids, p) for prompt_ids, p in self.limits.encode_batch(prompts, params)]
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

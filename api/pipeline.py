"""The call pipeline HTTP and gRPC share: caller -> prompt -> routing hints -> decode pool -> steps.

    caller's key --> tenant (or 401 / UNAUTHENTICATED), and its calls' default class (``priority``)
    body/messages --> prompt token ids       (bounded, off the event loop when large: request_limits)
    token ids ------> serve request          (page hashes computed once, salted by the tenant)
    serve request --> decode pool            (KV-aware routing on those hashes)
    per-step deltas --> folded into a CallResult as they pass to the API's own stream
    a dead replica ---> the call sent again, resumed on another, or a retryable error (resume)
    a full replica ---> the call sent to one that has not refused it, or 429 (resume)

The API modules own their wire formats; this module owns all in between: a call costs the same through every door.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any

from rayturn.engine.config import ModelConfig
from rayturn.engine.llm_engine import model_identity
from rayturn.engine.page_hash import PageHash, hash_pages
from rayturn.engine.prefix_pins import Retention
from rayturn.engine.presets import resolve_model_dir
from rayturn.engine.sampling_params import SamplingParams
from rayturn.engine.token_bytes import TokenBytes
from rayturn.engine.tokenizer import Tokenizer
from rayturn.engine.tool_calls import parser_for_chat_template
from rayturn.messages import Call, CallKind, Delta, PrewarmAnswer, SessionAnnouncement, Step
from rayturn.router.replica_stats import page_hash_key
from rayturn.router.request_router import serve_replica_id

from .bodies import splits_answer
from .call_result import CallResult
from .chat_prompt import render_chat, retained_prefix
from .energy import EnergyAccounts
from .errors import client_error, invalid_request, replica_unavailable, server_error
from .guides import GuideMaker
from .metrics import IngressMetrics
from .pool_health import PoolHealthProbe, cluster_health
from .protocol import JSON, ChatRequest, SamplingSpec, to_sampling_params
from .request_limits import PromptBudget, off_loop
from .resume import CallResumer, capacity_refusal, replica_died
from .session import LifecycleHints, classify_call
from .settings import IngressSettings
from .tenants import presented_key
from .thinking_fields import chat_reasoning
from .truncation import MESSAGES, fit_messages

NO_HINTS = LifecycleHints()
# Tool-call formats whose argument values are typed by the tool's schema (the decode replica parses them).
SCHEMA_TYPED_PARSERS = ("qwen3_coder",)
# The finish of a sequence whose guide refused a token (``rayturn.engine.guided``).
GUIDE_BROKEN = "abort"
Steps = AsyncIterator[tuple[Delta, ...]]


NO_STEP = object()


async def first_step(steps: Steps, request_id: str = "") -> Any:
    """The first step of a call, so failures before any token become API errors, not broken streams."""
    try:
        return await anext(steps)
    except StopAsyncIteration:
        return NO_STEP
    except Exception as err:
        raise client_error(err, request_id) from err


async def announced(answer: Awaitable[PrewarmAnswer], request_id: str = "") -> PrewarmAnswer:
    """A decode replica's answer to an announcement; a full queue is a 429, a failed replica a 503."""
    try:
        return await answer
    except Exception as err:  # the announcement is lost, nothing else: the call itself still comes
        raise client_error(err, request_id) from err


def new_request_id() -> str:
    """A call's id, minted when it arrives: its steps, its errors and its log lines carry it."""
    return uuid.uuid4().hex


def check_vocabulary(prompt_ids: Sequence[int], vocab_size: int, param: str) -> None:
    """A 400 naming ``param`` when the prompt is empty or holds ids outside the vocabulary."""
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if not prompt_ids or bad:
        problem = f"token ids out of vocabulary [0, {vocab_size}): {bad[:5]}" if bad else "it is empty"
        raise invalid_request(f"Invalid '{param}': {problem}.", param=param)


async def chain_steps(first: Any, steps: Steps) -> Steps:
    if first is not NO_STEP:
        yield first
        async for step in steps:
            yield step


class CallPipeline:
    """One ingress replica's model, keys and pool handles, and the steps every call takes through them."""

    def __init__(self, decode: Any, prefill: Any, store_nodes: Any, settings: IngressSettings) -> None:
        self.decode = decode
        self.prefill = prefill
        self.store_nodes = store_nodes
        model = settings.model
        model_dir = resolve_model_dir(model)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.token_bytes = TokenBytes(self.tokenizer.backend)
        self.model_root = model
        model_config = ModelConfig.from_file(model_dir / "config.json")
        self.max_model_len = model_config.check_max_model_len(settings.max_model_len)
        self.vocab_size = model_config.vocab_size
        self.model_id = model_identity(model_dir)
        self.page_size = settings.page_size
        self.served_model = settings.served_model_name
        self.keys = settings.keys
        self.max_request_bytes = settings.max_request_bytes
        self.budget = PromptBudget(self.max_model_len, self.tokenizer.max_token_chars)
        template = self.tokenizer.chat_template
        parser = settings.tool_call_parser or parser_for_chat_template(template.source if template else "")
        self.guides = GuideMaker(parser, self.tokenizer)
        self.reasoning_parser = settings.reasoning_parser
        self.health_probe = PoolHealthProbe(settings.app_name, settings.pools)
        self.telemetry = IngressMetrics(serve_replica_id())
        self.energy = EnergyAccounts(self.telemetry.energy_joules)

    # -- the caller -------------------------------------------------------

    def tenant(self, credentials: Mapping[str, str] | Iterable[tuple[str, str | bytes]]) -> str | None:
        """The tenant of a caller's headers (or gRPC metadata); None when keys are on and none is valid."""
        return self.keys.tenant_of(presented_key(credentials))

    # -- prompts ----------------------------------------------------------

    async def chat_prompt(self, chat: ChatRequest, num_bytes: int) -> list[int]:
        """Render and tokenize a chat (in a worker thread when its body was large), cut as its ``truncation``
        asks (``rayturn.api.truncation``); without one a 400 when it cannot fit."""
        truncation = chat.sampling.truncation

        def encode(messages: list[JSON]) -> list[int]:
            text = render_chat(
                self.tokenizer,
                messages,
                chat.prompt_tools,
                chat.template_kwargs,
                continue_final_message=chat.continue_final_message,
            )
            if truncation is None:  # a cut prompt may be longer than the context: the body's size bounds it
                self.budget.check(text, param="messages")
            return self.tokenizer.encode(text, add_special_tokens=False)

        if truncation is None:
            return await off_loop(num_bytes, lambda: encode(chat.messages))
        limit = truncation.limit(self.max_model_len, chat.sampling.max_tokens)
        if truncation.side == MESSAGES:
            return await off_loop(num_bytes, lambda: fit_messages(chat.messages, encode, limit))
        return truncation.tokens(await off_loop(num_bytes, lambda: encode(chat.messages)), limit)

    async def retention(self, chat: ChatRequest, prompt_ids: Sequence[int]) -> Retention | None:
        """The retention contract of a chat's cache breakpoints (``chat_prompt.retained_prefix``), off the loop
        when the prompt is long."""
        return await off_loop(len(prompt_ids) * 4, lambda: retained_prefix(self.tokenizer, chat, prompt_ids))

    async def text_prompt(self, text: str, *, param: str, checked: bool = True) -> list[int]:
        """Tokenize a raw prompt (off the loop when long); 400 when it cannot fit, before tokenizing it (unless
        not ``checked``: a prompt to be cut)."""
        if checked:
            self.budget.check(text, param=param)
        return await off_loop(len(text), lambda: self.tokenizer.encode(text))

    async def raw_prompt(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingSpec,
        *,
        param: str,
        default_max_tokens: int,
        max_tokens_param: str = "max_tokens",
    ) -> tuple[list[int], SamplingParams]:
        """A text or token-id prompt (no chat template), cut as its ``truncation`` asks: its ids and sampling; a 400
        naming ``param`` if unusable."""
        prompt_ids = await self.raw_prompt_ids(prompt, sampling, param=param)
        # The length first: a prompt of a million ids is refused without walking them.
        params = to_sampling_params(
            sampling,
            default_max_tokens=default_max_tokens,
            prompt_tokens=len(prompt_ids),
            max_model_len=self.max_model_len,
            prompt_param=param,
            max_tokens_param=max_tokens_param,
            vocab_size=self.vocab_size,
            encode=partial(self.tokenizer.encode, add_special_tokens=False),
        )
        check_vocabulary(prompt_ids, self.vocab_size, param)
        return prompt_ids, params

    async def raw_prompt_ids(self, prompt: str | Sequence[int], sampling: SamplingSpec, *, param: str) -> list[int]:
        """A text or token-id prompt's ids (no chat template), cut as its ``truncation`` asks."""
        cut = sampling.truncation
        if isinstance(prompt, str):
            prompt_ids = await self.text_prompt(prompt, param=param, checked=cut is None)
        else:
            prompt_ids = list(prompt)
        return prompt_ids if cut is None else cut.tokens(prompt_ids, cut.limit(self.max_model_len, sampling.max_tokens))

    # -- the call ---------------------------------------------------------

    async def serve_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        tenant: str,
        session_id: str | None,
        hints: LifecycleHints = NO_HINTS,
        tools: bool = False,
        retention: Retention | None = None,
        tool_specs: Sequence[Mapping[str, Any]] = (),
        priority: str | None = None,
        reasoning: str | None = None,
        cache_salt: str | None = None,
    ) -> Call:
        """What the decode pool receives; the page hashes (salted: ``KeyTable.cache_salt``) are computed once, here."""
        salt = self.keys.cache_salt(tenant, cache_salt)
        usable = (len(prompt_ids) - 1) // self.page_size

        def hashed() -> tuple[tuple[PageHash, ...], tuple[str, ...]]:
            hashes = tuple(hash_pages(prompt_ids[: usable * self.page_size], self.page_size, self.model_id, salt))
            return hashes, tuple(page_hash_key(page_hash) for page_hash in hashes)

        hashes, keys = await off_loop(usable * 64, hashed)
        return Call(
            request_id=request_id,
            prompt_token_ids=tuple(prompt_ids),
            params=params,
            cache_salt=salt,
            session_id=self.keys.session(tenant, session_id),
            page_hashes=hashes,
            page_keys=keys,
            call=hints.call,
            after=hints.after,
            tools=tools,
            retention=retention,
            tool_specs=tuple(tool_specs),
            reasoning=reasoning,
            priority=priority or self.keys.default_priority(tenant),  # asked for, else the key's; None: by kind
        )

    async def chat_call(
        self,
        request_id: str,
        tenant: str,
        chat: ChatRequest,
        num_bytes: int,
        session_id: str | None,
        said: LifecycleHints,
        *,
        max_tokens: int | None = None,
        call: CallKind | None = None,
        prompt_param: str = "messages",
        max_tokens_param: str = "max_tokens",
        priority: str | None = None,
    ) -> Call:
        """A chat-shaped call of any API: the template and tokens, sampling (``max_tokens``: the most a request
        that names no ``chat.sampling.max_tokens`` may write, capped by the room left), the guide it asks for, its
        retention contract. Its kind: the caller's (``said``), else the API's (``call``), else its messages'. Its
        class: ``priority`` (what the caller asked for), else its key's default, else (None) by its kind."""
        prompt_ids = await self.chat_prompt(chat, num_bytes)
        params = to_sampling_params(
            chat.sampling,
            default_max_tokens=max_tokens or self.max_model_len,
            prompt_tokens=len(prompt_ids),
            max_model_len=self.max_model_len,
            prompt_param=prompt_param,
            max_tokens_param=max_tokens_param,
            vocab_size=self.vocab_size,
            encode=partial(self.tokenizer.encode, add_special_tokens=False),
        )
        reasoning, params = chat_reasoning(self.reasoning_parser, chat, self.guides.guided(params, chat))
        retention = await self.retention(chat, prompt_ids)
        hints = LifecycleHints(said.call or call or classify_call(chat.messages), said.after)
        tools = splits_answer(chat, self.guides.parser, reasoning)
        # Formats that type argument values by schema need the tools on the decode replica too.
        specs = chat.prompt_tools if self.guides.parser in SCHEMA_TYPED_PARSERS else None
        return await self.serve_request(
            request_id,
            prompt_ids,
            params,
            tenant,
            session_id,
            hints,
            tools,
            retention,
            specs or (),
            priority,
            reasoning,
            chat.cache_salt,
        )

    async def start(self, call: Call) -> tuple[CallResult, Steps, Any]:
        """Send a call to the decode pool; its result, its steps and its first step (API errors before it)."""
        result = CallResult(
            completions={},
            request_id=call.request_id,
            count_tokens=self.tokenizer.count_tokens,
            reasoning=call.reasoning,
            prompt_token_ids=call.prompt_token_ids,
        )
        steps = self._steps(call, result)
        return result, steps, await first_step(steps, call.request_id)

    async def _steps(self, call: Call, result: CallResult) -> Steps:
        """The decode pool's per-step deltas, folded into ``result`` as they pass; a replica that dies mid-call
        is replaced (``resume``): the call is sent again or resumed on another, or ends with a retryable error."""
        start = time.perf_counter()
        last = start
        first = True
        resumer = CallResumer(call)
        sent = call
        generator = None
        done = False
        try:
            while True:
                generator = self.decode.generate.options(stream=True).remote(sent)
                try:
                    async for step in generator:
                        assert isinstance(step, Step)
                        now = time.perf_counter()
                        if first:
                            self.telemetry.ttft.labels(step.path).observe(now - start)
                            first = False
                        else:
                            self.telemetry.itl.observe(now - last)
                        last = now
                        self._fold(call, step, result)
                        if step.finished:  # settled before the API sees the last step: its usage has the session's
                            await self.energy.settle(call.session_id, result)
                        for delta in step.deltas:
                            resumer.record(delta.index, delta.text)
                        yield step.deltas
                    done = True
                    return
                except Exception as err:
                    generator.cancel()
                    refusal = capacity_refusal(err)
                    if refusal is not None and not result.completions:
                        sent_elsewhere = resumer.after_refusal(refusal, sent)
                        if sent_elsewhere is None:
                            raise
                        sent = sent_elsewhere
                        continue
                    if not replica_died(err):
                        raise
                    loss = resumer.after_death(err, result)
                    self.telemetry.replica_losses.labels(loss.outcome).inc()
                    if loss.outcome == "failed":
                        raise replica_unavailable() from err
                    if loss.call is None:
                        done = True
                        return
                    sent = loss.call
                    result.send_again()
        finally:
            if not done and generator is not None:
                generator.cancel()
            self.telemetry.e2e.observe(time.perf_counter() - start)
            self.telemetry.count_tokens(result)
            if done:  # answered whole (its last step, or the steps a dead replica had sent all)
                await self.energy.settle(call.session_id, result)
            else:
                self.energy.settle_unanswered(call.session_id, result)

    def _fold(self, call: Call, step: Step, result: CallResult) -> None:
        if any(delta.finish_reason == GUIDE_BROKEN for delta in step.deltas):
            # The engine met a token its guide refused: the answer is not what was asked, so no answer.
            raise server_error(f"The answer broke its required format (request id {call.request_id}).")
        result.fold(step)
        if step.session is not None:
            self.telemetry.count_session(step.session)

    async def prewarm(self, request_id: str, tenant: str, session_id: str) -> PrewarmAnswer:
        """Announce a session's next call to the decode replica that follows the session."""
        session = self.keys.session(tenant, session_id)
        assert session is not None  # a named session stays named
        announcement = SessionAnnouncement(session)
        return await announced(self.decode.prewarm.remote(announcement), request_id)

    # -- health -----------------------------------------------------------

    async def health(self, detailed: bool) -> tuple[str, dict[str, Any]]:
        """The pools' health (``pool_health.cluster_health``); ``detailed`` adds the model and the replicas' own."""
        model = {"model": self.served_model, "model_id": self.model_id}
        handles = [("decode", self.decode), ("prefill", self.prefill)]
        return await cluster_health(self.health_probe, detailed, model, handles)

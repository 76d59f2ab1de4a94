"""``POST /tokenize`` and ``POST /detokenize``: vLLM's tokenizer endpoints, answered by the ingress alone.

    body --> TokenizeRequest (tokenize_request) --> the chat template (as /v1/chat/completions renders it)
         --> ids, or ids --> text

Nothing reaches a replica: the ingress holds the model's tokenizer and chat
template, the ones every call's prompt is computed with, so ``/tokenize`` of
a chat gives the very ids a chat call with the same messages sends. The
answers are vLLM's: ``{"count", "max_model_len", "tokens", "token_strs"}``
and ``{"prompt"}``. Errors are OpenAI's shape; with keys set, a key is needed
(the ids say what the served model is, as ``/v1/models`` does).
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from .chat_prompt import render_chat
from .protocol import JSON
from .request_limits import off_loop
from .serving import HTTPServing
from .tokenize_request import TokenizeRequest, parse_detokenize_request, parse_tokenize_request


class ServingTokens(HTTPServing):
    async def tokenize(self, request: Request, request_id: str) -> JSONResponse:
        try:
            self.authorize(request)
            body, num_bytes = await self.json_body(request)
            parsed = parse_tokenize_request(body, self.served_model)
            answer = await off_loop(num_bytes, lambda: self._tokenize(parsed))
        except Exception as err:
            return self.failure("tokenize", err, request_id)
        self.succeeded("tokenize")
        return JSONResponse(answer)

    async def detokenize(self, request: Request, request_id: str) -> JSONResponse:
        try:
            self.authorize(request)
            body, num_bytes = await self.json_body(request)
            vocab_size = self.pipeline.vocab_size
            tokenizer = self.pipeline.tokenizer

            def decode() -> str:
                token_ids = parse_detokenize_request(body, self.served_model, vocab_size)
                return tokenizer.decode(token_ids, skip_special_tokens=False)

            text = await off_loop(num_bytes, decode)
        except Exception as err:
            return self.failure("detokenize", err, request_id)
        self.succeeded("detokenize")
        return JSONResponse({"prompt": text})

    def _tokenize(self, parsed: TokenizeRequest) -> JSON:
        tokenizer = self.pipeline.tokenizer
        if parsed.messages is None:
            assert parsed.prompt is not None
            text = parsed.prompt
        else:
            text = render_chat(
                tokenizer,
                parsed.messages,
                parsed.tools,
                parsed.template_kwargs,
                add_generation_prompt=parsed.add_generation_prompt,
                continue_final_message=parsed.continue_final_message,
            )
        token_ids = tokenizer.encode(text, add_special_tokens=parsed.add_special_tokens)
        token_strs = [tokenizer.backend.id_to_token(i) for i in token_ids] if parsed.return_token_strs else None
        return {
            "count": len(token_ids),
            "max_model_len": self.pipeline.max_model_len,
            "tokens": token_ids,
            "token_strs": token_strs,
        }

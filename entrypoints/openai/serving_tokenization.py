"""POST /tokenize and POST /detokenize (vLLM's request and response shapes)."""
from __future__ import annotations

from typing import Any

from aiohttp import web

from hybridkv.entrypoints.openai.errors import bad_request
from hybridkv.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from hybridkv.entrypoints.openai.serving_base import ServingContext
from hybridkv.entrypoints.openai.serving_chat import render_chat


class TokenizationServing:
    """Both endpoints are all tokenizer work: each runs whole in a worker thread."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def tokenize(self, body: Any) -> web.Response:
        return await self.ctx.json_response(lambda: self._tokenize(body))

    async def detokenize(self, body: Any) -> web.Response:
        return await self.ctx.json_response(lambda: self._detokenize(body))

    def _tokenize(self, body: Any) -> dict:
        ctx = self.ctx
        req = TokenizeRequest.parse(body)
        ctx.check_model(req.model)
        if req.messages is not None:
            text, param = render_chat(ctx, req.messages, req.add_generation_prompt), "messages"
        else:
            text, param = req.prompt or "", "prompt"
        # Only the size pre-check applies (a text that long cannot fit the context whatever it
        # says; vLLM's /tokenize refuses over-long inputs too): any shorter text is counted, even
        # past max_model_len, so clients can measure what to trim.
        ids = ctx.encode(text, add_special_tokens=req.add_special_tokens, param=param)
        return {
            "count": len(ids),
            "max_model_len": ctx.max_model_len,
            "tokens": ids,
            "token_strs": ctx.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None,
        }

    def _detokenize(self, body: Any) -> dict:
        ctx = self.ctx
        req = DetokenizeRequest.parse(body)
        ctx.check_model(req.model)
        # The Rust decode holds the GIL (~0.15 s per million ids), so in a worker thread too it
        # would stall the event loop; no sequence this server makes is longer than the context.
        if len(req.tokens) > ctx.max_model_len:
            raise bad_request(f"Invalid value for 'tokens': at most {ctx.max_model_len} token ids (the model's "
                              f"context length), got {len(req.tokens)}.", "tokens")
        vocab = len(ctx.tokenizer)
        if req.tokens and max(req.tokens) >= vocab:
            bad = [t for t in req.tokens if t >= vocab]
            raise bad_request(f"Invalid value for 'tokens': token ids must be < {vocab}, got {bad[:5]}.", "tokens")
        return {"prompt": ctx.tokenizer.decode(req.tokens)}

"""POST /tokenize and POST /detokenize (vLLM's request and response shapes)."""
from __future__ import annotations

from typing import Any

from hybridkv.entrypoints.openai.errors import bad_request
from hybridkv.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from hybridkv.entrypoints.openai.serving_base import ServingContext
from hybridkv.entrypoints.openai.serving_chat import render_chat


class TokenizationServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def tokenize(self, body: Any) -> dict:
        ctx = self.ctx
        req = TokenizeRequest.parse(body)
        ctx.check_model(req.model)
        if req.messages is not None:
            text = render_chat(ctx, req.messages, req.add_generation_prompt)
        else:
            text = req.prompt or ""
        ids = ctx.tokenize(text, add_special_tokens=req.add_special_tokens)
        return {
            "count": len(ids),
            "max_model_len": ctx.max_model_len,
            "tokens": ids,
            "token_strs": ctx.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None,
        }

    def detokenize(self, body: Any) -> dict:
        ctx = self.ctx
        req = DetokenizeRequest.parse(body)
        ctx.check_model(req.model)
        vocab = len(ctx.tokenizer)
        bad = [t for t in req.tokens if t >= vocab]
        if bad:
            raise bad_request(f"Invalid value for 'tokens': token ids must be < {vocab}, got {bad[:5]}.", "tokens")
        return {"prompt": ctx.tokenizer.decode(req.tokens)}

"""POST /v1/completions: text completion, streamed (SSE) or whole, for one prompt or a batch."""
from __future__ import annotations

from typing import Any

from aiohttp import web

from hybridkv.engine.outputs import PositionLogprobs
from hybridkv.entrypoints.openai.protocol import CompletionRequest
from hybridkv.entrypoints.openai.serving_base import (
    ChoiceState, Generation, PromptInput, ServingContext, finite_logprob, send_stream,
)
from hybridkv.entrypoints.openai.sse import SSEStream


class CompletionServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, request: web.Request, body: Any) -> web.StreamResponse:
        ctx = self.ctx
        req, model, inputs = await ctx.run(self._prepare, body)
        # echo + logprobs reports the prompt's logprobs too (as OpenAI did and vLLM does).
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
        params = req.sampling.to_params(req.max_tokens, req.logprobs, ctx.sampling_defaults, prompt_logprobs)
        gen = await ctx.start("cmpl", inputs, params, req.cache_salt, "prompt", req.stream,
                              req.sampling.structured_outputs_param)
        async with gen:
            if req.stream:
                return await self._stream(request, req, model, gen)
            await gen.run_to_end()
            return await ctx.json_response(lambda: self._response(req, model, gen))

    def _prepare(self, body: Any) -> tuple[CompletionRequest, str, list[PromptInput]]:
        """Worker thread: everything between the JSON body and the engine (validating a million
        token ids or tokenizing a long text takes a while)."""
        ctx = self.ctx
        req = CompletionRequest.parse(body)
        model = ctx.check_model(req.model)
        ctx.check_num_seqs(len(req.prompts), req.sampling.n)
        for p in req.prompts:  # every text passes the size pre-check before any is tokenized
            if isinstance(p, str):
                ctx.check_text_size(p, "prompt")
        inputs = [PromptInput(p, ctx.encode(p, param="prompt")) if isinstance(p, str) else PromptInput(None, list(p))
                  for p in req.prompts]
        for p in inputs:
            ctx.check_context(len(p.token_ids), req.max_tokens, req.sampling.min_tokens, "prompt")
        return req, model, inputs

    def _prompt_text(self, p: PromptInput) -> str:
        """Worker thread (decodes a token-id prompt)."""
        return p.text if p.text is not None else self.ctx.tokenizer.decode(p.token_ids)

    # -- whole response ---------------------------------------------------------------------------
    def _response(self, req: CompletionRequest, model: str, gen: Generation) -> dict:
        """Worker thread: echo and logprobs decode tokens."""
        choices = []
        for c in gen.choices:
            p = gen.inputs[c.prompt_index]
            text = "".join(c.text)
            logprobs = None
            if req.echo:
                text = self._prompt_text(p) + text
            if req.logprobs is not None:
                logprobs = self._logprobs_block(req, gen, c, c.token_ids, c.logprobs, echo=req.echo)
            choice = {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                      "stop_reason": c.stop_reason}
            if req.return_token_ids:
                choice["prompt_token_ids"] = p.token_ids
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        return {"id": gen.id, "object": "text_completion", "created": gen.created, "model": model,
                "choices": choices, "usage": gen.usage()}

    def _logprobs_block(self, req: CompletionRequest, gen: Generation, c: ChoiceState, token_ids: list[int],
                        positions: list[PositionLogprobs], echo: bool, offset: int = 0) -> dict:
        """OpenAI's legacy logprobs object: tokens, token_logprobs, top_logprobs, text_offset.

        Decodes the tokens the engine sent no text for (echoed prompt positions): call it in a
        worker thread when echo is on."""
        block: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        rows: list[tuple[int, PositionLogprobs | None]] = []
        if echo:
            p = gen.inputs[c.prompt_index]
            prompt_lps = gen.prompt_logprobs[c.prompt_index] or [None] * len(p.token_ids)
            rows.extend(zip(p.token_ids, prompt_lps))
        rows.extend(zip(token_ids, positions))
        for tid, pos in rows:
            lp = pos.get(tid) if pos else None
            token = lp.decoded_token if lp is not None and lp.decoded_token is not None else \
                self.ctx.tokenizer.decode([tid])
            block["tokens"].append(token)
            block["token_logprobs"].append(finite_logprob(lp.logprob) if lp is not None else None)
            block["top_logprobs"].append(
                {(e.decoded_token or ""): finite_logprob(e.logprob) for e in pos.values()} if pos else None
            )
            block["text_offset"].append(offset)
            offset += len(token)
        return block

    # -- streaming ---------------------------------------------------------------------------------
    async def _stream(self, request: web.Request, req: CompletionRequest, model: str,
                      gen: Generation) -> web.StreamResponse:
        sse = SSEStream(request)
        await sse.start()
        started: set[int] = set()  # choices that got their first chunk (echo goes there)
        offsets = [0] * len(gen.choices)

        async def choices():
            async for i, out in gen.outputs():
                for o in out.outputs:
                    c = gen.choice(i, o)
                    first = c.index not in started
                    started.add(c.index)
                    echo = req.echo and first
                    text = (await self.ctx.run(self._prompt_text, gen.inputs[i]) if echo else "") + o.text
                    logprobs = None
                    if req.logprobs is not None:
                        args = (req, gen, c, o.token_ids, o.logprobs or [], echo, offsets[c.index])
                        # Generated tokens come with their text; echoed prompt tokens are decoded here.
                        logprobs = await self.ctx.run(self._logprobs_block, *args) if echo else \
                            self._logprobs_block(*args)
                        offsets[c.index] += sum(len(t) for t in logprobs["tokens"])
                    if not text and o.finish_reason is None and not (logprobs and logprobs["tokens"]) and not (
                        req.return_token_ids and o.token_ids
                    ):
                        continue  # nothing a client can see (e.g. half of a multi-byte character)
                    choice = {"index": c.index, "text": text, "logprobs": logprobs,
                              "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
                    if req.return_token_ids:
                        choice["token_ids"] = list(o.token_ids)
                        if first:
                            choice["prompt_token_ids"] = gen.inputs[i].token_ids
                    yield choice

        return await send_stream(sse, gen, model, "text_completion", req.stream_options, choices)

"""POST /v1/chat/completions: messages rendered with the chat template, answered whole or streamed."""
from __future__ import annotations

import dataclasses
from typing import Any

from aiohttp import web

from hybridkv.engine.outputs import Logprob, PositionLogprobs
from hybridkv.entrypoints.openai.errors import bad_request
from hybridkv.entrypoints.openai.protocol import ChatCompletionRequest
from hybridkv.entrypoints.openai.chat_output import ChatOutput
from hybridkv.entrypoints.openai.reasoning_parser import END_TAG, prompt_in_reasoning, reasoning_precedes_answer
from hybridkv.entrypoints.openai.tool_parsers import make_parser
from hybridkv.entrypoints.openai.serving_base import Generation, PromptInput, ServingContext, finite_logprob, send_stream
from hybridkv.entrypoints.openai.sse import SSEStream
from hybridkv.model_executor.tokenizer import apply_chat_template


def render_chat(ctx: ServingContext, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                tools: list[dict] | None = None) -> str:
    """Worker thread. Template precedence: --chat-template, then the checkpoint's own, then ChatML."""
    try:
        return apply_chat_template(ctx.tokenizer, messages, ctx.chat_template, add_generation_prompt, tools)
    except ValueError as e:  # the template rejected these messages (e.g. roles out of order)
        raise bad_request(str(e), "messages") from e


def chat_prompt(ctx: ServingContext, messages: list[dict[str, Any]],
                add_generation_prompt: bool = True, tools: list[dict] | None = None) -> PromptInput:
    """Worker thread: the rendered conversation and its token ids."""
    text = render_chat(ctx, messages, add_generation_prompt, tools)
    # The rendered text already holds any BOS the template writes.
    return PromptInput(text, ctx.encode(text, add_special_tokens=False, param="messages"))


class ChatServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, request: web.Request, body: Any) -> web.StreamResponse:
        ctx = self.ctx
        req, model, prompt = await ctx.run(self._prepare, body)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = req.sampling.to_params(req.max_tokens, logprobs, ctx.sampling_defaults)
        gen = await ctx.start("chatcmpl", [prompt], params, req.cache_salt, "messages", req.stream,
                              req.sampling.structured_outputs_param)
        async with gen:
            if req.stream:
                return await self._stream(request, req, model, gen)
            await gen.run_to_end()
            return await ctx.json_response(lambda: self._response(req, model, gen))

    def _prepare(self, body: Any) -> tuple[ChatCompletionRequest, str, PromptInput]:
        """Worker thread: validation, the chat template and tokenization."""
        ctx = self.ctx
        req = ChatCompletionRequest.parse(body)
        model = ctx.check_model(req.model)
        ctx.check_num_seqs(1, req.sampling.n)
        if req.tools.choice == "auto" and ctx.tool_call_parser is None:
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                              'set (or pass tool_choice "required", "none" or a named function)', "tool_choice")
        if req.tools.constrained:  # the calls' JSON, enforced by constrained decoding
            req.sampling.structured_outputs = req.tools.constraint()
            req.sampling.structured_outputs_param = "tool_choice"
        prompt = chat_prompt(ctx, req.messages, req.add_generation_prompt, req.tools.rendered_tools)
        spec = req.sampling.structured_outputs
        if spec is not None and ctx.reasoning_parser is not None and reasoning_precedes_answer(prompt.text):
            # The reasoning stays free; the grammar constrains the answer after it.
            req.sampling.structured_outputs = dataclasses.replace(spec, start_after=END_TAG)
        ctx.check_context(len(prompt.token_ids), req.max_tokens, req.sampling.min_tokens, "messages")
        return req, model, prompt

    def _logprobs(self, req: ChatCompletionRequest, token_ids: list[int], positions: list[PositionLogprobs]) -> dict:
        k = req.top_logprobs or 0

        def entry(lp: Logprob) -> dict:
            token = lp.decoded_token or ""
            return {"token": token, "logprob": finite_logprob(lp.logprob), "bytes": list(token.encode("utf-8"))}

        content = []
        for tid, pos in zip(token_ids, positions):
            # A position lists the top-k in rank order, then the sampled token if it is not among them.
            item = entry(pos[tid])
            item["top_logprobs"] = [entry(lp) for lp in list(pos.values())[:k]]
            content.append(item)
        return {"content": content}

    def _output(self, req: ChatCompletionRequest, gen: Generation) -> ChatOutput:
        """One choice's output stages: the reasoning split (with --reasoning-parser: where the
        prompt left the model) and the tools."""
        ctx = self.ctx
        in_reasoning = None if ctx.reasoning_parser is None else prompt_in_reasoning(gen.inputs[0].text or "")
        parser = make_parser(ctx.tool_call_parser) if ctx.tool_call_parser is not None else None
        return ChatOutput(in_reasoning, req.tools, parser)

    def _response(self, req: ChatCompletionRequest, model: str, gen: Generation) -> dict:
        choices = []
        for c in gen.choices:
            output = self._output(req, gen)
            choice = {
                "index": c.index,
                "message": output.message("".join(c.text)),
                "logprobs": self._logprobs(req, c.token_ids, c.logprobs) if req.logprobs else None,
                "finish_reason": output.finish_reason(c.finish_reason),
                "stop_reason": c.stop_reason,
            }
            if req.return_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        body = {"id": gen.id, "object": "chat.completion", "created": gen.created, "model": model,
                "choices": choices, "usage": gen.usage()}
        if req.return_token_ids:
            body["prompt_token_ids"] = gen.inputs[0].token_ids
        return body

    async def _stream(self, request: web.Request, req: ChatCompletionRequest, model: str,
                      gen: Generation) -> web.StreamResponse:
        sse = SSEStream(request)
        await sse.start()
        outputs: dict[int, ChatOutput] = {}  # choice index -> its reasoning split and tool calls

        async def choices():
            # OpenAI's first chunk per choice carries the role and no text yet.
            for c in gen.choices:
                first = {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}
                if req.return_token_ids:
                    first["prompt_token_ids"] = gen.inputs[0].token_ids
                yield first
            async for i, out in gen.outputs():
                for o in out.outputs:
                    c = gen.choice(i, o)
                    logprobs = self._logprobs(req, o.token_ids, o.logprobs or []) if req.logprobs else None
                    if not o.text and o.finish_reason is None and not (logprobs and logprobs["content"]) and not (
                        req.return_token_ids and o.token_ids
                    ):
                        continue  # nothing a client can see (e.g. half of a multi-byte character)
                    output = outputs.setdefault(c.index, self._output(req, gen))
                    finished = o.finish_reason is not None
                    delta = output.finish(o.text) if finished else output.feed(o.text)
                    choice = {"index": c.index, "delta": delta, "logprobs": logprobs,
                              "finish_reason": output.finish_reason(o.finish_reason), "stop_reason": o.stop_reason}
                    if req.return_token_ids:
                        choice["token_ids"] = list(o.token_ids)
                    yield choice

        return await send_stream(sse, gen, model, "chat.completion.chunk", req.stream_options, choices)

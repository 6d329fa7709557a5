"""SGLang's native endpoints, so a server joins a fleet behind SGLang's router and SGLang's own
benchmark clients run against it:

  GET  /get_model_info, /model_info    what the model is (the router's probe at registration)
  GET  /get_server_info, /server_info  the serving limits (the router's probe at registration)
  POST /flush_cache                    drop every cached prefix no request holds (device and host)
  POST /generate                       SGLang's native body: `text` or `input_ids` (one or a batch),
                                       `sampling_params`, `stream`; the answer is `text`,
                                       `output_ids` and `meta_info` (cumulative when streamed)

The same engine, validation, metrics and abort-on-disconnect as the OpenAI endpoints
(serving_base.py); only the body and the answer are SGLang's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from hybridkv.engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from hybridkv.entrypoints.openai.errors import bad_request
from hybridkv.entrypoints.openai.protocol import MAX_N, _Body, json_type
from hybridkv.entrypoints.openai.serving_base import (
    ChoiceState, Generation, PromptInput, ServingContext, send_events,
)
from hybridkv.entrypoints.openai.sse import SSEStream

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when sampling_params has no max_new_tokens


@dataclass
class GenerateRequest:
    """A parsed POST /generate body."""

    prompts: list[str | list[int]]
    batch: bool  # the body sent a list: the answer is a list (one entry per prompt x n)
    params: SamplingParams
    stream: bool


def _sampling_params(raw: Any) -> SamplingParams:
    """SGLang's sampling_params (its names; vLLM's where they differ) as the engine's."""
    b = _Body(raw if raw is not None else {}, "sampling_params")
    max_new = b.int("max_new_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS, lo=0)
    kw: dict[str, Any] = dict(
        n=b.int("n", 1, lo=1, hi=MAX_N),
        temperature=b.float("temperature", 1.0, lambda v: v >= 0, ">= 0"),
        top_p=b.float("top_p", 1.0, lambda v: 0 < v <= 1, "in (0, 1]"),
        top_k=b.int("top_k", -1, lo=-1),
        min_p=b.float("min_p", 0.0, lambda v: 0 <= v <= 1, "in [0, 1]"),
        frequency_penalty=b.float("frequency_penalty", 0.0, lambda v: -2 <= v <= 2, "in [-2, 2]"),
        presence_penalty=b.float("presence_penalty", 0.0, lambda v: -2 <= v <= 2, "in [-2, 2]"),
        repetition_penalty=b.float("repetition_penalty", 1.0, lambda v: v > 0, "> 0"),
        min_tokens=b.int("min_new_tokens", 0, lo=0),
        stop=b.stop("stop"),
        stop_token_ids=b.int_list("stop_token_ids"),
        ignore_eos=b.bool("ignore_eos", False),
        skip_special_tokens=b.bool("skip_special_tokens", True),
        spaces_between_special_tokens=b.bool("spaces_between_special_tokens", True),
        include_stop_str_in_output=b.bool("no_stop_trim", False),
        seed=b.int("sampling_seed", None),
    )
    # SGLang's constraint fields (json_schema as JSON text, regex, ebnf) as the engine's.
    constraint = {kind: v for name, kind in (("json_schema", "json"), ("regex", "regex"), ("ebnf", "grammar"))
                  if (v := b.str(name, non_empty=True)) is not None}
    b.off("structural_tag", lambda v: False, "structural tags are not implemented")
    b.finish()
    if len(constraint) > 1:
        raise bad_request("Pass at most one of 'json_schema', 'regex' and 'ebnf'.", "sampling_params")
    if constraint:
        try:
            kw["structured_outputs"] = StructuredOutputsParams(**constraint)
        except ValueError as e:
            raise bad_request(str(e), "sampling_params") from None
    if max_new == 0:
        raise bad_request("Invalid value for 'max_new_tokens': it must be >= 1 on this server.", "max_new_tokens")
    top_k = kw.pop("top_k")
    try:
        return SamplingParams(max_tokens=max_new, top_k=0 if top_k == -1 else top_k,
                              output_kind=RequestOutputKind.DELTA, **kw)
    except ValueError as e:
        raise bad_request(str(e)) from e


def parse_generate(body: Any) -> GenerateRequest:
    b = _Body(body)
    text, ids = b.raw("text"), b.raw("input_ids")
    if (text is None) == (ids is None):
        raise bad_request("Send exactly one of 'text' and 'input_ids'.", "text")
    if text is not None:
        batch = isinstance(text, list)
        prompts = text if batch else [text]
        if not prompts or any(not isinstance(t, str) or not t for t in prompts):
            raise bad_request(f"Invalid value for 'text': expected a non-empty string or an array of them, "
                              f"but got {json_type(text)}.", "text")
    else:
        batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        prompts = [b.token_ids("input_ids", p) for p in (ids if batch else [ids])]
        if any(not p for p in prompts):
            raise bad_request("Invalid value for 'input_ids': a prompt must have at least one token.", "input_ids")
    params = _sampling_params(b.raw("sampling_params"))
    stream = b.bool("stream", False)
    b.str("model")  # one model per server: the name is not checked here, as in SGLang
    b.str("rid")
    for name in ("return_logprob", "return_hidden_states", "return_bytes", "return_entropy", "background"):
        b.off(name, lambda v: v is False, "not implemented")
    b.ignore("log_metrics", "no_logs", "return_text_in_logprobs", "logprob_start_len", "top_logprobs_num",
             "custom_logit_processor")
    b.finish()
    return GenerateRequest(prompts, batch, params, stream)


class NativeServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    # -- probes ------------------------------------------------------------------------------------
    def model_info(self) -> dict:
        ctx, config = self.ctx, self.ctx.engine.config
        # No path: it would show the server's disk layout, and a router given a name instead tries
        # to fetch that name's tokenizer from the Hugging Face hub.
        return {"model_path": None, "tokenizer_path": None, "served_model_name": ctx.model_name,
                "is_generation": True, "preferred_sampling_params": None, "weight_version": "default",
                "has_image_understanding": False, "has_audio_understanding": False,
                "max_model_len": ctx.max_model_len, "dtype": str(config.dtype)}

    def server_info(self) -> dict:
        from hybridkv.entrypoints.openai.api_server import server_version

        ctx, config = self.ctx, self.ctx.engine.config
        snap = ctx.engine.snapshot()
        return {"served_model_name": ctx.model_name, "model_path": None, "version": server_version(),
                "engine": "hybridkv", "context_length": ctx.max_model_len,
                "max_running_requests": config.max_num_seqs, "page_size": config.block_size,
                "enable_prefix_caching": config.enable_prefix_caching,
                "enable_hierarchical_cache": config.enable_hierarchical_cache,
                "hicache_storage_backend": config.hicache_storage_backend,
                "internal_states": [{"num_running": snap.num_running, "num_waiting": snap.num_waiting}]}

    async def flush_cache(self) -> web.Response:
        """Every cached prefix no running request holds leaves the device and host caches (the
        storage tier is shared with other servers and keeps its pages)."""
        dropped = await self.ctx.engine.call(lambda e: e.reset_prefix_cache())
        return web.Response(text=f"Cache flushed: {dropped} prefix pages dropped (pages running requests "
                                 "hold stay).\n")

    # -- generation --------------------------------------------------------------------------------
    def _prepare(self, body: Any) -> tuple[GenerateRequest, list[PromptInput]]:
        """Worker thread: parse, tokenize, check sizes."""
        ctx = self.ctx
        req = parse_generate(body)
        ctx.check_num_seqs(len(req.prompts), req.params.n)
        inputs = [PromptInput(p, ctx.encode(p, param="text")) if isinstance(p, str) else PromptInput(None, list(p))
                  for p in req.prompts]
        for p in inputs:
            ctx.check_context(len(p.token_ids), req.params.max_tokens, req.params.min_tokens, "text")
        return req, inputs

    async def generate(self, request: web.Request, body: Any) -> web.StreamResponse:
        ctx = self.ctx
        req, inputs = await ctx.run(self._prepare, body)
        t0 = time.monotonic()
        gen = await ctx.start("gen", inputs, req.params, None, "text", req.stream, "sampling_params")
        async with gen:
            if req.stream:
                return await self._stream(request, req, gen, t0)
            await gen.run_to_end()
            results = [self._result(gen, c, t0) for c in gen.choices]
            return web.json_response(results if req.batch or req.params.n > 1 else results[0])

    def _result(self, gen: Generation, c: ChoiceState, t0: float) -> dict:
        finish = None
        if c.finish_reason == "length":
            finish = {"type": "length", "length": len(c.token_ids)}
        elif c.finish_reason == "stop":
            matched = c.stop_reason if c.stop_reason is not None else (c.token_ids[-1] if c.token_ids else None)
            finish = {"type": "stop", "matched": matched}
        elif c.finish_reason is not None:
            finish = {"type": c.finish_reason}
        p = gen.inputs[c.prompt_index]
        return {"text": "".join(c.text), "output_ids": list(c.token_ids),
                "meta_info": {"id": f"{gen.id}-{c.index}", "finish_reason": finish,
                              "prompt_tokens": len(p.token_ids), "completion_tokens": len(c.token_ids),
                              "cached_tokens": gen.cached_tokens[c.prompt_index],
                              "e2e_latency": time.monotonic() - t0}}

    async def _stream(self, request: web.Request, req: GenerateRequest, gen: Generation,
                      t0: float) -> web.StreamResponse:
        """SGLang's stream: one event per update of a choice with its whole text and output ids so
        far (the index says which choice), then [DONE]."""
        sse = SSEStream(request)
        await sse.start()

        async def events():
            async for i, out in gen.outputs():
                for o in out.outputs:
                    c = gen.choice(i, o)
                    if o.text or o.token_ids or o.finish_reason is not None:
                        yield {**self._result(gen, c, t0), "index": c.index}

        return await send_events(sse, events())

"""What both generation endpoints share: model check, prompt tokenization and context check,
starting engine requests, and following them to the end (metrics, abort on early exit).

Nothing heavy runs on the event loop: tokenizing, rendering chat templates, detokenizing and
encoding whole responses run in the app's worker threads (`ServingContext.run`), so one large
request cannot stall /health, streams or other clients. The functions that must run there are
synchronous and say so.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
import uuid
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, TypeVar

from aiohttp import web

from hybridkv.engine.async_llm_engine import (
    AsyncLLMEngine, EngineDeadError, EngineQueueFullError, GenerateRequest, RequestStream,
)
from hybridkv.engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from hybridkv.engine.sampling_params import SamplingParams
from hybridkv.entrypoints.openai.errors import OpenAIError, bad_request, not_found
from hybridkv.entrypoints.openai.metrics import RequestTracker, ServerMetrics
from hybridkv.entrypoints.openai.sse import dumps

# JSON has no -inf; a token with zero probability reports this (vLLM's clamp).
LOGPROB_FLOOR = -9999.0
# A text longer than max_model_len x (longest token text) x this cannot fit the context. The slack
# covers what makes one token's text differ from the bytes it covers in a prompt: normalizers,
# a decoder that drops the leading space of a lone token, clean-up of spaces before punctuation.
TEXT_BYTES_SAFETY_FACTOR = 2
DEFAULT_MAX_SEQS_PER_REQUEST = 1024

T = TypeVar("T")


def finite_logprob(v: float) -> float:
    return v if math.isfinite(v) else LOGPROB_FLOOR


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def longest_token_bytes(tokenizer: Any) -> int:
    """UTF-8 length of the longest text any single token decodes to (special tokens included);
    computed once at startup (about 0.3 s per 50k tokens)."""
    return max(1, max((len(tokenizer.decode([i]).encode("utf-8")) for i in range(len(tokenizer))), default=1))


def utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8"))  # isascii() is O(1) in CPython


@dataclass(frozen=True)
class PromptInput:
    text: str | None  # None when the client sent token ids
    token_ids: list[int]


@dataclass
class ServingContext:
    """Per-app state every handler needs; built once by the app factory (no module globals)."""

    engine: AsyncLLMEngine
    tokenizer: Any  # the frontend's own instance: never shared with the engine thread
    served_model_names: list[str]
    model_path: str
    max_model_len: int
    chat_template: str | None
    sampling_defaults: dict[str, Any]
    metrics: ServerMetrics
    executor: Executor  # the app's worker threads (see the module docstring); the app shuts it down
    max_token_bytes: int  # longest_token_bytes(tokenizer)
    max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST
    reasoning_parser: str | None = None  # chat outputs split into reasoning_content and content
    tool_call_parser: str | None = None  # with --enable-auto-tool-choice: tool_choice "auto" parses calls
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, name: str | None) -> str:
        """The name to report back; None (field omitted) means the default model, as vLLM allows."""
        if name is None:
            return self.model_name
        if name not in self.served_model_names:
            raise not_found(f"The model `{name}` does not exist.", "model")
        return name

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in a worker thread; its exceptions (OpenAIError included) are raised here."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args))

    async def json_response(self, build: Callable[[], Any]) -> web.Response:
        """A whole (non-streaming) JSON response: build() and its encoding run in a worker thread."""
        body = await self.run(lambda: dumps(build()).encode("utf-8"))
        return web.Response(body=body, content_type="application/json", charset="utf-8")

    @property
    def max_text_bytes(self) -> int:
        return self.max_model_len * self.max_token_bytes * TEXT_BYTES_SAFETY_FACTOR

    def check_text_size(self, text: str, param: str) -> None:
        """The exact-but-cheap pre-check: a text this long needs more than max_model_len tokens
        whatever it says, so it gets the context-length 400 without being tokenized (tokenizing
        8 MiB takes seconds)."""
        size, limit = utf8_len(text), self.max_text_bytes
        if size > limit:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your input is "
                f"{size} bytes long, more than {self.max_model_len} tokens can hold (at most {limit} bytes). "
                "Please reduce the length of the input messages.",
                param,
            )

    def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """Token ids of text, after the size pre-check. Worker thread only (see `run`): the
        transformers-level encode releases the GIL while the Rust tokenizer works."""
        self.check_text_size(text, param)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def check_num_seqs(self, num_prompts: int, n: int) -> None:
        """Admission bound per request: prompts x n sequences (each holds KV pages and a slot)."""
        total, limit = num_prompts * n, self.max_seqs_per_request
        if total > limit:
            self.metrics.request_rejected("too_many_sequences")
            prompts = f"{num_prompts} prompt{'s' if num_prompts != 1 else ''}"
            raise bad_request(
                f"Invalid value for 'n': this request asks for {total} sequences ({prompts} x n={n}), more than "
                f"the {limit} sequences one request may start on this server.",
                "n",
            )

    def check_context(self, num_prompt_tokens: int, max_tokens: int | None, min_tokens: int = 0,
                      prompt_param: str = "messages") -> None:
        """vLLM's context-overflow messages (clients parse them to trim conversations)."""
        n = self.max_model_len
        if num_prompt_tokens >= n:
            raise bad_request(
                f"This model's maximum context length is {n} tokens. However, your request has "
                f"{num_prompt_tokens} input tokens. Please reduce the length of the input messages.",
                prompt_param,
            )
        if max_tokens is not None and num_prompt_tokens + max_tokens > n:
            raise bad_request(
                f"This model's maximum context length is {n} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the messages, {max_tokens} in "
                f"the completion). Please reduce the length of the messages or completion.",
                "max_tokens",
            )
        # Without this, min_tokens past the context (and no max_tokens) would run to the end of
        # the context; the engine refuses it too, but with no `param`.
        if num_prompt_tokens + min_tokens > n:
            raise bad_request(
                f"This model's maximum context length is {n} tokens. However, you requested at least "
                f"{num_prompt_tokens + min_tokens} tokens ({num_prompt_tokens} in the messages, min_tokens "
                f"{min_tokens} in the completion). Please reduce the length of the messages or min_tokens.",
                "min_tokens",
            )

    async def start(
        self, prefix: str, inputs: list[PromptInput], params: SamplingParams, cache_salt: str | None,
        prompt_param: str = "prompt", stream: bool = True, structured_outputs_param: str = "response_format",
    ) -> "Generation":
        """stream: whether the client watches tokens arrive (the step-time target protects only
        those; a whole response waits for its last token either way). structured_outputs_param:
        the request field a constraint came from (named by its 400 when it cannot compile)."""
        if params.structured_outputs is not None:  # a grammar that cannot compile is a 400, before any add
            try:
                await self.engine.check_structured_outputs([params])
            except ValueError as e:
                raise bad_request(str(e), structured_outputs_param) from e
        base = random_id(prefix)
        requests = [
            GenerateRequest(f"{base}-{i}", {"prompt": p.text, "prompt_token_ids": p.token_ids}
                            if p.text is not None else {"prompt_token_ids": p.token_ids}, params, cache_salt,
                            interactive=stream)
            for i, p in enumerate(inputs)
        ]
        tracker = self.metrics.track()
        try:
            stream = await self.engine.add_requests(requests)
        except ValueError as e:  # engine-side validation (token ids out of vocabulary, ...)
            raise bad_request(str(e), prompt_param) from e
        except EngineQueueFullError as e:  # nothing was added; a later retry may fit
            raise OpenAIError(str(e), 503, headers={"Retry-After": str(e.retry_after)}) from e
        except EngineDeadError as e:
            raise OpenAIError(f"The engine is not running: {e}", 503) from e
        return Generation(base, inputs, params.n, stream, tracker)


@dataclass
class ChoiceState:
    """Everything generated so far for one choice (prompt i, sample j -> index i * n + j)."""

    index: int
    prompt_index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Generation:
    """The engine requests behind one HTTP request, followed to the end.

    Use as `async with generation:` so that leaving early (client gone, handler cancelled, error)
    aborts whatever is still running and its pages are freed.
    """

    def __init__(self, id: str, inputs: list[PromptInput], n: int, stream: RequestStream,
                 tracker: RequestTracker) -> None:
        self.id = id
        self.inputs = inputs
        self.n = n
        self.created = int(time.time())
        self._stream = stream
        self._tracker = tracker
        self._prompt_index = {rid: i for i, rid in enumerate(stream.request_ids)}
        self.choices = [ChoiceState(i * n + j, i) for i in range(len(inputs)) for j in range(n)]
        self.cached_tokens = [0] * len(inputs)
        self.prompt_logprobs: list[list[PositionLogprobs | None] | None] = [None] * len(inputs)

    async def __aenter__(self) -> "Generation":
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self._stream.finished:
            self._tracker.on_abort(sum(not c.finished for c in self.choices))
            self._stream.abort()

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, delta output) pairs; updates choices as they arrive."""
        async for out in self._stream:
            i = self._prompt_index[out.request_id]
            self.cached_tokens[i] = max(self.cached_tokens[i], out.num_cached_tokens)
            if out.prompt_logprobs is not None:
                self.prompt_logprobs[i] = out.prompt_logprobs
            for o in out.outputs:
                self._apply(self.choices[i * self.n + o.index], o)
            self._tracker.on_output(out)
            yield i, out
        self._tracker.on_complete()

    @staticmethod
    def _apply(choice: ChoiceState, o: CompletionOutput) -> None:
        choice.text.append(o.text)
        choice.token_ids.extend(o.token_ids)
        if o.logprobs:
            choice.logprobs.extend(o.logprobs)
        if o.finish_reason is not None:
            choice.finish_reason = o.finish_reason
            choice.stop_reason = o.stop_reason

    def choice(self, prompt_index: int, o: CompletionOutput) -> ChoiceState:
        return self.choices[prompt_index * self.n + o.index]

    async def run_to_end(self) -> None:
        async for _ in self.outputs():
            pass

    def usage(self) -> dict:
        prompt = sum(len(p.token_ids) for p in self.inputs)
        completion = sum(len(c.token_ids) for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens)},
        }


def stream_chunk(gen: "Generation", model: str, object_name: str, choices: list[dict], usage: dict | None = None) -> dict:
    body = {"id": gen.id, "object": object_name, "created": gen.created, "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


async def send_stream(sse, gen: "Generation", model: str, object_name: str, opts,
                      choices: Callable[[], AsyncIterator[dict]]):
    """The SSE body both endpoints share: each choice delta as its own event (as OpenAI and vLLM
    send them; clients read choices[0]), the usage chunk when asked for, then [DONE]. A failure
    after the status line went out becomes one error event; a client that went away ends the
    stream quietly (the caller's `async with gen` then aborts its requests)."""
    def usage() -> dict | None:
        return gen.usage() if opts.continuous_usage_stats else None

    async def events() -> AsyncIterator[dict]:
        async for choice in choices():
            yield stream_chunk(gen, model, object_name, [choice], usage())
        if opts.include_usage:
            yield stream_chunk(gen, model, object_name, [], gen.usage())

    return await send_events(sse, events())


async def send_events(sse, events: AsyncIterator[dict]):
    """Each event as one SSE data line, then [DONE]. A failure after the status line went out
    becomes one error event; a client that went away ends the stream quietly."""
    try:
        async with contextlib.aclosing(events):  # closed (its requests' iteration ended) on every exit
            async for event in events:
                await sse.send(event)
    except ConnectionError:
        return sse.response
    except Exception as e:  # noqa: BLE001 - reported in-stream; the status line is already sent
        try:
            await sse.send_error(stream_error(e))
        except ConnectionError:
            return sse.response
    try:
        return await sse.done()
    except ConnectionError:  # gone between its last token and [DONE]: nothing left to tell it
        return sse.response


def stream_error(e: BaseException) -> OpenAIError:
    """What a failure after the response started becomes (sent as one SSE error event)."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, EngineDeadError):
        return OpenAIError(f"The engine is not running: {e}", 503)
    return OpenAIError(f"Internal error while generating: {e!r}", 500)

"""What both generation endpoints share: model check, prompt tokenization and context check,
starting engine requests, and following them to the end (metrics, abort on early exit).
"""
from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from hybridkv.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError, GenerateRequest, RequestStream
from hybridkv.engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from hybridkv.engine.sampling_params import SamplingParams
from hybridkv.entrypoints.openai.errors import OpenAIError, bad_request, not_found
from hybridkv.entrypoints.openai.metrics import RequestTracker, ServerMetrics

# JSON has no -inf; a token with zero probability reports this (vLLM's clamp).
LOGPROB_FLOOR = -9999.0


def finite_logprob(v: float) -> float:
    return v if math.isfinite(v) else LOGPROB_FLOOR


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


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

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def check_context(self, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str = "messages") -> None:
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

    async def start(
        self, prefix: str, inputs: list[PromptInput], params: SamplingParams, cache_salt: str | None
    ) -> "Generation":
        base = random_id(prefix)
        requests = [
            GenerateRequest(f"{base}-{i}", {"prompt": p.text, "prompt_token_ids": p.token_ids}
                            if p.text is not None else {"prompt_token_ids": p.token_ids}, params, cache_salt)
            for i, p in enumerate(inputs)
        ]
        tracker = self.metrics.track()
        try:
            stream = await self.engine.add_requests(requests)
        except ValueError as e:  # engine-side validation (token ids out of vocabulary, ...)
            raise bad_request(str(e)) from e
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

    try:
        async for choice in choices():
            await sse.send(stream_chunk(gen, model, object_name, [choice], usage()))
        if opts.include_usage:
            await sse.send(stream_chunk(gen, model, object_name, [], gen.usage()))
    except ConnectionError:
        return sse.response
    except Exception as e:  # noqa: BLE001 - reported in-stream; the status line is already sent
        await sse.send_error(stream_error(e))
    return await sse.done()


def stream_error(e: BaseException) -> OpenAIError:
    """What a failure after the response started becomes (sent as one SSE error event)."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, EngineDeadError):
        return OpenAIError(f"The engine is not running: {e}", 503)
    return OpenAIError(f"Internal error while generating: {e!r}", 500)

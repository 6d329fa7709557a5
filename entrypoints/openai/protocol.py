"""Request bodies of the OpenAI-compatible API, parsed and validated into dataclasses.

Field names are OpenAI's, plus vLLM's extras (top_k, min_p, repetition_penalty, ignore_eos,
min_tokens, stop_token_ids, skip_special_tokens, spaces_between_special_tokens,
include_stop_str_in_output, cache_salt, return_token_ids) which clients send through
`extra_body`, and the fields SGLang's router adds to what it forwards (no_stop_trim, honoured as
include_stop_str_in_output; separate_reasoning, stream_reasoning, return_hidden_states=false). Every check names the offending field in `param` and says what was expected, in
OpenAI's wording ("Invalid type for 'n': expected an integer, but got a string instead.").

Unknown top-level fields are rejected (400, "Unrecognized request argument supplied: x"), as
OpenAI does: a typo such as `max_token` would otherwise be silently ignored. OpenAI fields this
server does not implement (logit_bias, functions, ...) are accepted only with their
"off" value, so a client that sends them at their defaults keeps working and one that relies on
them gets a clear 400 instead of a silently different answer. A per-request `chat_template` is
refused: the server does not render user-supplied templates.
"""
from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass, field
from typing import Any, Callable

from hybridkv.engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from hybridkv.entrypoints.openai.errors import OpenAIError, bad_request
from hybridkv.entrypoints.openai.structured_outputs_fields import read_structured_outputs
from hybridkv.entrypoints.openai.tool_calling import ToolRequest, read_assistant_tool_calls, read_tools

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_N = 128  # bounds the sequences one request can add (memory/DoS guard)
MAX_BATCH_PROMPTS = 1024
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_JSON_TYPE = {type(None): "null", bool: "a boolean", int: "an integer", float: "a number", str: "a string",
              list: "an array", dict: "an object"}


def json_type(v: Any) -> str:
    return _JSON_TYPE.get(type(v), type(v).__name__)


_INT_TYPE = frozenset({int})
_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxstring, _SHOW.maxother, _SHOW.maxlong = 3, 60, 60, 60


def show(v: Any) -> str:
    """A short repr of a client value for an error message: bounded in length and depth (a
    900-deep array or a 4000-digit integer stays one short line)."""
    return _SHOW.repr(v)


def _type_error(name: str, expected: str, v: Any) -> OpenAIError:
    return bad_request(f"Invalid type for '{name}': expected {expected}, but got {json_type(v)} instead.", name)


def _range_error(name: str, v: Any, allowed: str) -> OpenAIError:
    return bad_request(f"Invalid value for '{name}': expected a value {allowed}, but got {show(v)} instead.", name)


class _Body:
    """Pops typed fields off a JSON object; whatever is left at the end is an unknown field."""

    def __init__(self, body: Any, what: str = "request body") -> None:
        if not isinstance(body, dict):
            raise bad_request(f"The {what} must be a JSON object, but got {json_type(body)} instead.")
        self._rest = dict(body)

    def has(self, name: str) -> bool:
        return self._rest.get(name) is not None

    def raw(self, name: str) -> Any:
        return self._rest.pop(name, None)

    def int(self, name: str, default: int | None = None, lo: int | None = None, hi: int | None = None) -> int | None:
        v = self._rest.pop(name, None)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            # JSON has one number type: accept 2.0 for an integer field, as pydantic does.
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            else:
                raise _type_error(name, "an integer", v)
        if lo is not None and v < lo:
            raise _range_error(name, v, f">= {lo}" if hi is None else f"in [{lo}, {hi}]")
        if hi is not None and v > hi:
            raise _range_error(name, v, f"<= {hi}" if lo is None else f"in [{lo}, {hi}]")
        return v

    def float(
        self, name: str, default: float | None = None, check: Callable[[float], bool] | None = None, allowed: str = ""
    ) -> float | None:
        v = self._rest.pop(name, None)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _type_error(name, "a number", v)
        try:
            v = float(v)
        except OverflowError:  # an integer past float range (1 followed by 400 zeros)
            raise _range_error(name, v, allowed or "that is finite") from None
        if not math.isfinite(v) or (check is not None and not check(v)):
            raise _range_error(name, v, allowed or "that is finite")
        return v

    def bool(self, name: str, default: bool | None = None) -> bool | None:
        v = self._rest.pop(name, None)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise _type_error(name, "a boolean", v)
        return v

    def str(self, name: str, default: str | None = None, non_empty: bool = False) -> str | None:
        v = self._rest.pop(name, None)
        if v is None:
            return default
        if not isinstance(v, str):
            raise _type_error(name, "a string", v)
        if non_empty and not v:
            raise bad_request(f"Invalid value for '{name}': it must not be empty.", name)
        return v

    def stop(self, name: str = "stop") -> list[str]:
        v = self._rest.pop(name, None)
        if v is None:
            return []
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, list) or any(not isinstance(s, str) for s in items):
            raise _type_error(name, "a string or an array of strings", v)
        if any(not s for s in items):
            raise bad_request(f"Invalid value for '{name}': stop strings must not be empty.", name)
        return list(items)

    def token_ids(self, name: str, v: Any) -> list[int]:
        # C-level scans (type() is exact, so booleans fail): a million ids take milliseconds.
        if not isinstance(v, list) or not _INT_TYPE.issuperset(map(type, v)):
            raise _type_error(name, "an array of integers", v)
        if v and min(v) < 0:
            raise bad_request(f"Invalid value for '{name}': token ids must be >= 0.", name)
        return v

    def int_list(self, name: str) -> list[int]:
        v = self._rest.pop(name, None)
        return [] if v is None else self.token_ids(name, v)

    def off(self, name: str, is_off: Callable[[Any], bool], what: str) -> None:
        """An OpenAI field we do not implement: fine at its 'off' value, a clear 400 otherwise."""
        v = self._rest.pop(name, None)
        if v is not None and not is_off(v):
            raise bad_request(f"'{name}' is not supported by this server ({what}).", name)

    def ignore(self, *names: str) -> None:
        """Fields that only carry client bookkeeping (user, metadata, ...): accepted, unused."""
        for n in names:
            self._rest.pop(n, None)

    def finish(self) -> None:
        if self._rest:
            name = sorted(self._rest)[0]
            raise bad_request(f"Unrecognized request argument supplied: {name}", name)


# -- shared sampling fields ---------------------------------------------------------------------------
@dataclass
class SamplingFields:
    """Sampling knobs common to both endpoints; None = not given (server/model default applies)."""

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # response_format / structured_outputs (structured_outputs_fields.py), and which field it came from
    structured_outputs: StructuredOutputsParams | None = None
    structured_outputs_param: str = "response_format"

    @classmethod
    def read(cls, b: _Body) -> "SamplingFields":
        n = b.int("n", 1, lo=1, hi=MAX_N)
        constraint, constraint_param = read_structured_outputs(b.raw("response_format"), b.raw("structured_outputs"))
        # SGLang's name for include_stop_str_in_output (its router adds it to every request).
        no_stop_trim = b.bool("no_stop_trim", False)
        return cls(
            n=n,
            temperature=b.float("temperature", None, lambda v: v >= 0, ">= 0"),
            top_p=b.float("top_p", None, lambda v: 0 < v <= 1, "in (0, 1]"),
            top_k=b.int("top_k", None, lo=-1),
            min_p=b.float("min_p", None, lambda v: 0 <= v <= 1, "in [0, 1]"),
            presence_penalty=b.float("presence_penalty", 0.0, lambda v: -2 <= v <= 2, "in [-2, 2]"),
            frequency_penalty=b.float("frequency_penalty", 0.0, lambda v: -2 <= v <= 2, "in [-2, 2]"),
            repetition_penalty=b.float("repetition_penalty", None, lambda v: v > 0, "> 0"),
            # The engine seeds sample i of n with seed + i, so leave room above.
            seed=b.int("seed", None, lo=INT64_MIN, hi=INT64_MAX - MAX_N),
            stop=b.stop("stop"),
            stop_token_ids=b.int_list("stop_token_ids"),
            ignore_eos=b.bool("ignore_eos", False),
            min_tokens=b.int("min_tokens", 0, lo=0),
            skip_special_tokens=b.bool("skip_special_tokens", True),
            spaces_between_special_tokens=b.bool("spaces_between_special_tokens", True),
            include_stop_str_in_output=b.bool("include_stop_str_in_output", no_stop_trim),
            structured_outputs=constraint,
            structured_outputs_param=constraint_param,
        )

    def to_params(
        self, max_tokens: int | None, logprobs: int | None, defaults: dict[str, Any], prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """defaults: the checkpoint's generation_config sampling values, used where the request is silent."""

        def pick(name: str, value: Any, fallback: Any) -> Any:
            return value if value is not None else defaults.get(name, fallback)

        if max_tokens is not None and self.min_tokens > max_tokens:
            raise bad_request(
                f"Invalid value for 'min_tokens': it must be <= max_tokens ({max_tokens}), got {self.min_tokens}.",
                "min_tokens",
            )
        try:
            return SamplingParams(
                n=self.n,
                temperature=float(pick("temperature", self.temperature, 1.0)),
                top_p=float(pick("top_p", self.top_p, 1.0)),
                top_k=int(pick("top_k", self.top_k, 0)),
                min_p=float(pick("min_p", self.min_p, 0.0)),
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=float(pick("repetition_penalty", self.repetition_penalty, 1.0)),
                seed=self.seed,
                stop=list(self.stop),
                stop_token_ids=list(self.stop_token_ids),
                ignore_eos=self.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                output_kind=RequestOutputKind.DELTA,  # the server accumulates; streaming needs deltas
                structured_outputs=self.structured_outputs,
            )
        except ValueError as e:  # anything the per-field checks above did not already catch
            raise bad_request(str(e)) from e


@dataclass
class StreamOptions:
    include_usage: bool = False
    continuous_usage_stats: bool = False

    @classmethod
    def read(cls, b: _Body, stream: bool) -> "StreamOptions":
        v = b.raw("stream_options")
        if v is None:
            return cls()
        if not stream:
            raise bad_request("Invalid value for 'stream_options': it is only allowed when 'stream' is true.",
                              "stream_options")
        o = _Body(v, "'stream_options' field")
        opts = cls(o.bool("include_usage", False), o.bool("continuous_usage_stats", False))
        try:
            o.finish()
        except OpenAIError as e:
            e.param = f"stream_options.{e.param}"
            raise
        return opts


def _read_common(b: _Body) -> dict[str, Any]:
    stream = b.bool("stream", False)
    return dict(
        model=b.str("model"),
        stream=stream,
        stream_options=StreamOptions.read(b, stream),
        cache_salt=b.str("cache_salt", None, non_empty=True),
        return_token_ids=b.bool("return_token_ids", False),
    )


def _sglang_fields(b: _Body) -> None:
    """Fields SGLang's router (sglang-router) adds to what it forwards: accepted at their values
    that mean nothing here. Without a reasoning parser there is no reasoning to separate or
    stream apart, so separate_reasoning / stream_reasoning change nothing (as in SGLang)."""
    b.bool("separate_reasoning")
    b.bool("stream_reasoning")
    b.off("return_hidden_states", lambda v: v is False, "hidden states are not returned")


def _no_logit_bias(b: _Body) -> None:
    b.off("logit_bias", lambda v: v == {}, "logit_bias is not implemented")


# -- /v1/completions --------------------------------------------------------------------------------
Prompt = str | list[int]


@dataclass
class CompletionRequest:
    prompts: list[Prompt]
    model: str | None = None
    max_tokens: int | None = 16  # OpenAI's and vLLM's default for completions
    echo: bool = False
    logprobs: int | None = None
    stream: bool = False
    stream_options: StreamOptions = field(default_factory=StreamOptions)
    cache_salt: str | None = None
    return_token_ids: bool = False
    sampling: SamplingFields = field(default_factory=SamplingFields)

    @classmethod
    def parse(cls, body: Any) -> "CompletionRequest":
        b = _Body(body)
        if "prompt" not in body or body["prompt"] is None:
            raise bad_request("Missing required parameter: 'prompt'.", "prompt")
        prompts = _read_prompts(b, b.raw("prompt"))
        common = _read_common(b)
        req = cls(
            prompts=prompts,
            max_tokens=b.int("max_tokens", 16, lo=1),
            echo=b.bool("echo", False),
            logprobs=b.int("logprobs", None, lo=0, hi=MAX_LOGPROBS),
            sampling=SamplingFields.read(b),
            **common,
        )
        b.off("best_of", lambda v: v == req.sampling.n, "best_of is not implemented; use n")
        b.off("suffix", lambda v: v == "", "suffix (insertion) is not implemented")
        _no_logit_bias(b)
        _sglang_fields(b)
        b.ignore("user")
        b.finish()
        return req


def _read_prompts(b: _Body, v: Any) -> list[Prompt]:
    """OpenAI's four prompt forms: str, [str, ...], [int, ...], [[int, ...], ...]."""
    if isinstance(v, str):
        prompts: list[Prompt] = [v]
    elif isinstance(v, list) and v and all(isinstance(p, str) for p in v):
        prompts = list(v)
    elif isinstance(v, list) and v and all(isinstance(p, list) for p in v):
        prompts = [b.token_ids("prompt", p) for p in v]
    elif isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        prompts = [b.token_ids("prompt", v)]
    elif isinstance(v, list) and not v:
        raise bad_request("Invalid value for 'prompt': it must not be empty.", "prompt")
    else:
        raise _type_error("prompt", "a string, an array of strings, an array of integers or an array of "
                          "integer arrays", v)
    if len(prompts) > MAX_BATCH_PROMPTS:
        raise bad_request(f"Invalid value for 'prompt': at most {MAX_BATCH_PROMPTS} prompts per request.", "prompt")
    if any(len(p) == 0 for p in prompts):
        raise bad_request("Invalid value for 'prompt': prompts must not be empty.", "prompt")
    return prompts


# -- /v1/chat/completions ---------------------------------------------------------------------------
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class ChatCompletionRequest:
    messages: list[dict[str, Any]]  # normalised: role + string content (+ name, tool_calls, tool_call_id)
    model: str | None = None
    max_tokens: int | None = None  # None = whatever room the context leaves
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    stream: bool = False
    stream_options: StreamOptions = field(default_factory=StreamOptions)
    cache_salt: str | None = None
    return_token_ids: bool = False
    sampling: SamplingFields = field(default_factory=SamplingFields)
    tools: ToolRequest = field(default_factory=lambda: ToolRequest([], "none"))

    @classmethod
    def parse(cls, body: Any) -> "ChatCompletionRequest":
        b = _Body(body)
        if "messages" not in body or body["messages"] is None:
            raise bad_request("Missing required parameter: 'messages'.", "messages")
        messages = _read_messages(b.raw("messages"))
        common = _read_common(b)
        max_completion = b.int("max_completion_tokens", None, lo=1)
        max_tokens = b.int("max_tokens", None, lo=1)  # deprecated by OpenAI; the newer field wins
        logprobs = b.bool("logprobs", False)
        top_logprobs = b.int("top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
        if top_logprobs and not logprobs:
            raise bad_request("Invalid value for 'top_logprobs': 'logprobs' must be true to use it.", "top_logprobs")
        req = cls(
            messages=messages,
            max_tokens=max_completion if max_completion is not None else max_tokens,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            add_generation_prompt=b.bool("add_generation_prompt", True),
            sampling=SamplingFields.read(b),
            **common,
        )
        req.tools = read_tools(b.raw("tools"), b.raw("tool_choice"), b.raw("parallel_tool_calls"))
        if req.tools.constrained and req.sampling.structured_outputs is not None:
            raise bad_request(f"'{req.sampling.structured_outputs_param}' cannot be combined with tool_choice "
                              f"{req.tools.choice!r}: the answer is the tool calls.", "tool_choice")
        _no_logit_bias(b)
        _sglang_fields(b)
        b.off("functions", lambda v: v == [], "function calling is not implemented")
        b.off("function_call", lambda v: v == "none", "function calling is not implemented")
        b.off("modalities", lambda v: v == ["text"], "only text output is implemented")
        b.off("echo", lambda v: v is False, "echo is a /v1/completions option")
        b.off("continue_final_message", lambda v: v is False, "not implemented")
        b.off("chat_template", lambda v: False, "user-supplied templates are disabled; start the server "
              "with --chat-template instead")
        b.off("chat_template_kwargs", lambda v: v == {}, "user-supplied template arguments are disabled")
        for name in ("audio", "prediction", "reasoning_effort", "web_search_options", "verbosity"):
            b.off(name, lambda v: False, "not implemented")
        b.ignore("user", "store", "metadata", "service_tier", "prompt_cache_key",
                 "safety_identifier")
        b.finish()
        return req


def _read_messages(v: Any) -> list[dict[str, str]]:
    if not isinstance(v, list):
        raise _type_error("messages", "an array of message objects", v)
    if not v:
        raise bad_request("Invalid value for 'messages': it must contain at least one message.", "messages")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _type_error(where, "an object", m)
        role = m.get("role")
        if not isinstance(role, str):
            raise _type_error(f"{where}.role", "a string", role) if role is not None else bad_request(
                f"Missing required parameter: '{where}.role'.", f"{where}.role")
        if role not in CHAT_ROLES:
            raise bad_request(f"Invalid value for '{where}.role': expected one of {', '.join(CHAT_ROLES)}, "
                              f"but got {show(role)} instead.", f"{where}.role")
        msg: dict[str, Any] = {"role": role, "content": _message_text(where, role, m)}
        if m.get("tool_calls"):
            if role != "assistant":
                raise bad_request(f"'{where}.tool_calls' belongs to assistant messages.", f"{where}.tool_calls")
            msg["tool_calls"] = read_assistant_tool_calls(where, m["tool_calls"])
        if role == "tool" and m.get("tool_call_id") is not None:
            if not isinstance(m["tool_call_id"], str):
                raise _type_error(f"{where}.tool_call_id", "a string", m["tool_call_id"])
            msg["tool_call_id"] = m["tool_call_id"]
        name = m.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise _type_error(f"{where}.name", "a string", name)
            msg["name"] = name
        out.append(msg)
    return out


def _message_text(where: str, role: str, m: dict) -> str:
    """String content, or text parts joined with newlines (vLLM's rule); images etc. are refused."""
    if "content" not in m:
        raise bad_request(f"Missing required parameter: '{where}.content'.", f"{where}.content")
    content = m["content"]
    if content is None:
        if role == "assistant":
            return ""
        raise _type_error(f"{where}.content", "a string or an array of content parts", content)
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _type_error(f"{where}.content", "a string or an array of content parts", content)
    texts = []
    for j, part in enumerate(content):
        pw = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise _type_error(pw, "an object", part)
        if part.get("type") != "text":
            raise bad_request(f"Invalid value for '{pw}.type': only 'text' content parts are supported, "
                              f"got {show(part.get('type'))}.", f"{pw}.type")
        if not isinstance(part.get("text"), str):
            raise _type_error(f"{pw}.text", "a string", part.get("text"))
        texts.append(part["text"])
    return "\n".join(texts)


# -- /tokenize and /detokenize ------------------------------------------------------------------------
@dataclass
class TokenizeRequest:
    model: str | None
    prompt: str | None
    messages: list[dict[str, str]] | None
    add_special_tokens: bool
    add_generation_prompt: bool
    return_token_strs: bool

    @classmethod
    def parse(cls, body: Any) -> "TokenizeRequest":
        b = _Body(body)
        has_prompt, has_messages = b.has("prompt"), b.has("messages")
        if has_prompt == has_messages:
            raise bad_request("Pass exactly one of 'prompt' or 'messages'.", "prompt")
        messages = _read_messages(b.raw("messages")) if has_messages else None
        req = cls(
            model=b.str("model"),
            prompt=b.str("prompt"),
            messages=messages,
            # A rendered chat template already holds its BOS (see apply_chat_template).
            add_special_tokens=b.bool("add_special_tokens", not has_messages),
            add_generation_prompt=b.bool("add_generation_prompt", True),
            return_token_strs=b.bool("return_token_strs", False),
        )
        b.finish()
        return req


@dataclass
class DetokenizeRequest:
    model: str | None
    tokens: list[int]

    @classmethod
    def parse(cls, body: Any) -> "DetokenizeRequest":
        b = _Body(body)
        if not b.has("tokens"):
            raise bad_request("Missing required parameter: 'tokens'.", "tokens")
        req = cls(model=b.str("model"), tokens=b.token_ids("tokens", b.raw("tokens")))
        b.finish()
        return req

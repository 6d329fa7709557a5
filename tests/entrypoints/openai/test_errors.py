"""A catalogue of bad requests: each gets the documented status and an OpenAI error body naming the
problem, and the server keeps serving good requests afterwards (400 for all validation, never 422)."""
from __future__ import annotations

import json

import pytest

from server_harness import MAX_MODEL_LEN, MODEL

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]
LONG = "the quick brown fox jumps over the lazy dog " * 40  # well over MAX_MODEL_LEN tokens


def comp(**kw):
    return {"model": MODEL, "prompt": "hello", "max_tokens": 2, **kw}


def chat(**kw):
    return {"model": MODEL, "messages": MSGS, "max_tokens": 2, **kw}


# (id, method, path, body, headers, auth, status, param, message fragment)
CASES = [
    ("malformed-json", "POST", C, b'{"prompt": "x", ', None, True, 400, None, "parse the JSON"),
    ("empty-body", "POST", C, b"", None, True, 400, None, "empty"),
    ("body-not-object", "POST", C, b"[1, 2]", None, True, 400, None, "JSON object"),
    ("nan-constant", "POST", C, b'{"prompt": "x", "temperature": NaN}', None, True, 400, None, "NaN"),
    ("invalid-utf8", "POST", C, b'{"prompt": "\xff\xfe"}', None, True, 400, None, "parse"),
    ("missing-prompt", "POST", C, {"model": MODEL}, None, True, 400, "prompt", "prompt"),
    ("prompt-wrong-type", "POST", C, comp(prompt=123), None, True, 400, "prompt", "Invalid type"),
    ("prompt-empty-string", "POST", C, comp(prompt=""), None, True, 400, "prompt", "empty"),
    ("prompt-empty-list", "POST", C, comp(prompt=[]), None, True, 400, "prompt", "empty"),
    ("prompt-mixed-list", "POST", C, comp(prompt=["a", 1]), None, True, 400, "prompt", "Invalid type"),
    ("prompt-negative-token", "POST", C, comp(prompt=[1, -2]), None, True, 400, "prompt", ">= 0"),
    ("prompt-token-out-of-vocab", "POST", C, comp(prompt=[10**9]), None, True, 400, None, "token ids"),
    ("prompt-too-long", "POST", C, comp(prompt=LONG), None, True, 400, "prompt", "maximum context length"),
    ("max-tokens-string", "POST", C, comp(max_tokens="10"), None, True, 400, "max_tokens", "Invalid type"),
    ("max-tokens-bool", "POST", C, comp(max_tokens=True), None, True, 400, "max_tokens", "Invalid type"),
    ("max-tokens-zero", "POST", C, comp(max_tokens=0), None, True, 400, "max_tokens", ">= 1"),
    ("max-tokens-negative", "POST", C, comp(max_tokens=-5), None, True, 400, "max_tokens", ">= 1"),
    ("max-tokens-huge", "POST", C, comp(max_tokens=10**9), None, True, 400, "max_tokens",
     "maximum context length"),
    ("temperature-negative", "POST", C, comp(temperature=-1), None, True, 400, "temperature", ">= 0"),
    ("temperature-string", "POST", C, comp(temperature="hot"), None, True, 400, "temperature", "Invalid type"),
    ("top-p-zero", "POST", C, comp(top_p=0), None, True, 400, "top_p", "(0, 1]"),
    ("top-p-above-one", "POST", C, comp(top_p=1.5), None, True, 400, "top_p", "(0, 1]"),
    ("top-k-below-minus-one", "POST", C, comp(top_k=-2), None, True, 400, "top_k", ">= -1"),
    ("min-p-above-one", "POST", C, comp(min_p=2), None, True, 400, "min_p", "[0, 1]"),
    ("n-zero", "POST", C, comp(n=0), None, True, 400, "n", "[1, 128]"),
    ("n-huge", "POST", C, comp(n=100000), None, True, 400, "n", "[1, 128]"),
    ("n-fraction", "POST", C, comp(n=1.5), None, True, 400, "n", "Invalid type"),
    ("presence-penalty-out-of-range", "POST", C, comp(presence_penalty=3), None, True, 400, "presence_penalty",
     "[-2, 2]"),
    ("frequency-penalty-out-of-range", "POST", C, comp(frequency_penalty=-3), None, True, 400,
     "frequency_penalty", "[-2, 2]"),
    ("repetition-penalty-zero", "POST", C, comp(repetition_penalty=0), None, True, 400, "repetition_penalty",
     "> 0"),
    ("logprobs-too-many", "POST", C, comp(logprobs=50), None, True, 400, "logprobs", "[0, 20]"),
    ("stop-not-strings", "POST", C, comp(stop=[1, 2]), None, True, 400, "stop", "Invalid type"),
    ("stop-empty-string", "POST", C, comp(stop=[""]), None, True, 400, "stop", "empty"),
    ("stream-not-bool", "POST", C, comp(stream="yes"), None, True, 400, "stream", "Invalid type"),
    ("stream-options-without-stream", "POST", C, comp(stream_options={"include_usage": True}), None, True, 400,
     "stream_options", "only allowed"),
    ("stream-options-unknown-key", "POST", C, comp(stream=True, stream_options={"usage": True}), None, True, 400,
     "stream_options.usage", "Unrecognized"),
    ("unknown-field", "POST", C, comp(max_token=5), None, True, 400, "max_token", "Unrecognized request argument"),
    ("seed-string", "POST", C, comp(seed="abc"), None, True, 400, "seed", "Invalid type"),
    ("min-tokens-over-max", "POST", C, comp(min_tokens=5, max_tokens=2), None, True, 400, "min_tokens", "<="),
    ("ignore-eos-string", "POST", C, comp(ignore_eos="true"), None, True, 400, "ignore_eos", "Invalid type"),
    ("cache-salt-empty", "POST", C, comp(cache_salt=""), None, True, 400, "cache_salt", "empty"),
    ("suffix-unsupported", "POST", C, comp(suffix="tail"), None, True, 400, "suffix", "not supported"),
    ("unknown-model", "POST", C, comp(model="gpt-4"), None, True, 404, "model", "does not exist"),
    ("chat-missing-messages", "POST", CHAT, {"model": MODEL}, None, True, 400, "messages", "messages"),
    ("chat-empty-messages", "POST", CHAT, chat(messages=[]), None, True, 400, "messages", "at least one"),
    ("chat-message-not-object", "POST", CHAT, chat(messages=["hi"]), None, True, 400, "messages[0]",
     "Invalid type"),
    ("chat-unknown-role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), None, True, 400,
     "messages[0].role", "expected one of"),
    ("chat-content-int", "POST", CHAT, chat(messages=[{"role": "user", "content": 5}]), None, True, 400,
     "messages[0].content", "Invalid type"),
    ("chat-image-part", "POST", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), None, True, 400,
     "messages[0].content[0].type", "only 'text'"),
    ("chat-top-logprobs-without-logprobs", "POST", CHAT, chat(top_logprobs=2), None, True, 400, "top_logprobs",
     "'logprobs' must be true"),
    ("chat-top-logprobs-too-many", "POST", CHAT, chat(logprobs=True, top_logprobs=21), None, True, 400,
     "top_logprobs", "[0, 20]"),
    ("chat-tools-unsupported", "POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), None,
     True, 400, "tools", "not supported"),
    ("chat-template-refused", "POST", CHAT, chat(chat_template="{{ 7 * 7 }}"), None, True, 400, "chat_template",
     "disabled"),
    ("chat-context-overflow", "POST", CHAT, chat(max_completion_tokens=MAX_MODEL_LEN), None, True, 400,
     "max_tokens", "in the messages"),
    ("missing-api-key", "POST", C, comp(), None, False, 401, None, "Missing API key"),
    ("wrong-api-key", "POST", C, comp(), {"Authorization": "Bearer nope"}, False, 401, None, "Incorrect API key"),
    ("models-need-api-key", "GET", "/v1/models", None, None, False, 401, None, "API key"),
    ("tokenize-needs-api-key", "POST", "/tokenize", {"prompt": "x"}, None, False, 401, None, "API key"),
    ("oversized-body", "POST", C, json.dumps(comp(prompt="x" * (2 << 20))).encode(), None, True, 413, None,
     "too large"),
    ("unknown-route", "GET", "/v1/does-not-exist", None, None, True, 404, None, "Not Found"),
    ("wrong-method", "GET", C, None, None, True, 405, None, "not allowed"),
    ("tokenize-prompt-and-messages", "POST", "/tokenize", {"prompt": "x", "messages": MSGS}, None, True, 400,
     "prompt", "exactly one"),
    ("detokenize-out-of-vocab", "POST", "/detokenize", {"tokens": [10**9]}, None, True, 400, "tokens", "< "),
    ("detokenize-not-ints", "POST", "/detokenize", {"tokens": "abc"}, None, True, 400, "tokens", "Invalid type"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_status_and_openai_error_body(srv, case):
    _, method, path, body, headers, auth, status, param, fragment = case
    got, hdrs, raw = srv.request(method, path, body, headers=headers, auth=auth)
    assert got == status, raw
    assert hdrs["Content-Type"].startswith("application/json")
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status
    assert err["type"] == {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                           405: "MethodNotAllowedError", 413: "RequestEntityTooLargeError"}[status]
    assert fragment in err["message"], err["message"]
    if param is not None:
        assert err["param"] == param


def test_catalogue_is_large_enough():
    assert len(CASES) >= 30


def test_context_overflow_message_is_vllms_exact_wording(srv):
    status, _, raw = srv.request("POST", CHAT, chat(max_tokens=MAX_MODEL_LEN))
    assert status == 400
    msg = json.loads(raw)["error"]["message"]
    n_prompt = json.loads(srv.request("POST", "/tokenize", {"messages": MSGS})[2])["count"]
    assert msg == (
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
        f"{n_prompt + MAX_MODEL_LEN} tokens ({n_prompt} in the messages, {MAX_MODEL_LEN} in the completion). "
        "Please reduce the length of the messages or completion."
    )


def test_openai_client_raises_typed_errors(client):
    import openai

    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSGS)


def test_server_still_serves_after_the_catalogue(client):
    resp = client.completions.create(model=MODEL, prompt="hello", max_tokens=3, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 3 and resp.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3, stream=True)
    assert any(c.choices and c.choices[0].finish_reason for c in stream)

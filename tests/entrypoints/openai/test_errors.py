"""A catalogue of bad requests: each gets the documented status and an OpenAI error body naming the
problem, and the server keeps serving good requests afterwards (400 for all validation, never 422).
Then what a hostile or careless client can do beyond one bad body: slow or huge uploads, too many
connections, a full queue, work meant to stall the event loop; and the auth and /v1/models details."""
from __future__ import annotations

import contextlib
import gc
import http.client
import json
import socket
import threading
import time

import pytest

from hybridkv.entrypoints.openai.errors import OpenAIError
from hybridkv.entrypoints.openai.serving_base import TEXT_BYTES_SAFETY_FACTOR, longest_token_bytes
from hybridkv.model_executor.tokenizer import load_tokenizer
from server_harness import API_KEY, MAX_MODEL_LEN, MODEL, launch

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]
LONG = "the quick brown fox jumps over the lazy dog " * 40  # well over MAX_MODEL_LEN tokens
# Over the size pre-check of a 256-token context (256 x 13 bytes, the tiny vocabulary's longest
# token, x 2) but tokenizable: without the pre-check these get the "input tokens" 400 instead.
TOO_MANY_BYTES = "hello " * 2000


def comp(**kw):
    return {"model": MODEL, "prompt": "hello", "max_tokens": 2, **kw}


def chat(**kw):
    return {"model": MODEL, "messages": MSGS, "max_tokens": 2, **kw}


def body(text: str) -> bytes:
    """A raw body: JSON text whose `\\ud800` escapes json.dumps could not produce from a str."""
    return text.encode("utf-8")


UNICODE = "not valid Unicode"


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
    ("prompt-token-out-of-vocab", "POST", C, comp(prompt=[10**9]), None, True, 400, "prompt", "token ids"),
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
    ("chat-tools-auto-without-the-server-flag", "POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]),
     None, True, 400, "tool_choice", "--enable-auto-tool-choice"),
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
    ("detokenize-longer-than-context", "POST", "/detokenize", {"tokens": [5] * (MAX_MODEL_LEN + 1)}, None, True,
     400, "tokens", f"at most {MAX_MODEL_LEN} token ids"),
    # -- text that is not Unicode: lone surrogates, as \u escapes or raw UTF-8-encoded bytes
    ("surrogate-in-prompt", "POST", C, body('{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}'), None,
     True, 400, "prompt", UNICODE),
    ("surrogate-in-prompt-list", "POST", C, body('{"model": "tiny", "prompt": ["ok", "\\udfff"], "max_tokens": 2}'),
     None, True, 400, "prompt[1]", UNICODE),
    ("surrogate-as-raw-utf8", "POST", C, b'{"model": "tiny", "prompt": "\xed\xa0\x80", "max_tokens": 2}', None, True,
     400, "prompt", UNICODE),
    ("surrogate-in-chat-content", "POST", CHAT,
     body('{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}'), None, True,
     400, "messages[0].content", UNICODE),
    ("surrogate-in-chat-content-part", "POST", CHAT,
     body('{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "x\\udbff"}]}]}'),
     None, True, 400, "messages[0].content[0].text", UNICODE),
    ("surrogate-in-tokenize-prompt", "POST", "/tokenize", body('{"prompt": "\\ud800"}'), None, True, 400, "prompt",
     UNICODE),
    ("surrogate-in-model", "POST", C, body('{"model": "\\ud800", "prompt": "hi", "max_tokens": 2}'), None, True,
     400, "model", UNICODE),
    ("surrogate-in-key", "POST", C, body('{"model": "tiny", "prompt": "hi", "\\ud800": 1}'), None, True, 400,
     None, "key"),
    ("surrogate-in-nested-key", "POST", C,
     body('{"model": "tiny", "prompt": "hi", "stream": true, "stream_options": {"\\udc00x": true}}'), None, True,
     400, "stream_options", "key"),
    ("surrogate-in-stop", "POST", C, body('{"model": "tiny", "prompt": "hi", "stop": ["\\ud800"]}'), None, True,
     400, "stop[0]", UNICODE),
    # -- pathological JSON
    ("json-nested-100k-deep", "POST", C, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, True, 400,
     None, "nested too deeply"),
    ("json-nested-5k-deep-small-body", "POST", C, b"[" * 5_000 + b"]" * 5_000, None, True, 400, None,
     "nested too deeply"),
    ("json-number-1e400", "POST", C, body('{"model": "tiny", "prompt": "hi", "temperature": 1e400}'), None, True, 400,
     None, "out of range"),
    ("json-int-100k-digits", "POST", C, body('{"model": "tiny", "prompt": "hi", "max_tokens": 1' + "0" * 100_000 + "}"),
     None, True, 400, None, "4300 digits"),
    ("int-past-float-range", "POST", C, body('{"model": "tiny", "prompt": "hi", "temperature": 1' + "0" * 400 + "}"),
     None, True, 400, "temperature", "expected a value"),
    # -- admission and context
    ("too-many-sequences", "POST", C, comp(prompt=["a"] * 1024, n=2), None, True, 400, "n",
     "2048 sequences (1024 prompts x n=2), more than the 1024"),
    ("min-tokens-past-context-chat", "POST", CHAT, {"model": MODEL, "messages": MSGS, "min_tokens": 10**12}, None,
     True, 400, "min_tokens", "maximum context length"),
    ("min-tokens-past-context-completion", "POST", C, comp(min_tokens=MAX_MODEL_LEN, max_tokens=None), None, True,
     400, "min_tokens", "maximum context length"),
    ("prompt-over-size-precheck", "POST", C, comp(prompt=TOO_MANY_BYTES), None, True, 400, "prompt", "bytes long"),
    ("prompt-list-over-size-precheck", "POST", C, comp(prompt=["hi", TOO_MANY_BYTES]), None, True, 400, "prompt",
     "bytes long"),
    ("chat-over-size-precheck", "POST", CHAT, chat(messages=[{"role": "user", "content": TOO_MANY_BYTES}]), None,
     True, 400, "messages", "bytes long"),
    ("tokenize-over-size-precheck", "POST", "/tokenize", {"prompt": TOO_MANY_BYTES}, None, True, 400, "prompt",
     "bytes long"),
    ("content-length-over-limit", "POST", C, b"{}", {"Content-Length": str(2**63 - 1)}, True, 413, None,
     "too large"),
    # -- auth
    ("wrong-auth-scheme", "POST", C, comp(), {"Authorization": f"Basic {API_KEY}"}, False, 401, None, "scheme"),
    ("undecodable-api-key", "POST", C, comp(), {"Authorization": b"Bearer \xff\xfe"}, False, 401, None,
     "Incorrect API key"),
]


TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
         408: "RequestTimeoutError", 413: "RequestEntityTooLargeError", 503: "ServiceUnavailableError"}


def check_error(status: int, headers: dict, raw: bytes, expected: int) -> dict:
    """The OpenAI error body, exactly: {"error": {"message", "type", "param", "code"}}."""
    assert status == expected, raw
    assert headers["Content-Type"].startswith("application/json")
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == expected and err["type"] == TYPES[expected]
    return err


def check_still_serves(srv) -> None:
    status, _, raw = srv.request("POST", C, comp(max_tokens=1))
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 1, raw


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_status_and_openai_error_body(srv, case):
    _, method, path, body, headers, auth, status, param, fragment = case
    err = check_error(*srv.request(method, path, body, headers=headers, auth=auth), status)
    assert fragment in err["message"], err["message"]
    if param is not None:
        assert err["param"] == param
    check_still_serves(srv)


def test_catalogue_is_large_enough():
    assert len(CASES) >= 30
    assert len({c[0] for c in CASES}) == len(CASES)


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


def test_error_response_escapes_what_it_echoes():
    """The error path never fails: a lone surrogate in an echoed name cannot be UTF-8 encoded."""
    resp = OpenAIError("The model `\ud800` does not exist.", 404, "mo\udfffdel").response()
    err = json.loads(resp.body)["error"]
    assert err["message"] == "The model `\\ud800` does not exist." and err["param"] == "mo\\udfffdel"
    assert resp.body.isascii()


# -- auth details and the model card -----------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_bearer_scheme_is_case_insensitive(srv, scheme):
    status, _, raw = srv.request("GET", "/v1/models", headers={"Authorization": f"{scheme} {API_KEY}"}, auth=False)
    assert status == 200, raw
    status, _, _ = srv.request("GET", "/v1/models", headers={"Authorization": f"{scheme} {API_KEY}x"}, auth=False)
    assert status == 401


def test_open_routes_without_a_key_are_exactly_health_version_metrics(srv):
    for path in ("/health", "/version", "/metrics"):
        assert srv.request("GET", path, auth=False)[0] == 200, path
    for method, path in (("GET", "/v1/models"), ("GET", f"/v1/models/{MODEL}"), ("POST", C), ("POST", CHAT),
                         ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/v1")):
        assert srv.request(method, path, {}, auth=False)[0] == 401, path


def test_model_card_root_is_the_served_name_not_the_checkpoint_path(srv, tiny_ckpt):
    status, _, raw = srv.request("GET", "/v1/models")
    cards = json.loads(raw)["data"]
    assert status == 200 and [c["root"] for c in cards] == [MODEL, MODEL]
    path = tiny_ckpt("llama")
    assert path not in raw.decode() and path not in srv.request("GET", "/v1/models/tiny-alias")[2].decode()


# -- a server with short timeouts and a small connection cap -------------------------------------------
HARD_LEN = 16384  # a context long enough that a text under its size pre-check takes ~0.5 s to tokenize
HARD_CONNECTIONS = 6
TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def hardened(tiny_ckpt):
    ckpt = tiny_ckpt("llama", max_position_embeddings=HARD_LEN)
    handle = launch(ckpt, max_request_body_bytes=8 << 20, max_model_len=HARD_LEN,
                    settings=dict(keepalive_timeout=TIMEOUT_S, body_timeout=TIMEOUT_S,
                                  max_connections=HARD_CONNECTIONS, metrics_require_api_key=True))
    handle.max_text_bytes = HARD_LEN * longest_token_bytes(load_tokenizer(ckpt)) * TEXT_BYTES_SAFETY_FACTOR
    yield handle
    handle.stop()


@pytest.fixture
def hard(hardened):
    _wait_for(lambda: hardened.open_connections() == 0)  # what earlier tests left has been closed
    yield hardened
    hardened.engine.check_idle(timeout=15)


def _wait_for(cond, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def _connect(srv) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.port), timeout=10)


def _until_closed(sock: socket.socket, timeout: float = 10.0) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    start = time.monotonic()
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data, time.monotonic() - start


def _read_response(sock: socket.socket, timeout: float = 10.0) -> tuple[int, dict, bytes, float]:
    start = time.monotonic()
    sock.settimeout(timeout)
    resp = http.client.HTTPResponse(sock)
    resp.begin()
    raw = resp.read()
    return resp.status, dict(resp.getheaders()), raw, time.monotonic() - start


HEAD = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        "Content-Type: application/json\r\n").encode()


def test_half_sent_header_is_closed_after_the_keepalive_timeout(hard):
    # Trickling header lines does not reset the timer (aiohttp arms it at connection start).
    sock = _connect(hard)
    sock.sendall(HEAD)
    start = time.monotonic()
    for _ in range(3):
        time.sleep(0.2)
        sock.sendall(b"X-Slow: 1\r\n")
    data, _ = _until_closed(sock)
    elapsed = time.monotonic() - start
    sock.close()
    assert data == b"" and 0.5 < elapsed < TIMEOUT_S + 2, elapsed
    check_still_serves(hard)


def test_idle_connection_is_closed_after_the_keepalive_timeout(hard):
    sock = _connect(hard)
    data, elapsed = _until_closed(sock)
    sock.close()
    assert data == b"" and 0.5 < elapsed < TIMEOUT_S + 2, elapsed


def test_half_sent_body_gets_408_and_the_connection_closes(hard):
    sock = _connect(hard)
    sock.sendall(HEAD + b"Content-Length: 100\r\n\r\n" + b'{"prompt": "hel')
    status, headers, raw, elapsed = _read_response(sock)
    err = check_error(status, headers, raw, 408)
    assert "1 seconds" in err["message"] and 0.5 < elapsed < TIMEOUT_S + 2, elapsed
    assert headers.get("Connection", "").lower() == "close"
    sock.close()
    check_still_serves(hard)


def test_huge_content_length_gets_413_before_any_body_is_read(hard):
    sock = _connect(hard)
    sock.sendall(HEAD + f"Content-Length: {2**63 - 1}\r\n\r\n".encode() + b"{}")
    status, headers, raw, elapsed = _read_response(sock)
    err = check_error(status, headers, raw, 413)
    # At once: well before the body timeout, which is what a read would have run into.
    assert "too large" in err["message"] and elapsed < TIMEOUT_S / 2, elapsed
    assert headers.get("Connection", "").lower() == "close"
    sock.close()
    check_still_serves(hard)


def test_connections_over_the_limit_are_closed_at_once(hard):
    held = [_connect(hard) for _ in range(HARD_CONNECTIONS)]
    try:
        _wait_for(lambda: hard.open_connections() == HARD_CONNECTIONS, timeout=TIMEOUT_S / 2)
        extra = _connect(hard)
        data, elapsed = _until_closed(extra)
        extra.close()
        # Closed at once, not by the keep-alive timeout that will close the held ones.
        assert data == b"" and elapsed < TIMEOUT_S / 2, elapsed
    finally:
        for sock in held:
            sock.close()
    _wait_for(lambda: hard.open_connections() == 0)
    check_still_serves(hard)


@contextlib.contextmanager
def health_probe(srv):
    """GET /health on fresh connections in a loop, in a thread; yields the list of latencies.

    The heap is frozen meanwhile, as `serve` freezes its startup heap (gc_pauses.py). This
    in-process server shares pytest's heap, which holds what every earlier test made: a full
    collection of it stopped every thread for 0.83 s once (the server's own log named it), a
    pause of the whole process that a probe would otherwise blame on the event loop."""
    latencies: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            start = time.monotonic()
            assert srv.request("GET", "/health", timeout=10)[0] == 200
            latencies.append(time.monotonic() - start)

    thread = threading.Thread(target=probe, daemon=True)
    gc.collect()
    gc.freeze()
    thread.start()
    try:
        _wait_for(lambda: len(latencies) >= 3)
        yield latencies
    finally:
        stop.set()
        thread.join(15)
        gc.unfreeze()


def test_8mib_prompt_gets_400_quickly_and_health_stays_responsive(hard):
    raw_body = json.dumps({"model": MODEL, "prompt": "hello " * 1_398_000, "max_tokens": 1}).encode()
    assert (8 << 20) - 4096 < len(raw_body) <= 8 << 20  # near the default body limit, under it
    with health_probe(hard) as latencies:
        before = len(latencies)
        start = time.monotonic()
        status, headers, raw = hard.request("POST", C, raw_body)
        elapsed = time.monotonic() - start
        during = latencies[before:]
    err = check_error(status, headers, raw, 400)
    # The size pre-check answers: tokenizing this text would take ~17 s with the tiny tokenizer.
    assert err["param"] == "prompt" and "bytes long" in err["message"] and elapsed < 3, (elapsed, err)
    assert during and max(during) < 0.1, max(during)
    check_still_serves(hard)


def test_tokenizing_runs_off_the_event_loop(hard):
    text = "hello " * 70_000  # ~0.5 s of tokenizer work on an idle core (one token per byte here)
    assert len(text) <= hard.max_text_bytes
    with health_probe(hard) as latencies:
        before = len(latencies)
        status, _, raw = hard.request("POST", "/tokenize", {"prompt": text})
        during = latencies[before:]
    assert status == 200 and json.loads(raw)["count"] >= 70_000
    # On the loop, /health would wait out the whole tokenization (~0.5 s); off it, a probe waits
    # at most for a GIL hand-over (measured <= 63 ms; the bound leaves room for a busy CI box).
    assert len(during) >= 5 and max(during) < 0.25, (len(during), max(during))


def test_metrics_can_require_the_api_key(hard):
    assert hard.request("GET", "/metrics", auth=False)[0] == 401
    status, _, raw = hard.request("GET", "/metrics")
    assert status == 200 and b"hybridkv:" in raw
    assert hard.request("GET", "/health", auth=False)[0] == 200


# -- a full engine queue ----------------------------------------------------------------------------------
@pytest.fixture
def one_slot(tiny_ckpt):
    """One running sequence at a time, one waiting at most, and steps slowed to >= 10 ms so a
    200-token request keeps the slot for seconds."""
    handle = launch(tiny_ckpt("llama"), max_num_seqs=1, max_queued_requests=1)

    def slow_down(engine) -> None:
        real = engine.step

        def step():
            time.sleep(0.01)
            return real()

        engine.step = step  # instance attribute: only this engine

    handle.engine.call_threadsafe(slow_down).result(10)
    yield handle
    handle.stop()


def test_full_queue_gets_503_with_retry_after(one_slot):
    srv = one_slot
    hold = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    hold.request("POST", C, json.dumps(comp(max_tokens=200, stream=True, ignore_eos=True)),
                 {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    stream = hold.getresponse()
    assert stream.status == 200 and stream.readline().startswith(b"data: ")  # it runs: the slot is taken
    waiting: dict = {}
    waiter = threading.Thread(target=lambda: waiting.update(r=srv.request("POST", C, comp(max_tokens=1))))
    waiter.start()
    _wait_for(lambda: srv.engine.snapshot().num_waiting == 1)  # the queue is full
    try:
        status, headers, raw = srv.request("POST", C, comp(max_tokens=1))
        err = check_error(status, headers, raw, 503)
        assert int(headers["Retry-After"]) >= 1 and "overloaded" in err["message"]
    finally:
        hold.close()  # the client goes away: its request is aborted, the waiting one runs
        waiter.join(60)
    assert waiting["r"][0] == 200
    check_still_serves(srv)
    srv.engine.check_idle(timeout=15)

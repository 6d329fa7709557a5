"""SGLang's native API on `hybridkv serve` (serving_native.py): the router's probes, the fields its
router adds to forwarded requests, /generate with SGLang's body (greedy text equal to the OpenAI
endpoint's), /flush_cache, and HTTP/2 (gRPC) probes answered with HTTP_1_1_REQUIRED."""
from __future__ import annotations

import json
import re
import socket

from server_harness import MODEL, sse_events
from hybridkv.entrypoints.openai.http2_probe import HTTP2_PREFACE, HTTP_1_1_REQUIRED

PROMPT = "the quick brown fox"
# What sglang-router 0.3.2 adds to every chat request it forwards (captured from the router).
ROUTER_CHAT_FIELDS = {"no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
                      "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
                      "return_hidden_states": False}


def _json(srv, method, path, body=None):
    status, _, raw = srv.request(method, path, body)
    return status, (json.loads(raw) if raw and raw[:1] in b"[{" else raw)


def test_the_routers_probes_answer(srv):
    for path in ("/get_model_info", "/model_info"):
        status, info = _json(srv, "GET", path)
        assert status == 200 and info["is_generation"] is True and info["served_model_name"] == MODEL
    for path in ("/get_server_info", "/server_info"):
        status, info = _json(srv, "GET", path)
        assert status == 200 and info["context_length"] > 0 and info["max_running_requests"] > 0


def test_the_fields_the_router_adds_are_accepted_and_unknown_ones_still_refused(srv):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4,
            **ROUTER_CHAT_FIELDS}
    status, resp = _json(srv, "POST", "/v1/chat/completions", body)
    assert status == 200, resp
    status, resp = _json(srv, "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4,
                                                         "no_stop_trim": False, "return_hidden_states": False})
    assert status == 200, resp
    status, resp = _json(srv, "POST", "/v1/chat/completions", {**body, "no_such_field": 1})
    assert status == 400 and resp["error"]["param"] == "no_such_field"
    status, resp = _json(srv, "POST", "/v1/chat/completions", {**body, "return_hidden_states": True})
    assert status == 400 and resp["error"]["param"] == "return_hidden_states"


def test_no_stop_trim_keeps_the_stop_string_as_include_stop_str_in_output(srv, client):
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    stop = first.choices[0].text[2:5]
    assert stop.strip(), "the generated text is too short to pick a stop string from"
    kept = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop],
                                     extra_body={"ignore_eos": True, "no_stop_trim": True})
    trimmed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True})
    assert kept.choices[0].text == trimmed.choices[0].text + stop


def test_generate_equals_the_completion_endpoint_whole_streamed_and_batched(srv, client):
    ref = client.completions.create(model=MODEL, prompt=[PROMPT, "a lighthouse"], max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    status, one = _json(srv, "POST", "/generate", {"text": PROMPT, "sampling_params": params})
    assert status == 200, one
    assert one["text"] == ref.choices[0].text and one["output_ids"] == ref.choices[0].token_ids
    assert one["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert one["meta_info"]["completion_tokens"] == 6 and one["meta_info"]["prompt_tokens"] > 0
    status, both = _json(srv, "POST", "/generate", {"text": [PROMPT, "a lighthouse"], "sampling_params": params})
    assert status == 200 and [r["text"] for r in both] == [c.text for c in ref.choices]
    ids = ref.choices[0].prompt_token_ids
    status, by_ids = _json(srv, "POST", "/generate", {"input_ids": ids, "sampling_params": params})
    assert status == 200 and by_ids["output_ids"] == ref.choices[0].token_ids
    status, _, raw = srv.request("POST", "/generate", {"text": PROMPT, "sampling_params": params, "stream": True})
    events = sse_events(raw)
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["text"] == ref.choices[0].text, "a streamed chunk carries the whole text so far"
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_generate_refuses_bad_bodies_with_the_field_named(srv):
    for body, param in [({"sampling_params": {}}, "text"),
                        ({"text": "x", "input_ids": [1]}, "text"),
                        ({"text": "x", "sampling_params": {"temperature": -1}}, "temperature"),
                        ({"text": "x", "sampling_params": {"structural_tag": "{}"}}, "structural_tag"),
                        ({"text": "x", "sampling_params": {"regex": "(a"}}, "sampling_params"),  # cannot compile
                        ({"text": "x", "sampling_params": {"max_new_token": 3}}, "max_new_token"),
                        ({"text": "x", "sampling_params": {"max_new_tokens": 100000}}, "max_tokens")]:
        status, resp = _json(srv, "POST", "/generate", body)
        assert status == 400 and resp["error"]["param"] == param, (body, resp)


def test_generate_constrains_the_output_with_regex_json_schema_and_ebnf(srv):
    for constraint, check in [({"regex": "a{2,4}b"}, lambda t: re.fullmatch("a{2,4}b", t)),
                              ({"json_schema": '{"enum": ["on", "off"]}'}, lambda t: json.loads(t) in ("on", "off")),
                              ({"ebnf": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no"))]:
        status, resp = _json(srv, "POST", "/generate", {"text": PROMPT, "sampling_params": {
            "max_new_tokens": 40, "temperature": 0, **constraint}})
        assert status == 200 and check(resp["text"]), (constraint, resp)
        assert resp["meta_info"]["finish_reason"]["type"] == "stop"


def test_flush_cache_drops_the_cached_prefixes(srv):
    params = {"max_new_tokens": 2, "temperature": 0}
    long_prompt = " ".join(["hybrid attention keeps long contexts cheap"] * 6)
    _json(srv, "POST", "/generate", {"text": long_prompt, "sampling_params": params})
    status, again = _json(srv, "POST", "/generate", {"text": long_prompt, "sampling_params": params})
    assert again["meta_info"]["cached_tokens"] > 0, "the second request should hit the prefix cache"
    status, _, raw = srv.request("POST", "/flush_cache")
    assert status == 200 and b"flushed" in raw
    status, after = _json(srv, "POST", "/generate", {"text": long_prompt, "sampling_params": params})
    assert after["meta_info"]["cached_tokens"] == 0, "the cache was not flushed"


def test_an_http2_probe_is_told_to_use_http1_and_the_server_keeps_serving(srv):
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(HTTP2_PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
    # SETTINGS (9-byte header, empty), then GOAWAY: 9-byte header, last stream id, error code.
    assert reply[3] == 0x4 and reply[9 + 3] == 0x7, reply
    assert int.from_bytes(reply[9 + 9 + 4: 9 + 9 + 8], "big") == HTTP_1_1_REQUIRED
    status, info = _json(srv, "GET", "/get_model_info")
    assert status == 200

"""The server through the official openai client: the OpenAI wire format, and greedy text equal to
the offline LLM's for the same prompts."""
from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from server_harness import MAX_MODEL_LEN, MODEL, launch, sse_events
from hybridkv.entrypoints import LLM, SamplingParams

PROMPTS = ["the quick brown fox", "a lighthouse keeper named Ada", "hybrid attention keeps"]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick brown fox"}]
GREEDY = dict(temperature=0, max_tokens=10)
EXTRA = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    """The offline LLM on the same checkpoint and settings (greedy, ignore_eos)."""
    llm = LLM(tiny_ckpt("llama"), max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    return llm, params


def test_completion_greedy_text_equals_offline_generate(client, reference):
    llm, params = reference
    ref = llm.generate(PROMPTS, params, use_tqdm=False)
    resp = client.completions.create(model=MODEL, prompt=PROMPTS, extra_body=EXTRA, **GREEDY)
    assert resp.object == "text_completion" and resp.model == MODEL
    assert [c.index for c in resp.choices] == [0, 1, 2]
    for c, r in zip(resp.choices, ref):
        assert c.text == r.outputs[0].text
        assert c.token_ids == r.outputs[0].token_ids
        assert c.finish_reason == "length"
    assert resp.usage.completion_tokens == 30
    assert resp.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in ref)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 30


def test_chat_greedy_text_equals_offline_chat(client, reference):
    llm, params = reference
    ref = llm.chat(CHAT, params, use_tqdm=False)[0]
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, extra_body=EXTRA, **GREEDY)
    assert resp.object == "chat.completion"
    msg = resp.choices[0].message
    assert msg.role == "assistant" and msg.content == ref.outputs[0].text
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == 10


def test_completion_stream_concatenates_to_the_non_stream_text(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[0], extra_body=EXTRA, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], stream=True,
                                            stream_options={"include_usage": True}, extra_body=EXTRA, **GREEDY))
    assert len({c.id for c in chunks}) == 1
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in content) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 10


def test_chat_stream_starts_with_role_and_ends_with_finish_reason_then_usage(client):
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, extra_body=EXTRA, **GREEDY)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, stream=True,
                                                 stream_options={"include_usage": True}, extra_body=EXTRA, **GREEDY))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in content) == whole.choices[0].message.content
    assert content[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_raw_sse_framing_is_data_events_then_done(srv):
    body = {"model": MODEL, "prompt": PROMPTS[0], "stream": True, **GREEDY}
    status, headers, raw = srv.request("POST", "/v1/completions", body)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(raw)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    assert all(json.loads(e)["object"] == "text_completion" for e in events[:-1])


def test_n2_returns_two_choices_streaming_and_not(client):
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[0], n=2, temperature=1.0, seed=7,
                                     max_tokens=6, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert resp.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, n=2, temperature=1.0, seed=7,
                                                 max_tokens=6, stream=True, extra_body={"ignore_eos": True}))
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length"}
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL, prompt=PROMPTS[1], temperature=1.0, top_p=0.9, seed=123, max_tokens=8,
              extra_body={"ignore_eos": True, "top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1})
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_stop_string_truncates_and_reports_stop(client):
    ref = client.completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0, max_tokens=24,
                                    extra_body={"ignore_eos": True}).choices[0].text
    # A stop string that first appears after the start of the reference text.
    stop = next(ref[i:i + 2] for i in range(1, len(ref) - 1)
                if "\ufffd" not in ref[i:i + 2] and ref.find(ref[i:i + 2]) == i)
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0, max_tokens=24, stop=[stop],
                                     extra_body={"ignore_eos": True})
    c = resp.choices[0]
    assert c.text == ref[:ref.find(stop)]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    incl = client.completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0, max_tokens=24, stop=stop,
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert incl.choices[0].text == ref[:ref.find(stop) + len(stop)]


def test_completion_logprobs_and_echo(client):
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[0], logprobs=2, **GREEDY,
                                     extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        # top-2 plus the sampled token, keyed by decoded text (byte pieces may collide on U+FFFD).
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert all(v <= chosen + 1e-6 for v in top.values())  # greedy picks the most likely token
    echo = client.completions.create(model=MODEL, prompt=PROMPTS[0], echo=True, logprobs=1, **GREEDY,
                                     extra_body={"ignore_eos": True})
    c = echo.choices[0]
    assert c.text == PROMPTS[0] + resp.choices[0].text
    n_prompt = echo.usage.prompt_tokens
    assert len(c.logprobs.tokens) == n_prompt + 10
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.token_logprobs[1] is not None


def test_chat_logprobs_with_top_logprobs(client):
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, logprobs=True, top_logprobs=3, **GREEDY,
                                          extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == 10
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.bytes == list(entry.token.encode("utf-8"))
    streamed = [c for c in client.chat.completions.create(model=MODEL, messages=CHAT, logprobs=True, top_logprobs=1,
                                                          stream=True, **GREEDY, extra_body={"ignore_eos": True})
                if c.choices and c.choices[0].logprobs]
    assert sum(len(c.choices[0].logprobs.content) for c in streamed) == 10


def test_repeated_prompt_reports_cached_tokens(client):
    prompt = "numbers 0 1 2 3 4 5 6 7 8 9 and punctuation , . ! ? ; : " * 3
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens >= 32
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


def test_models_lists_served_names_and_alias_is_accepted(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, "tiny-alias"]
    assert models.data[0].max_model_len == MAX_MODEL_LEN
    assert client.models.retrieve("tiny-alias").id == "tiny-alias"
    resp = client.completions.create(model="tiny-alias", prompt="hi", max_tokens=1)
    assert resp.model == "tiny-alias"


def test_tokenize_detokenize_roundtrip_and_chat_tokenize(srv):
    status, _, raw = srv.request("POST", "/tokenize", {"prompt": PROMPTS[1]})
    tok = json.loads(raw)
    assert status == 200 and tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == MAX_MODEL_LEN
    status, _, raw = srv.request("POST", "/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and PROMPTS[1] in json.loads(raw)["prompt"]
    status, _, raw = srv.request("POST", "/tokenize", {"messages": CHAT, "return_token_strs": True})
    body = json.loads(raw)
    assert status == 200 and len(body["token_strs"]) == body["count"]


def test_health_and_version(srv):
    status, _, raw = srv.request("GET", "/health", auth=False)
    assert status == 200 and raw == b""
    status, _, raw = srv.request("GET", "/version", auth=False)
    assert status == 200 and json.loads(raw)["version"]


def test_concurrent_tokenizer_work_in_the_worker_threads_gives_sequential_results(srv):
    """Two worker threads share the server's tokenizer: concurrent requests get exactly what they
    get one at a time (no tokenizer state is shared between calls)."""
    texts = [" ".join(PROMPTS[i % 3] for _ in range(1 + i % 4)) for i in range(24)]

    def tokenize(text: str) -> list[int]:
        status, _, raw = srv.request("POST", "/tokenize", {"prompt": text, "return_token_strs": True})
        assert status == 200, raw
        return json.loads(raw)["tokens"]

    def detokenize(ids: list[int]) -> str:
        return json.loads(srv.request("POST", "/detokenize", {"tokens": ids})[2])["prompt"]

    expected = [tokenize(t) for t in texts]
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(tokenize, texts)) == expected
        assert list(pool.map(detokenize, expected)) == [detokenize(ids) for ids in expected]


def test_stopping_the_app_stops_its_worker_threads(tiny_ckpt):
    def workers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("hybridkv-server")]

    before = set(workers())
    handle = launch(tiny_ckpt("llama"))
    try:
        assert handle.request("POST", "/tokenize", {"prompt": "hello"})[0] == 200
        assert set(workers()) - before  # the tokenization ran in a worker thread
    finally:
        handle.stop()
    assert not set(workers()) - before

"""Online behaviour under load: concurrent streams stay separate and correct, a disconnecting client
gets its request aborted (pages back to free/cached) without disturbing others, and /health stays
responsive while the engine is busy with a long prefill."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

from hybridkv.entrypoints import LLM, SamplingParams
from server_harness import API_KEY, MAX_MODEL_LEN, MODEL, launch

WORDS = "the quick brown fox jumps over lazy dog a lighthouse keeper named Ada found hidden map".split()


def _prompt(i: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(3 + i % 5))


def _abort_count(srv) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    raw = srv.request("GET", "/metrics", auth=False)[2].decode()
    for fam in text_string_to_metric_families(raw):
        for s in fam.samples:
            if s.name == "hybridkv:request_success_total" and s.labels.get("finished_reason") == "abort":
                return s.value
    return 0.0


def test_32_concurrent_streams_complete_with_their_own_greedy_output(srv, tiny_ckpt):
    prompts = [_prompt(i) for i in range(32)]
    ref = LLM(tiny_ckpt("llama"), max_model_len=MAX_MODEL_LEN).generate(
        prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)

    async def one(client, i: int) -> tuple[set[str], str, list[int]]:
        stream = await client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=8, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True,
                                                                          "return_token_ids": True})
        ids, text, tokens = set(), [], []
        async for chunk in stream:
            ids.add(chunk.id)
            text.append(chunk.choices[0].text)
            tokens.extend(chunk.choices[0].token_ids or [])
        return ids, "".join(text), tokens

    async def run():
        client = srv.async_client()
        try:
            return await asyncio.gather(*(one(client, i) for i in range(32)))
        finally:
            await client.close()

    results = asyncio.run(run())
    all_ids = set()
    for (ids, text, tokens), r in zip(results, ref):
        assert len(ids) == 1  # every chunk of a stream belongs to that stream's request
        all_ids |= ids
        assert tokens == r.outputs[0].token_ids
        assert text == r.outputs[0].text
    assert len(all_ids) == 32


def _open_stream(srv, body: dict) -> socket.socket:
    """A raw streaming request whose connection the test can drop mid-stream."""
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    data = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data
    )
    return sock


def _wait_idle_and_check(srv, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while srv.engine.snapshot().num_unfinished_requests:
        assert time.monotonic() < deadline, f"request not aborted: {srv.engine.snapshot()}"
        time.sleep(0.02)
    srv.engine.check_idle()
    for space in srv.engine.snapshot().spaces.values():
        assert space.num_in_use == 0 and space.num_free + space.num_cached == space.num_pages


def test_client_disconnect_mid_stream_aborts_and_frees_pages(srv, client):
    aborts = _abort_count(srv)
    sock = _open_stream(srv, {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 200, "stream": True,
                              "ignore_eos": True})
    got = b""
    while got.count(b"data: ") < 3:  # a few tokens arrived: the request is decoding
        got += sock.recv(65536)
    assert srv.engine.snapshot().num_unfinished_requests == 1
    # Another client's request runs alongside and is unaffected by the abort.
    results: list = []
    other = threading.Thread(target=lambda: results.append(
        client.completions.create(model=MODEL, prompt="hello", max_tokens=20, temperature=0,
                                  extra_body={"ignore_eos": True})))
    other.start()
    sock.close()
    other.join(30)
    _wait_idle_and_check(srv)
    assert _abort_count(srv) == aborts + 1
    assert results and results[0].usage.completion_tokens == 20
    assert results[0].choices[0].finish_reason == "length"


def test_openai_client_closing_a_stream_aborts_the_request(srv, client):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=200, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    _wait_idle_and_check(srv)


def test_client_disconnect_during_non_streaming_request_aborts_it(srv):
    sock = _open_stream(srv, {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 200,
                              "ignore_eos": True})
    deadline = time.monotonic() + 15
    while srv.engine.snapshot().num_running == 0:  # admitted and generating
        assert time.monotonic() < deadline
        time.sleep(0.01)
    sock.close()
    _wait_idle_and_check(srv)


@pytest.mark.slow
def test_health_answers_within_100ms_during_a_long_prefill(tiny_ckpt):
    # A wider 4-layer tiny model and a ~1900-token prompt computed in one step (the token budget
    # holds the whole prompt): the engine thread sits in one long forward pass (a fraction of a
    # second on an idle CPU, seconds on a loaded one) while the test probes /health.
    ckpt = tiny_ckpt("llama", hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                     max_position_embeddings=2048)
    handle = launch(ckpt, api_key=None, max_model_len=2048, max_num_batched_tokens=2048, max_num_seqs=4)
    try:
        prompt = (list(range(5, 300)) * 7)[:1900]
        done = threading.Event()

        def generate():
            try:
                handle.client().completions.create(model=MODEL, prompt=prompt, max_tokens=1)
            finally:
                done.set()

        t = threading.Thread(target=generate)
        t.start()
        while handle.engine.snapshot().num_unfinished_requests == 0 and not done.is_set():
            time.sleep(0.001)  # until the engine thread took the request; its next step is the prefill
        latencies = []
        while not done.is_set():
            t0 = time.perf_counter()
            status = handle.request("GET", "/health", auth=False, timeout=5)[0]
            latencies.append(time.perf_counter() - t0)
            assert status == 200
            time.sleep(0.01)
        t.join()
        assert len(latencies) >= 2, "the prefill was too short to probe; make the prompt longer"
        assert max(latencies) < 0.1, latencies
        handle.engine.check_idle()
    finally:
        handle.stop()

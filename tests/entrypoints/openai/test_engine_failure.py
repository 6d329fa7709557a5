"""A fatal engine error: a stream in flight ends with one SSE error event then [DONE], non-streaming
requests get 503, /health turns 503, and nothing leaks. Shutdown ends in-flight streams the same way."""
from __future__ import annotations

import json
import threading
import time

import pytest

from server_harness import MODEL, launch, sse_events


@pytest.fixture
def fragile(tiny_ckpt):
    """A server of its own (this test kills its engine) whose step() fails after `steps_ok` steps."""
    handle = launch(tiny_ckpt("llama"))
    state = {"steps_ok": 10**9, "calls": 0}

    def install(engine):
        real = engine.step

        def step():
            state["calls"] += 1
            if state["calls"] > state["steps_ok"]:
                raise RuntimeError("injected device failure")
            return real()

        engine.step = step  # instance attribute: only this engine

    handle.engine.call_threadsafe(install).result(10)
    yield handle, state
    handle.stop()


def test_engine_death_mid_stream_sends_error_event_then_done_and_health_turns_503(fragile):
    handle, state = fragile
    assert handle.request("GET", "/health", auth=False)[0] == 200
    state["steps_ok"] = state["calls"] + 4
    body = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 50, "stream": True, "ignore_eos": True}
    status, _, raw = handle.request("POST", "/v1/completions", body)
    assert status == 200
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 503 and "injected device failure" in error["message"]
    assert all("error" not in json.loads(e) for e in events[:-2])
    assert sum(1 for e in events if e.startswith('{"error"')) == 1

    status, _, raw = handle.request("GET", "/health", auth=False)
    assert status == 503 and "injected device failure" in json.loads(raw)["error"]["message"]
    status, _, raw = handle.request("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert status == 503 and json.loads(raw)["error"]["type"] == "ServiceUnavailableError"
    # The failed request was aborted on the way down: every page is free or cached.
    handle.engine.call_threadsafe(lambda e: e.kv.assert_idle()).result(10)


def test_non_streaming_request_gets_503_when_the_engine_dies(fragile):
    handle, state = fragile
    state["steps_ok"] = state["calls"] + 2
    status, _, raw = handle.request("POST", "/v1/chat/completions",
                                    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                     "max_tokens": 50, "ignore_eos": True})
    assert status == 503 and json.loads(raw)["error"]["code"] == 503
    assert not handle.engine.is_healthy


def test_server_shutdown_ends_in_flight_streams_cleanly(fragile):
    handle, _ = fragile
    result: dict = {}

    def stream():
        body = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 200, "stream": True,
                "ignore_eos": True}
        result["response"] = handle.request("POST", "/v1/completions", body)

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + 15
    while handle.engine.snapshot().num_running == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    handle.stop()  # what SIGINT does in `hybridkv serve`
    t.join(15)
    status, _, raw = result["response"]
    events = sse_events(raw)
    assert status == 200 and events[-1] == "[DONE]"
    assert "shut down" in json.loads(events[-2])["error"]["message"]
    handle.engine.engine.kv.assert_idle()


def test_serve_exits_1_a_while_after_the_engine_dies(tiny_ckpt, caplog):
    """`hybridkv serve`'s loop: a dead engine never recovers, so after answering 503 for
    dead_engine_exit_s the server stops on its own with status 1 (a supervisor restarts it)."""
    import asyncio
    import http.client

    from hybridkv.engine.async_llm_engine import AsyncLLMEngine
    from hybridkv.engine.config import EngineConfig
    from hybridkv.entrypoints.openai.api_server import ServerSettings, serve

    engine = AsyncLLMEngine.from_config(EngineConfig(model=tiny_ckpt("llama"), max_model_len=256))

    def fail(e):
        def step():
            raise RuntimeError("injected device failure")
        e.step = step

    engine.call_threadsafe(fail).result(10)
    seen: dict = {}

    def client(port: int) -> None:
        def get(method: str, path: str, body: str | None = None) -> tuple[int, bytes]:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read()

        seen["request"] = get("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 4}))
        seen["health"] = get("GET", "/health")

    def ready(port: int) -> None:
        threading.Thread(target=client, args=(port,), daemon=True).start()

    t0 = time.monotonic()
    try:
        status = asyncio.run(serve(engine, ServerSettings(served_model_names=["tiny"]), "127.0.0.1", 0,
                                   access_log=False, on_ready=ready, dead_engine_exit_s=1.0))
    finally:
        engine.shutdown()
    assert status == 1 and time.monotonic() - t0 < 20
    assert seen["request"][0] == 503 and b"injected device failure" in seen["request"][1]
    assert seen["health"][0] == 503
    assert "exiting because the engine died" in caplog.text
    engine.engine.kv.assert_idle()

"""Two servers behind SGLang's real router (sglang-router, a Rust process started on a free port):
it registers both (its HTTP and gRPC probes answered), forwards chat completions with its extra
fields and SGLang-native /generate calls, and keeps serving when one server stops (once its
health check has noticed: the cache-aware policy sends a prefix back to the replica that holds
it until then). Routed greedy outputs equal one server's answered directly."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request

import pytest

from server_harness import MODEL, launch
from system_tools import require_program

pytestmark = pytest.mark.slow
GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 60) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


@pytest.fixture
def fleet(tiny_ckpt, tmp_path):
    router = require_program("sglang-router", "pip install sglang-router")
    servers = [launch(tiny_ckpt("llama"), api_key=None) for _ in range(2)]
    port = _free_port()
    log = open(tmp_path / "router.log", "wb")
    proc = subprocess.Popen([router, "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
                             "--worker-urls", *[s.url for s in servers], "--health-check-interval-secs", "1",
                             "--health-failure-threshold", "1",
                             "--log-level", "warn"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # ready once it answers a routed request
            try:
                _post(f"{url}/generate", {"text": "warm", "sampling_params": {"max_new_tokens": 1}}, timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise AssertionError(f"the router did not come up: {(tmp_path / 'router.log').read_text()}")
                time.sleep(0.5)
        yield url, servers, tmp_path / "router.log"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        for s in servers:
            s.stop()


def test_routed_requests_equal_a_direct_server_and_survive_losing_one(fleet):
    url, servers, log = fleet
    prompts = [f"conversation {i}: the quick brown fox" for i in range(8)]
    direct = [_post(f"{servers[0].url}/v1/completions", {"model": MODEL, "prompt": p, **GREEDY})["choices"][0]["text"]
              for p in prompts]
    routed = [_post(f"{url}/v1/completions", {"model": MODEL, "prompt": p, **GREEDY})["choices"][0]["text"]
              for p in prompts]
    assert routed == direct, "routed greedy outputs differ from one server's"
    chat = _post(f"{url}/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 4})
    assert chat["choices"][0]["message"]["content"] is not None
    native = _post(f"{url}/generate", {"text": prompts[0], "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                                               "ignore_eos": True}})
    assert native["text"] == direct[0]
    servers[1].stop()  # one replica goes away: once the router's health check notices, every request succeeds
    deadline = time.monotonic() + 30
    while True:
        try:
            _post(f"{url}/v1/completions", {"model": MODEL, "prompt": prompts[0], **GREEDY}, timeout=10)
            break
        except OSError:  # urllib's HTTPError included: the router has not dropped the replica yet
            assert time.monotonic() < deadline, "the router still routes to the stopped replica after 30 s"
            time.sleep(0.5)
    after = [_post(f"{url}/v1/completions", {"model": MODEL, "prompt": p, **GREEDY})["choices"][0]["text"]
             for p in prompts]
    assert after == direct
    text = log.read_text(errors="replace")
    assert "status_code=400" not in text and "Unrecognized" not in text, text[-2000:]

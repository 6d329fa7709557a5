"""`hybridkv serve` as users run it: a subprocess that logs its URL and limits, answers plain HTTP with
the API key from the environment, and on SIGINT ends in-flight streams and exits with status 0."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from server_log import read_lines, wait_for_url

REPO = Path(__file__).resolve().parents[2]


def _post(url: str, body: dict, key: str | None) -> urllib.request.Request:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")


@pytest.mark.slow
def test_serve_subprocess_answers_http_and_exits_0_on_sigint(tiny_ckpt):
    env = {**os.environ, "HYBRIDKV_API_KEY": "env-key", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridkv", "serve", tiny_ckpt("llama"), "--port", "0", "--max-model-len",
         "256", "--served-model-name", "tiny", "--disable-access-log", "--max-queued-requests", "7",
         "--keepalive-timeout", "5", "--max-connections", "64"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines, log = read_lines(proc), []
    try:
        url = wait_for_url(proc, lines, log, 120)
        startup = "".join(log)
        assert "KV space 'full'" in startup and "API key required" in startup
        # The limits reached the server and the engine (the queue bound is read back from it).
        assert "headers in 5s, 64 connections" in startup and "7 queued sequences" in startup

        with urllib.request.urlopen(_post(f"{url}/v1/completions",
                                          {"model": "tiny", "prompt": "hello", "max_tokens": 3}, "env-key")) as r:
            body = json.loads(r.read())
        assert r.status == 200 and body["object"] == "text_completion" and body["usage"]["completion_tokens"] >= 1
        with urllib.request.urlopen(f"{url}/health") as r:
            assert r.status == 200
        with urllib.request.urlopen(f"{url}/metrics") as r:  # open without the key by default
            assert r.status == 200
        lower = urllib.request.Request(f"{url}/v1/models", headers={"Authorization": "bearer env-key"})
        with urllib.request.urlopen(lower) as r:  # the scheme is case-insensitive
            assert r.status == 200 and json.loads(r.read())["data"][0]["root"] == "tiny"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(_post(f"{url}/v1/completions", {"prompt": "hello"}, None))
        assert e.value.code == 401

        # A long stream is in flight when SIGINT arrives: it must end cleanly, not hang.
        tail: dict = {}

        def stream() -> None:
            req = _post(f"{url}/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 200,
                                                  "stream": True, "ignore_eos": True}, "env-key")
            with urllib.request.urlopen(req) as r:
                first = r.readline()
                tail["started"] = first.startswith(b"data: ")
                tail["rest"] = r.read()

        t = threading.Thread(target=stream)
        t.start()
        while "started" not in tail and t.is_alive():
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        t.join(10)
        assert tail.get("started") and tail["rest"].endswith(b"data: [DONE]\n\n")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

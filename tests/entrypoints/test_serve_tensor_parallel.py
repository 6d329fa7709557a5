"""`hybridkv serve --tensor-parallel-size 2` as users run it: /metrics names the layout; a worker
rank killed mid-generation fails the in-flight requests with a 5xx naming the rank, /health
answers 503, and the server exits non-zero within 30 s, leaving no process behind."""
from __future__ import annotations

import json
import os
import queue
import re
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


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name; None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def _running(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def _children(pid: int) -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and (_stat(int(e)) or ["", "0"])[1] == str(pid)]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def _post(url: str, body: dict) -> urllib.request.Request:
    return urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
                                  method="POST")


def _status(url: str) -> tuple[int, bytes] | None:
    """(status, body) of a GET; None when the server no longer answers."""
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, ConnectionError):
        return None


SERVE = ["--dtype", "float32", "--max-model-len", "256", "--served-model-name", "tiny", "--disable-access-log",
         "--tensor-parallel-size", "2", "--kv-cache-memory-bytes", "8MiB", "--no-kv-cache-prefault"]


def _start(path: str, *extra: str) -> tuple[subprocess.Popen, queue.Queue[str]]:
    """`hybridkv serve` (tensor_parallel_size 2) on a free port, its output lines in a queue."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridkv", "serve", path, "--port", "0", *SERVE, *extra],
        cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )
    return proc, read_lines(proc)


def _url(proc: subprocess.Popen, lines: queue.Queue[str], log: list[str]) -> str:
    """The server's base URL, from its startup log (kept in log)."""
    return wait_for_url(proc, lines, log, 180)


@pytest.mark.slow
def test_a_killed_rank_fails_requests_turns_health_503_and_stops_the_server(tiny_ckpt):
    proc, lines = _start(tiny_ckpt("llama", num_key_value_heads=4))
    log: list[str] = []
    children: list[int] = []
    try:
        url = _url(proc, lines, log)
        assert "tensor parallel: size 2 on gloo, 1 node(s) x 2 rank(s)" in "".join(log)
        status, metrics = _status(f"{url}/metrics")
        assert status == 200
        assert re.search(r'hybridkv:parallel_layout\{backend="gloo",expert_parallel="false",model_name="tiny",'
                         r'nnodes="1",tensor_parallel_size="2"\} 1\.0', metrics.decode()), metrics.decode()

        children = _children(proc.pid)
        workers = [pid for pid in children if "spawn_main" in _cmdline(pid)]
        assert len(workers) == 1, {pid: _cmdline(pid) for pid in children}

        results: dict = {}

        def plain() -> None:
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 200, "ignore_eos": True}
            try:
                with urllib.request.urlopen(_post(f"{url}/v1/completions", body), timeout=60) as r:
                    results["plain"] = (r.status, r.read())
            except urllib.error.HTTPError as e:
                results["plain"] = (e.code, e.read())

        def stream() -> None:
            body = {"model": "tiny", "prompt": "hello there", "max_tokens": 200, "ignore_eos": True, "stream": True}
            with urllib.request.urlopen(_post(f"{url}/v1/completions", body), timeout=60) as r:
                results["started"] = r.readline().startswith(b"data: ")
                results["stream"] = r.read()

        threads = [threading.Thread(target=plain), threading.Thread(target=stream)]
        for t in threads:
            t.start()
        while "started" not in results and threads[1].is_alive():
            time.sleep(0.01)
        assert results.get("started"), "the stream never started"
        os.kill(workers[0], signal.SIGKILL)  # mid-generation: both requests are decoding
        killed = time.monotonic()
        for t in threads:
            t.join(30)

        status, body = results["plain"]
        error = json.loads(body)["error"]
        assert 500 <= status < 600 and error["code"] == status
        assert "worker rank 1 exited with code -9" in error["message"], error
        events = [e.strip()[len("data: "):] for e in results["stream"].decode().split("\n\n")
                  if e.strip().startswith("data: ")]
        assert events[-2:-1] and events[-1] == "[DONE]", results["stream"][-2000:]
        assert "worker rank 1 exited" in json.loads(events[-2])["error"]["message"], events[-2]

        health = _status(f"{url}/health")
        assert health is not None and health[0] == 503 and b"rank 1" in health[1], health
        code = proc.wait(timeout=max(1.0, 30 - (time.monotonic() - killed)))
        assert code != 0
        output = "".join(log) + "".join(iter_lines(lines))
        assert "exiting because the engine died" in output and "worker rank 1" in output, output[-3000:]
        deadline = time.monotonic() + 10
        while any(_running(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in children if _running(pid)], "the server left processes behind"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in children:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait(30)


def iter_lines(lines: queue.Queue[str]):
    """What the reader thread has queued so far (it ends with the process)."""
    time.sleep(0.5)
    while True:
        try:
            yield lines.get_nowait()
        except queue.Empty:
            return


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_serve_and_both_exit_0_on_sigint(tiny_ckpt):
    """The two-machine deployment of docs/configuration.md over loopback: node 0 serves, node 1
    runs rank 1 only; SIGINT to node 0 stops rank 1 cleanly, so both exit 0."""
    path = tiny_ckpt("llama", num_key_value_heads=4)
    addr = f"127.0.0.1:{_free_port()}"
    nodes = ["--nnodes", "2", "--dist-init-addr", addr]
    follower, follower_lines = _start(path, *nodes, "--node-rank", "1")
    driver, lines = _start(path, *nodes, "--node-rank", "0")
    log: list[str] = []
    try:
        url = _url(driver, lines, log)
        assert "2 node(s) x 1 rank(s), rendezvous at " + addr in "".join(log)
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "ignore_eos": True}
        with urllib.request.urlopen(_post(f"{url}/v1/completions", body), timeout=60) as r:
            assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 4
        status, metrics = _status(f"{url}/metrics")
        assert 'nnodes="2"' in metrics.decode() and 'tensor_parallel_size="2"' in metrics.decode()
        driver.send_signal(signal.SIGINT)
        assert driver.wait(timeout=60) == 0
        assert follower.wait(timeout=30) == 0, "".join(iter_lines(follower_lines))[-3000:]
        output = "".join(iter_lines(follower_lines))
        assert "the driver stopped this node's ranks" in output and "serving the OpenAI" not in output
    finally:
        for proc in (driver, follower):
            if proc.poll() is None:
                proc.kill()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(30)

"""`hybridkv serve` on the demo model in a subprocess, for the tests that need real weights
behind the official openai client."""
from __future__ import annotations

import contextlib
import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[3]


@contextlib.contextmanager
def demo_server(*extra_args: str) -> Iterator[str]:
    """The server's base URL while it runs (served as "demo"); stopped on exit."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("HYBRIDKV_API_KEY", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridkv", "serve", "--port", "0", "--max-model-len", "1024",
         "--served-model-name", "demo", "--disable-access-log", *extra_args],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    log: list[str] = []
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        url, deadline = None, time.monotonic() + 300
        while url is None:
            assert proc.poll() is None, "server exited early:\n" + "".join(log)
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail("no startup line within 300 s:\n" + "".join(log))
            log.append(line)
            m = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
            url = m.group(1) if m else None
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

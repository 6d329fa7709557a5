"""`hybridkv serve` on the demo model in a subprocess, for the tests that need real weights
behind the official openai client."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

from server_log import read_lines, wait_for_url

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
    lines, log = read_lines(proc), []
    try:
        url = wait_for_url(proc, lines, log, 300)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

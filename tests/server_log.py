"""A `hybridkv serve` subprocess's output as the tests read it: its lines in a queue (a reader
thread, so a test never blocks on the pipe) and the base URL from its startup line."""
from __future__ import annotations

import queue
import re
import subprocess
import threading
import time

import pytest


def read_lines(proc: subprocess.Popen) -> queue.Queue[str]:
    """proc's stdout lines as they come (proc started with stdout=PIPE, text=True)."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    return lines


def wait_for_url(proc: subprocess.Popen, lines: queue.Queue[str], log: list[str], timeout_s: float) -> str:
    """The server's base URL from its "... at http://127.0.0.1:PORT/v1" startup line; every line
    read is kept in log. Fails naming the output when the server exits or says nothing in time."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, "server exited early:\n" + "".join(log)
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            pytest.fail(f"no startup line within {timeout_s:.0f} s:\n" + "".join(log))
        log.append(line)
        m = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
        if m:
            return m.group(1)

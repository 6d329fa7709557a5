"""benchmarks/gpu_check.py on a machine without CUDA: --help works and a run says there is no
CUDA device and exits 0 (the GPU sections themselves run only when a GPU is lent)."""
from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "gpu_check.py")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU, even on a machine that has one
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120, env=env)


def test_help():
    res = _run("--help")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "--quick" in res.stdout and "torch_native" in res.stdout


def test_without_cuda_it_says_so_and_exits_0():
    res = _run("--quick")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "no CUDA device" in res.stdout

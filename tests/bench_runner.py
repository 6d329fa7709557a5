"""Run a benchmarks/ script's main() in-process and parse its RESULT line (smoke tests)."""
from __future__ import annotations

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_benchmark(name: str):
    bench_dir = os.path.join(ROOT, "benchmarks")
    if bench_dir not in sys.path:  # as when a script runs: its folder's modules (cpu_info) import
        sys.path.insert(0, bench_dir)
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def result_fields(out: str) -> dict[str, str]:
    """The last RESULT line's key=value pairs; every value but model= must parse as a number."""
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"no RESULT line in:\n{out[-3000:]}"
    fields = dict(kv.split("=", 1) for kv in lines[-1].split()[1:])
    for k, v in fields.items():
        if k != "model":
            float(v)
    return fields

"""The HiCache benchmarks run end to end in --quick mode (on tiny checkpoints, not the demo
model) and print a parseable RESULT line saying the runs with and without the host tier, with
the storage tier, and after a warm restart on that store gave identical outputs. Nothing about
timings is asserted."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _result(out: str) -> dict[str, str]:
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"no RESULT line in:\n{out[-3000:]}"
    fields = dict(kv.split("=", 1) for kv in lines[-1].split()[1:])
    for k, v in fields.items():
        if k != "model":
            float(v)  # every figure parses as a number
    return fields


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "v4"])
def test_hicache_multiturn_quick(tiny_ckpt, capsys, arch):
    model = tiny_ckpt("llama") if arch == "llama" else "v4-tiny"  # v4-tiny: built in a temp dir, page 32
    rc = _load("hicache_multiturn").main(["--quick", "--model", model])
    res = _result(capsys.readouterr().out)
    assert rc == 0 and res["outputs_identical"] == "1", res
    assert float(res["l2_host_hit"]) > 0, "the host tier served nothing: the device budget is not the 1/8 intended"
    assert float(res["l3_storage_hit"]) > 0, "the store served nothing: the host tier is not too small as intended"
    assert float(res["warm_storage_hit"]) > float(res["l3_storage_hit"]), (
        "a new process on the filled store should find more there than the run that filled it", res)


@pytest.mark.slow
def test_swap_preemption_quick(tiny_ckpt, capsys):
    rc = _load("swap_preemption").main(["--quick", "--model", tiny_ckpt("llama")])
    res = _result(capsys.readouterr().out)
    assert rc == 0 and res["outputs_identical"] == "1", res
    assert int(res["preemptions_recompute"]) > 0 and int(res["preemptions_swap"]) > 0, "the budget forced no preemption"
    assert int(res["recomputed_swap"]) <= int(res["recomputed_recompute"]), res

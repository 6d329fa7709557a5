"""The HiCache benchmarks run end to end in --quick mode (on tiny checkpoints, not the demo
model) and print a parseable RESULT line saying the runs with and without the host tier, with
the storage tier, and after a warm restart on that store gave identical outputs. Nothing about
timings is asserted."""
from __future__ import annotations

import pytest

from bench_runner import load_benchmark as _load
from bench_runner import result_fields as _result


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "v4"])
def test_hicache_multiturn_quick(tiny_ckpt, capsys, arch):
    model = tiny_ckpt("llama") if arch == "llama" else "v4-tiny"  # v4-tiny: built in a temp dir, page 32
    rc = _load("hicache_multiturn").main(["--quick", "--model", model])
    res = _result(capsys.readouterr().out)
    assert rc == 0 and res["outputs_identical"] == "1", res
    assert float(res["l2_host_hit"]) > 0, "the host tier served nothing: the device budget is not the 1/8 intended"
    assert float(res["l3_storage_hit"]) > 0, "the store served nothing: the host tier is not too small as intended"
    assert float(res["warm_storage_hit"]) > 0, ("a new process on the filled store found nothing there", res)


@pytest.mark.slow
def test_swap_preemption_quick(tiny_ckpt, capsys):
    rc = _load("swap_preemption").main(["--quick", "--model", tiny_ckpt("llama")])
    res = _result(capsys.readouterr().out)
    assert rc == 0 and res["outputs_identical"] == "1", res
    assert int(res["preemptions_recompute"]) > 0 and int(res["preemptions_swap"]) > 0, "the budget forced no preemption"
    assert int(res["recomputed_swap"]) <= int(res["recomputed_recompute"]), res

"""benchmarks/hisparse.py runs end to end in --quick mode on its tiny V4 and prints a parseable
RESULT line: outputs identical with HiSparse on and off in every part, HiSparse never admits a
smaller decode batch, its engines allocate no more KV on the device than the budget, and a larger
buffer never hits less. Nothing about timings is asserted."""
from __future__ import annotations

import pytest

from bench_runner import load_benchmark, result_fields


@pytest.mark.slow
def test_hisparse_benchmark_quick(capsys):
    rc = load_benchmark("hisparse").main(["--quick"])
    res = result_fields(capsys.readouterr().out)
    assert rc == 0 and res["outputs_identical"] == "1", res
    assert int(res["max_batch_on"]) >= int(res["max_batch_off"]) and float(res["capacity_x_16k"]) > 1, res
    assert res["device_fits"] == "1", "HiSparse's engine allocated more KV on the device than the budget"
    assert float(res["hit_4x"]) >= float(res["hit_1x"]), res

"""benchmarks/step_overhead.py runs end to end at small sizes: every configuration builds its
cache, admits and decodes its requests through the real scheduler, block manager and metadata
builders (dense and DeepSeek-V4 layouts, the shared-prefix lock-move case), ends with every
page free or cached (measure() asserts it), and prints a parseable RESULT line. Timings are
not asserted (a shared CI machine would make them flaky); the figures live in
benchmarks/README.md."""
from __future__ import annotations

import math

from bench_runner import load_benchmark, result_fields

step_overhead = load_benchmark("step_overhead")


def test_step_overhead_runs_every_configuration_and_ends_idle(capsys):
    rc = step_overhead.main(["--steps", "4", "--caches", "2000", "6000", "20000", "--running", "1", "8"])
    out = capsys.readouterr().out
    res = result_fields(out)
    assert rc == 0
    assert float(res["us_per_step_256_100k"]) > 0 and math.isfinite(float(res["growth_1m_vs_10k"])), res
    assert out.count("µs per step") == 4, "dense and V4 tables, plus both shared-prefix tables"

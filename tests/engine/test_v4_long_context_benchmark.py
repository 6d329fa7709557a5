"""benchmarks/v4_long_context.py runs end to end on short contexts and prints a parseable RESULT
line with every context's decode rate, its ratio and the prefill's fraction of the measured GEMM
rate; the FLOP model counts what it should. Nothing about timings is asserted."""
from __future__ import annotations

import pytest

from bench_runner import load_benchmark, result_fields


@pytest.mark.slow
def test_v4_long_context_benchmark_short_contexts(capsys):
    bench = load_benchmark("v4_long_context")
    rc = bench.main(["--contexts", "256", "700", "--decode-steps", "2", "--repeats", "1", "--threads", "1", "--ref-context", "512",
                     "--profile", "--kv-cache-dtype", "fp8"])  # the measured engine in FP8, the reference in auto
    out = capsys.readouterr().out
    res = result_fields(out)
    assert rc == 0, out
    for ctx in (256, 700):
        assert float(res[f"decode_{ctx}"]) > 0 and float(res[f"gemm_x_{ctx}"]) > 0, res
    assert "family" in out and "GFLOP/s" in out
    for ctx in (512, 256, 700):  # the reference's profile, then each context's
        assert f"profile of one decode step at context {ctx} " in out, out
    assert out.count("(step total, self CPU)") == 3, out


def test_prefill_flop_model_grows_quadratically_in_the_indexer_only():
    """The indexer scores every causal C4 entry (quadratic); projections are linear in the
    prompt; attention reads a bounded window + top-k plus C128 entries (quadratic / 128)."""
    import os
    import tempfile

    from hybridkv.entrypoints import LLM

    bench = load_benchmark("v4_long_context")
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(bench.build_checkpoint(os.path.join(tmp, "v4")), dtype="float32", max_model_len=512)
        a, b = bench.prefill_flops(llm, 8192), bench.prefill_flops(llm, 16384)
    cfg = llm.engine.runner.model.cfg
    assert 1.95 < b["projections"] / a["projections"] < 2.05, (a, b)
    assert 3.9 < b["indexer"] / a["indexer"] < 4.1, (a, b)
    want = 2 * 2 * cfg.index_n_heads * (cfg.index_head_dim + 1) * sum(t // 4 for t in range(1, 8193))
    assert abs(a["indexer"] - want) / want < 1e-9, (a["indexer"], want)

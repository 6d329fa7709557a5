"""benchmarks/kv_cache_dtype.py --tiny-v4 builds the tiny DeepSeek-V4, runs teacher-forced text
through an auto and an FP8 engine and reports agreement (smoke test on a few positions)."""
from bench_runner import load_benchmark, result_fields


def test_tiny_v4_accuracy_run_reports_agreement_and_logprob_deltas(capsys):
    bench = load_benchmark("kv_cache_dtype")
    bench.main(["--tiny-v4", "--dtype", "float32", "--formats", "fp8", "--positions", "200", "--chunk-tokens", "100"])
    fields = result_fields(capsys.readouterr().out)
    assert 0.5 <= float(fields["agree_fp8"]) <= 1.0
    assert 0 < float(fields["dlogp_mean_fp8"]) <= float(fields["dlogp_max_fp8"])

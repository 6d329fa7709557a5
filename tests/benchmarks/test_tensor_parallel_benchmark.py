"""benchmarks/tensor_parallel.py runs one process and two ranks on the same workload, checks the
tokens agree and reports throughput and the communication time per step (tiny smoke sizes)."""
import pytest

from bench_runner import load_benchmark, result_fields

pytestmark = pytest.mark.slow


def test_tensor_parallel_benchmark_runs_and_reports(capsys):
    bench = load_benchmark("tensor_parallel")
    bench.main(["--layers", "2", "--hidden", "64", "--prompts", "2", "--prompt-tokens", "20", "--tokens", "4"])
    fields = result_fields(capsys.readouterr().out)
    assert float(fields["tp1_tok_s"]) > 0 and float(fields["tp2_tok_s"]) > 0
    assert float(fields["comm_ms_per_step"]) > 0, "the collectives' time was not measured"
    assert float(fields["broadcast_ms_per_step"]) > 0, "the step broadcast's time was not measured"

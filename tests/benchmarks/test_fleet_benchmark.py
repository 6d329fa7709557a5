"""benchmarks/fleet.py drives real fleets (router, replicas, Redis) four ways and reports hit
rates, TTFT and throughput (smoke test on a tiny checkpoint and a tiny workload)."""
import pytest

from bench_runner import load_benchmark, result_fields
from system_tools import require_program

pytestmark = pytest.mark.slow


def test_fleet_benchmark_runs_and_reports(tiny_ckpt, capsys):
    require_program("redis-server", "apt-get install -y redis-server")
    require_program("sglang-router", "pip install sglang-router")
    bench = load_benchmark("fleet")
    bench.main(["--model", tiny_ckpt("llama"), "--conversations", "3", "--turns", "2", "--max-tokens", "4",
                "--doc-sentences", "12", "--serve-args", "--dtype", "float32", "--max-model-len", "512"])
    fields = result_fields(capsys.readouterr().out)
    for way in ("cache_aware_redis", "round_robin_redis", "cache_aware_local", "round_robin_local"):
        assert 0.0 <= float(fields[f"hit_{way}"]) < 1.0
        assert float(fields[f"tps_{way}"]) > 0
    # Later turns extend earlier ones: some prefix is always cached somewhere with routing by prefix.
    assert float(fields["hit_cache_aware_redis"]) > 0

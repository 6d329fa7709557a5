"""benchmarks/decode_burst.py runs both engines in alternating rounds, checks their tokens agree
and reports the ratio (smoke test on a tiny checkpoint and a tiny workload file)."""
import json

import pytest

from bench_runner import load_benchmark, result_fields


def test_decode_burst_benchmark_runs_and_reports(tiny_ckpt, tmp_path, capsys):
    work = {"a_single_decode": {"prompt_ids": [5, 6, 7, 8], "max_tokens": 12},
            "b_batch32": {"prompts_ids": [[5, 6, 7], [9, 10, 11, 12, 13]], "max_tokens": 10}}
    path = tmp_path / "workloads.json"
    path.write_text(json.dumps(work))
    bench = load_benchmark("decode_burst")
    bench.main(["--model", tiny_ckpt("llama"), "--dtype", "float32", "--steps", "4", "--rounds", "1",
                "--workloads", str(path)])
    fields = result_fields(capsys.readouterr().out)
    if int(fields["burst_calls"]) == 0:
        pytest.skip("no fused decode for float32 on this CPU: both engines step one at a time")
    assert float(fields["a_ratio"]) > 0 and float(fields["b_ratio"]) > 0

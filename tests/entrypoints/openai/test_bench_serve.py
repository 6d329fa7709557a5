"""benchmarks/serve.py against a live server: every request completes and the report is complete."""
from __future__ import annotations

import asyncio

import pytest

from benchmarks import serve as bench
from server_harness import API_KEY


@pytest.mark.parametrize("dataset, load", [
    ("random", ["--max-concurrency", "3"]),
    ("shared-prefix", ["--request-rate", "50"]),
])
def test_bench_serve_completes_all_requests_and_reports_latencies(srv, dataset, load, capsys):
    args = bench.build_parser().parse_args([
        "--base-url", srv.url, "--api-key", API_KEY, "--dataset-name", dataset, "--num-prompts", "6",
        "--random-input-len", "16", "--random-output-len", "4", "--prefix-repetition-prefix-len", "32",
        "--prefix-repetition-suffix-len", "4", "--prefix-repetition-num-prefixes", "2",
        "--prefix-repetition-output-len", "4", "--ignore-eos", "--metric-percentiles", "50,99", *load,
    ])
    summary = asyncio.run(bench.run_benchmark(args))
    assert summary["completed"] == 6 and summary["failed"] == 0, summary["errors"]
    assert summary["total_output_tokens"] == 24
    assert summary["output_throughput"] > 0 and summary["total_input_tokens"] > 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(summary[key]) == {"mean", "median", "p50", "p99"}
        assert summary[key]["mean"] > 0
    bench.print_summary(summary)
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "P99 TTFT (ms)" in out


def test_bench_chat_endpoint(srv):
    args = bench.build_parser().parse_args([
        "--base-url", srv.url, "--api-key", API_KEY, "--endpoint", "/v1/chat/completions", "--num-prompts", "3",
        "--random-input-len", "8", "--random-output-len", "3", "--ignore-eos",
    ])
    summary = asyncio.run(bench.run_benchmark(args))
    assert summary["completed"] == 3 and summary["total_output_tokens"] == 9

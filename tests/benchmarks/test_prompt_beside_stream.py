"""benchmarks/prompt_beside_stream.py runs end to end on the demo model at a small prompt, in
both modes: it prefills the prompt beside a stream, ends with every page free or cached (main
asserts it through kv.assert_idle), prints a parseable RESULT line, and puts BlockSpace.allocate
back after --ignore-page-runs (other tests in this process must get page runs). Timings are not
asserted; the figures live in benchmarks/README.md."""
from __future__ import annotations

from bench_runner import load_benchmark, result_fields

from hybridkv.block_manager.block_space import BlockSpace

prompt_beside_stream = load_benchmark("prompt_beside_stream")


def test_prompt_beside_stream_runs_in_both_modes_and_restores_allocation(capsys):
    allocate = BlockSpace.allocate
    for extra in ([], ["--ignore-page-runs"]):
        assert prompt_beside_stream.main(["--prompt-tokens", "40", *extra]) == 0
        res = result_fields(capsys.readouterr().out)
        assert int(res["steps"]) >= 1 and float(res["prompt_seconds"]) > 0, res
        assert BlockSpace.allocate is allocate, "the A/B patch leaked out of the benchmark"

"""benchmarks/closed_loop.py runs end to end on a tiny checkpoint: a closed loop of streamed
requests (more prompts than the concurrency, so finished requests are replaced), every request
answered, and a parseable RESULT line whose step accounting covers the prompts. Timings are not
asserted; the figures live in benchmarks/README.md."""
from __future__ import annotations

from bench_runner import load_benchmark, result_fields

closed_loop = load_benchmark("closed_loop")


def test_closed_loop_answers_every_request_and_accounts_for_the_steps(tiny_ckpt, capsys):
    path = tiny_ckpt("llama")
    rc = closed_loop.main(["--model", path, "--num-prompts", "6", "--concurrency", "2", "--input-len", "40",
                           "--output-len", "5", "--max-num-batched-tokens", "64", "--threads", "1"])
    res = result_fields(capsys.readouterr().out)
    assert rc == 0
    assert float(res["req_s"]) > 0 and float(res["ttft"]) > 0 and float(res["tpot"]) > 0, res
    # 6 prompts of 40 tokens in chunks of at most 64 tokens: at least 4 steps computed prompt tokens.
    assert int(float(res["prefill_steps"])) >= 4, res
    assert 0 < float(res["prefill_tokens"]) <= 64, res
    # Every step a stream decodes in is one of its gaps: the percentiles are ordered and real.
    assert 0 < float(res["gap_p50"]) <= float(res["gap_p99"]) <= float(res["gap_max"]), res


def test_a_staggered_first_wave_arrives_over_the_stagger(tiny_ckpt, capsys):
    """--stagger: the first wave arrives over the stagger, so two requests at concurrency 2 take at
    least the second one's delay, and a TTFT counts from the request's arrival (never negative)."""
    path = tiny_ckpt("llama")
    rc = closed_loop.main(["--model", path, "--num-prompts", "2", "--concurrency", "2", "--input-len", "20",
                           "--output-len", "3", "--threads", "1", "--stagger", "1.0"])
    out = capsys.readouterr().out
    res = result_fields(out)
    assert rc == 0 and "first wave staggered over 1 s" in out
    # The second client arrives 0.5 s after the first: the pass cannot end sooner.
    assert float(res["duration"]) >= 0.5 and float(res["req_s"]) > 0 and float(res["ttft"]) > 0, res

"""benchmarks/peer_vllm.py drives ../shared/bench/vllm_cpu/: without its venv, --peer vllm must
say how to build it; with one, it must source the harness's env.sh, pass the model, dtype,
workloads and prefix-caching setting through, and read the medians back under
offline_throughput's keys. vLLM itself (3.4 GB) is not installed in CI, so the harness here is
a stand-in script with bench_vllm.py's command line and output schema."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from bench_runner import load_benchmark

peer_vllm = load_benchmark("peer_vllm")

FAKE_BENCH = '''
import argparse, json, os
ap = argparse.ArgumentParser()
for a in ("--model", "--dtype", "--tests", "--prefix-caching", "--repeats", "--out"):
    ap.add_argument(a)
args = ap.parse_args()
assert os.environ["FAKE_ENV_SOURCED"] == "1" and os.environ["PEER_DIR"]
with open(os.environ["FAKE_CALLS"], "a") as f:
    f.write(json.dumps(vars(args)) + "\\n")
on = args.prefix_caching == "1"
res = {"d": {"median_wall_s_cold": 5.0 if on else 13.0}}
if not on:
    res |= {"a": {"median_wall_s": 2.0}, "b": {"median_wall_s": 7.0}, "c": {"median_wall_s": 0.5}}
json.dump({"vllm": "0.32.0", "torch": "2.x", "results": res}, open(args.out, "w"))
'''


def fake_peer(tmp_path):
    """(harness, peer dir): the stand-in bench_vllm.py and env.sh, and a venv whose python is ours."""
    harness, peer = tmp_path / "harness", tmp_path / "peer"
    (peer / "venv" / "bin").mkdir(parents=True)
    os.symlink(sys.executable, peer / "venv" / "bin" / "python")
    harness.mkdir()
    (harness / "bench_vllm.py").write_text(FAKE_BENCH)
    (harness / "env.sh").write_text("export FAKE_ENV_SOURCED=1\n")
    return harness, peer


def test_missing_venv_names_the_setup_command(tmp_path):
    why = peer_vllm.missing(str(tmp_path / "peer"), peer_vllm.DEFAULT_HARNESS)
    if not os.path.isfile(os.path.join(peer_vllm.DEFAULT_HARNESS, "bench_vllm.py")):
        assert "harness" in why
    else:
        assert "setup.sh" in why and str(tmp_path / "peer") in why


def test_runs_the_harness_twice_and_maps_its_medians(tmp_path, monkeypatch):
    harness, peer = fake_peer(tmp_path)
    monkeypatch.setenv("FAKE_CALLS", str(tmp_path / "calls.jsonl"))
    assert peer_vllm.missing(str(peer), str(harness)) is None
    times, name = peer_vllm.vllm_runs("/models/demo", "float32", 3, str(peer), str(harness), timeout_s=120)
    assert times == {"a_decode": 2.0, "b_batch32": 7.0, "c_prefill": 0.5, "d_prefix_off": 13.0, "d_prefix_on": 5.0}
    assert "0.32.0" in name
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert [(c["tests"], c["prefix_caching"]) for c in calls] == [("a,b,c,d", "0"), ("d", "1")]
    assert all(c["model"] == "/models/demo" and c["dtype"] == "float32" and c["repeats"] == "3" for c in calls)


def test_offline_rounds_alternate_the_engines_and_print_paired_ratios(tmp_path, monkeypatch, capsys):
    """offline_throughput.py --peer vllm --rounds 3: hybridkv's runs and vLLM-CPU's alternate
    (O P, P O, O P), each engine's figure is the median of its rounds, and each round's ratio is
    printed beside it. hybridkv's runs are a stand-in here (their times vary by round); vLLM's
    are the stand-in harness's."""
    from tiny_checkpoints import build_checkpoint

    offline = load_benchmark("offline_throughput")
    harness, peer = fake_peer(tmp_path)
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_CALLS", str(calls))
    model = build_checkpoint(str(tmp_path / "model"))
    speeds = iter([1.0, 0.9, 1.1])  # hybridkv's speed in each round, against vLLM's fixed times

    def hybridkv_runs(args, w):
        s = next(speeds)
        with open(calls, "a") as f:
            f.write(json.dumps({"tests": "hybridkv"}) + "\n")
        res = {"a_decode": 2.0 / s, "b_batch32": 7.0 / s, "c_prefill": 0.5 / s, "d_prefix_on": 5.0 / s,
               "d_prefix_on_lpm": 4.0 / s, "d_prefix_off": 13.0 / s}
        return res, model, torch.float32, [(2.0 / s, 30e9)]

    for probe in ("copy_bandwidth", "read_bandwidth", "gemm_rate", "fma_peak"):
        monkeypatch.setattr(offline.roofline, probe, lambda *a, **k: 100e9)
    monkeypatch.setattr(offline, "hybridkv_runs", hybridkv_runs)
    monkeypatch.setattr(sys, "argv", ["offline_throughput.py", "--skip-hf", "--peer", "vllm", "--rounds", "3",
                                      "--repeats", "1", "--peer-dir", str(peer), "--peer-harness", str(harness)])
    offline.main()
    order = [json.loads(line)["tests"] for line in calls.read_text().splitlines()]
    assert order == ["hybridkv", "a,b,c,d", "d", "a,b,c,d", "d", "hybridkv", "hybridkv", "a,b,c,d", "d"]
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.strip().startswith("d_prefix_off ") and "median" in line)
    assert "1.000x 0.900x 1.100x  median 1.000x" in row, row
    assert "rounds=3" in out
    result = dict(kv.split("=") for kv in next(ln for ln in out.splitlines() if ln.startswith("RESULT")).split()[1:])
    assert float(result["d_prefix_off"]) == pytest.approx(13.0) and float(result["vllm_d_prefix_off"]) == 13.0

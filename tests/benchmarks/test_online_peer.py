"""benchmarks/online_peer.py runs `hybridkv serve` and `vllm serve` one after the other under vLLM's
load generator: each server must get the same model, dtype and load, be ready before the load
starts, be stopped afterwards (no server left running), and the medians and hybridkv / vLLM
ratios must come from the load generator's saved results. vLLM (3.4 GB) is not installed in CI,
so the harness is a stand-in: its bench_serve.py sends real completions and writes vLLM's result
schema; its "vLLM server" is a second `hybridkv serve` reached through the command line online_peer
builds for vLLM (env.sh sourced, vLLM's api_server flags)."""
from __future__ import annotations

import json
import os
import sys

import pytest

from bench_runner import load_benchmark

online_peer = load_benchmark("online_peer")

FAKE_BENCH_SERVE = '''
import argparse, json, os, time, urllib.request
from concurrent.futures import ThreadPoolExecutor
ap = argparse.ArgumentParser()
for a in ("--backend", "--base-url", "--model", "--dataset-name", "--random-input-len", "--random-output-len",
          "--num-prompts", "--max-concurrency", "--seed", "--result-dir", "--result-filename"):
    ap.add_argument(a)
ap.add_argument("--ignore-eos", action="store_true")
ap.add_argument("--save-result", action="store_true")
a = ap.parse_args()
with open(os.environ["FAKE_CALLS"], "a") as f:
    f.write(json.dumps(vars(a)) + "\\n")
def one(i):
    body = {"model": a.model, "prompt": [1 + (i + j) % 50 for j in range(int(a.random_input_len))],
            "max_tokens": int(a.random_output_len), "ignore_eos": a.ignore_eos}
    req = urllib.request.Request(a.base_url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t = time.monotonic()
    with urllib.request.urlopen(req, timeout=60) as r:
        out = json.load(r)
    return time.monotonic() - t, out["usage"]["completion_tokens"]
t0 = time.monotonic()
with ThreadPoolExecutor(int(a.max_concurrency)) as ex:
    res = list(ex.map(one, range(int(a.num_prompts))))
dur = time.monotonic() - t0
lat = [r[0] for r in res]
json.dump({"completed": len(res), "errors": [""] * len(res), "duration": dur,
           "request_throughput": len(res) / dur, "output_throughput": sum(r[1] for r in res) / dur,
           "mean_ttft_ms": 1000 * sum(lat) / len(lat), "mean_tpot_ms": 1000 * sum(lat) / len(lat) / 4},
          open(os.path.join(a.result_dir, a.result_filename), "w"))
'''

# Stands in for `python -m vllm.entrypoints.openai.api_server`: the same flags, served by hybridkv.
FAKE_VLLM_API_SERVER = '''
import argparse, os, sys
ap = argparse.ArgumentParser()
for a in ("--model", "--dtype", "--host", "--port", "--max-model-len"):
    ap.add_argument(a)
a = ap.parse_args()
assert os.environ["FAKE_ENV_SOURCED"] == "1"
from hybridkv.entrypoints.cli import main
assert a.max_model_len == "2048"  # vLLM's flag arrived; the tiny model itself holds fewer positions
sys.exit(main(["serve", a.model, "--dtype", a.dtype, "--host", a.host, "--port", a.port, "--disable-access-log"]))
'''


def test_without_the_peer_venv_it_names_the_setup_command(tmp_path, capsys):
    assert online_peer.main(["--model", str(tmp_path), "--peer-dir", str(tmp_path / "peer")]) == 2
    err = capsys.readouterr().err
    assert "setup.sh" in err and str(tmp_path / "peer") in err


def test_table_ratios_and_targets_point_the_right_way():
    row = {"request_throughput": 1.0, "mean_ttft_ms": 100.0, "mean_tpot_ms": 50.0, "output_throughput": 64.0,
           "duration": 10.0}
    lines = online_peer.table({"hybridkv": {**row, "request_throughput": 1.2, "mean_ttft_ms": 150.0},
                               "vLLM-CPU": row})
    by_label = {ln.split("|")[1].strip(): ln for ln in lines[2:]}
    assert "1.20x | yes" in by_label["req/s"]  # more throughput: meets the target
    assert "1.50x | no" in by_label["mean TTFT ms"]  # more latency: misses it
    assert "1.00x | yes" in by_label["mean TPOT ms"]


def test_rounds_alternate_the_servers_and_print_each_rounds_ratios(tmp_path, monkeypatch, capsys):
    """--rounds 3: the servers take turns H V, V H, H V; the table holds each one's medians over
    the rounds, and each round's ratio is printed (a stand-in for measure, whose figures vary by
    round; the real servers are the slow test below)."""
    harness, peer = tmp_path / "harness", tmp_path / "peer"
    (peer / "venv" / "bin").mkdir(parents=True)
    os.symlink(sys.executable, peer / "venv" / "bin" / "python")
    harness.mkdir()
    (harness / "bench_serve.py").write_text("")
    order, speeds = [], {"hybridkv": iter([1.2, 0.9, 1.05]), "vLLM-CPU": iter([1.0, 1.0, 1.0])}

    def measure(name, cmd, port, **common):
        order.append(name)
        s = next(speeds[name])
        return {"request_throughput": s, "mean_ttft_ms": 100 / s, "mean_tpot_ms": 50 / s,
                "output_throughput": 64 * s, "duration": 10 / s}

    monkeypatch.setattr(online_peer, "measure", measure)
    assert online_peer.main(["--model", str(tmp_path), "--rounds", "3", "--peer-dir", str(peer),
                             "--peer-harness", str(harness)]) == 0
    assert order == ["hybridkv", "vLLM-CPU", "vLLM-CPU", "hybridkv", "hybridkv", "vLLM-CPU"]
    out = capsys.readouterr().out
    assert "| req/s | 1.050 | 1.000 | 1.05x | yes |" in out, out
    row = next(ln for ln in out.splitlines() if ln.strip().startswith("req/s") and "median" in ln)
    assert "1.200x 0.900x 1.050x  median 1.050x" in row, row


@pytest.mark.slow
def test_both_servers_run_in_turn_under_the_same_load(tiny_ckpt, tmp_path, monkeypatch, capsys):
    harness, peer, fake_pkg = tmp_path / "harness", tmp_path / "peer", tmp_path / "fake_vllm"
    (peer / "venv" / "bin").mkdir(parents=True)
    # A wrapper, not a symlink: a symlinked interpreter outside its venv loses the venv's packages.
    python = peer / "venv" / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    harness.mkdir()
    (harness / "bench_serve.py").write_text(FAKE_BENCH_SERVE)
    api = fake_pkg / "vllm" / "entrypoints" / "openai"
    api.mkdir(parents=True)
    for d in (fake_pkg / "vllm", fake_pkg / "vllm" / "entrypoints", api):
        (d / "__init__.py").write_text("")
    (api / "api_server.py").write_text(FAKE_VLLM_API_SERVER)
    (harness / "env.sh").write_text(f"export FAKE_ENV_SOURCED=1 PYTHONPATH={fake_pkg}\n")
    monkeypatch.setenv("FAKE_CALLS", str(tmp_path / "calls.jsonl"))
    model = tiny_ckpt("llama")

    rc = online_peer.main(["--model", model, "--num-prompts", "4", "--input-len", "12", "--output-len", "3",
                           "--concurrency", "2", "--warmup-prompts", "2", "--repeats", "2", "--peer-dir", str(peer),
                           "--peer-harness", str(harness), "--ready-timeout", "120", "--pass-timeout", "120"])
    assert rc == 0
    out = capsys.readouterr().out
    results = json.loads(out.split("RESULT ", 1)[1])
    assert set(results) == {"hybridkv", "vLLM-CPU"}
    assert all(r["request_throughput"] > 0 for r in results.values())
    assert "| req/s |" in out and "x |" in out  # the ratio column is printed
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    # Per server: one warm-up pass of 2 prompts, then 2 measured passes of 4, on its own port.
    assert [c["num_prompts"] for c in calls] == ["2", "4", "4"] * 2
    assert len({c["base_url"] for c in calls[:3]}) == 1 and len({c["base_url"] for c in calls}) == 2
    assert all(c["model"] == model and c["random_input_len"] == "12" and c["random_output_len"] == "3"
               and c["max_concurrency"] == "2" and c["ignore_eos"] and c["dataset_name"] == "random"
               for c in calls)
    # Both servers were stopped: nothing answers on their ports any more.
    import urllib.error
    import urllib.request
    for url in {c["base_url"] for c in calls}:
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(url + "/v1/models", timeout=2)


def test_a_server_that_dies_before_it_is_ready_is_reported_at_once(tmp_path):
    """No waiting out the ready timeout on a server that exited: the error names its exit code."""
    cmd = [sys.executable, "-c", "import sys; sys.exit(3)"]
    with pytest.raises(RuntimeError, match="exited with code 3"):
        online_peer.measure("dead", cmd, online_peer.free_port(), "m", online_peer.Load(), 1, 0, str(tmp_path),
                            str(tmp_path), ready_timeout_s=60, pass_timeout_s=60)


def test_a_pass_with_failed_requests_is_an_error_not_a_figure(tmp_path, monkeypatch):
    """A load pass that completed fewer requests than it sent must not become a throughput figure."""
    harness = tmp_path / "harness"
    harness.mkdir()
    (harness / "bench_serve.py").write_text(
        "import argparse, json, os\nap = argparse.ArgumentParser()\n"
        "ap.add_argument('--result-dir'); ap.add_argument('--result-filename')\n"
        "a, _ = ap.parse_known_args()\n"
        "json.dump({'completed': 3, 'errors': ['', 'ConnectionResetError', ''], 'duration': 1.0},"
        " open(os.path.join(a.result_dir, a.result_filename), 'w'))\n")
    peer = tmp_path / "peer" / "venv" / "bin"
    peer.mkdir(parents=True)
    (peer / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (peer / "python").chmod(0o755)
    with pytest.raises(RuntimeError, match="3 of 4 requests completed.*ConnectionResetError"):
        online_peer.bench_serve("http://127.0.0.1:1", "m", online_peer.Load(), 4, str(tmp_path / "peer"),
                                str(harness), timeout_s=60)

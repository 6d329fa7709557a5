"""DeepSeek-V4 at long context: decode tok/s vs context length, prefill against the GEMM limit.

Builds a tiny V4 checkpoint (real compression ratios 4 / 128, window 128, page 128; an
indexer of 8 heads x 64 dims, between the tests' toy and V4-Flash's 64 x 128), then for each
context length prefills one prompt of that length and times single-sequence greedy decode.

Decode: tok/s is 1 / the median step time over --repeats runs of --decode-steps steps (the
runs' own rates are printed too), as a ratio to a 4k-token reference decode held in a second
engine on the same model and stepped alternately with it (ABBA), so that both see the same
seconds of this VM's drifting speed, and to the first context; the seeds' claim is < 10%
slower from 4k to 900k. --profile adds torch.profiler's view of a decode step at each context
and at the reference (what is left that grows with context). --torch-indexer runs the torch
indexer instead of the fused CPU kernel, --torch-attention the torch joint softmax and Sinkhorn
loop instead of theirs (the A/Bs). Prefill: the floating-point operations the prefill must do are counted from
the config (projections incl. the routed experts and hyper-connections, the lightning
indexer's scoring of every causal C4 entry, and attention over the SWA window, the top-k C4
and all causal C128 entries), divided by the measured prefill time, and shown against the fp32
GEMM throughput measured right before and right after that prefill (a 2048^3 matmul on the
same threads). Peak RSS is
reported with the bound the block sizes give the transient memory (independent of context).
Also: KV bytes per token the engine holds (all its spaces) vs a dense cache, and the same
arithmetic at DeepSeek-V4-Flash dimensions.

    python benchmarks/v4_long_context.py [--contexts 1024 4096 16384 65536 131072] [--threads 2] [--profile]
    python benchmarks/v4_long_context.py --contexts 16384 --ref-context 16384 --kv-cache-dtype fp8  # FP8 vs auto
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402

from hybridkv.attention_backends.hybrid_metadata import PREFILL_BLOCK_ROWS  # noqa: E402
from hybridkv.engine.sampling_params import SamplingParams  # noqa: E402
from hybridkv.entrypoints import LLM  # noqa: E402
from hybridkv.cpu_features import cpu_features  # noqa: E402


BENCH_CONFIG = dict(
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    sliding_window=128,
    index_topk=64,
    max_position_embeddings=1 << 18,
)


def build_checkpoint(path: str, index_heads: int = 8, index_dim: int = 64) -> str:
    from tiny_deepseek_v4 import build_v4_checkpoint

    return build_v4_checkpoint(path, index_n_heads=index_heads, index_head_dim=index_dim, **BENCH_CONFIG)


def gemm_gflops(threads: int, n: int = 2048, reps: int = 5) -> float:
    """fp32 matmul throughput on these threads (best of reps)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def prefill_flops(llm: LLM, T: int) -> dict[str, float]:
    """Matmul FLOPs (2 per multiply-add) of prefilling T tokens, by part."""
    from hybridkv.model_executor.models.deepseek_v4.config import CSA, HCA

    model = llm.engine.runner.model
    cfg = model.cfg
    dense_macs = 0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and ".experts." not in name and name != "head":
            dense_macs += mod.in_features * mod.out_features
    for name, p in model.named_parameters():
        if name.endswith(("hc_attn.fn", "hc_ffn.fn", "hc_fn", ".gate.weight")):
            dense_macs += p.numel()  # hyper-connection mixes, routers (plain Parameters)
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    routed_macs = cfg.num_layers * cfg.num_experts_per_tok * expert
    hc_expand = 2 * cfg.num_layers * cfg.hc_mult**2 * cfg.hidden_size  # comb^T X per sublayer
    projections = 2.0 * T * (dense_macs + routed_macs + hc_expand) + 2.0 * cfg.hidden_size * cfg.vocab_size
    t = torch.arange(1, T + 1, dtype=torch.float64)  # keys a query at position t-1 may see
    H, D = cfg.num_heads, cfg.head_dim
    swa = torch.clamp(t, max=cfg.sliding_window).sum().item()
    c4 = torch.floor(t / cfg.csa_ratio)
    c128 = torch.floor(t / cfg.hca_ratio).sum().item()
    n_csa = sum(x == CSA for x in cfg.layer_types)
    n_hca = sum(x == HCA for x in cfg.layer_types)
    attention = 4.0 * H * D * (cfg.num_layers * swa + n_csa * torch.clamp(c4, max=cfg.index_topk).sum().item()
                               + n_hca * c128)
    indexer = 2.0 * n_csa * cfg.index_n_heads * (cfg.index_head_dim + 1) * c4.sum().item()
    return {"projections": projections, "indexer": indexer, "attention": attention}


def transient_bound_mib(llm: LLM, chunk: int) -> float:
    """What the block sizes allow a prefill step beyond the KV pools and weights (float32):
    the chunk's activations (hidden x hc_mult streams, q/k heads, MoE, ~16 live [chunk, width]
    tensors of the widest width) plus one query block's indexer and attention intermediates. The
    indexer term is the torch path's score tensors; the fused CPU kernel (cpu_kernels/indexer_topk.cpp)
    holds less -- one packed key block (~128 KB) per thread and 2k + 256 candidates per row."""
    from hybridkv.attention_backends import hybrid_v4

    cfg = llm.engine.runner.model.cfg
    width = max(cfg.hidden_size * cfg.hc_mult, cfg.num_heads * cfg.head_dim, cfg.index_n_heads * cfg.index_head_dim,
                cfg.moe_intermediate_size * cfg.num_experts_per_tok)
    acts = 16 * chunk * width
    rows = PREFILL_BLOCK_ROWS
    key_block = max(hybrid_v4.INDEXER_KEY_BLOCK, hybrid_v4.INDEXER_BLOCK_ELEMS // (rows * cfg.index_n_heads))
    indexer = rows * cfg.index_n_heads * key_block + 3 * rows * key_block + key_block * cfg.index_head_dim
    attn_keys = cfg.sliding_window + PREFILL_BLOCK_ROWS + max(cfg.index_topk, hybrid_v4.ENTRY_KEY_BLOCK)
    attention = 3 * rows * cfg.num_heads * attn_keys + rows * attn_keys * cfg.head_dim
    return 4 * (acts + indexer + attention) / 2**20


def held_bytes(llm: LLM, rid: str) -> int:
    kv = llm.engine.kv
    total = 0
    for name, spec in kv.specs.items():
        pages = sum(1 for p in kv.page_table(rid, name) if p >= 0)
        total += pages * spec.bytes_per_page(kv.page_size)
    return total


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


PROFILE_STEPS = 8


def profile_decode(llm: LLM, steps: int = PROFILE_STEPS, top: int = 12) -> list[tuple[str, float, int]]:
    """(op, self CPU ms per step, calls per step) of the `top` costliest ops over `steps` decode
    steps of what is running, from torch.profiler; "(step total)" first."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            llm.engine.step()
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops) / 1e3 / steps
    return [("(step total, self CPU)", total, 0)] + [
        (e.key, e.self_cpu_time_total / 1e3 / steps, e.count // steps) for e in ops[:top]]


def start(llm: LLM, context: int, seed: int, max_tokens: int) -> dict:
    """Prefill a random `context`-token prompt (ends with its first sampled token) and take one
    untimed decode step."""
    eng = llm.engine
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, eng.runner.config.vocab_size, (context,), generator=g).tolist()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rss0 = rss_mib()
    t0 = time.perf_counter()
    eng.add_request(f"ctx{context}", {"prompt_token_ids": prompt}, params)
    req = eng.scheduler.waiting[0]
    while req.num_output_tokens < 1:
        eng.step()
    prefill_s = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    eng.step()
    return dict(context=context, prefill_s=prefill_s, peak_rss=peak, rss_before=rss0,
                bytes=held_bytes(llm, req.request_id))  # the engine's sequence id (a child of the request's)


def finish(llm: LLM) -> None:
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def measure(llm: LLM, ref_llm: LLM, context: int, ref_context: int, steps: int, repeats: int, seed: int,
            profile: bool = False) -> dict:
    """Prefill `context` tokens in llm and `ref_context` tokens in ref_llm (a second engine on the
    same model), then time `repeats` runs of `steps` decode steps of each, interleaved step by
    step (ABBA order): this VM's speed drifts by +-25% over minutes, so the reference is measured
    in the same seconds as the context it is compared with. Decode rates are 1 / the median step
    (a shared 2-core VM's bursts of noise hit some steps, not the median). The prefill is
    compared with the GEMM rate measured right before and right after it, for the same reason."""
    budget = steps * repeats + 3 + PROFILE_STEPS * profile
    threads = torch.get_num_threads()
    gemm_before = gemm_gflops(threads)
    r = start(llm, context, seed, budget)
    r["gemm"] = (gemm_before + gemm_gflops(threads)) / 2  # the GEMM rate next to this prefill
    start(ref_llm, ref_context, seed + 1000, budget)
    step_s: dict[int, list[float]] = {0: [], 1: []}
    runs = []
    for _ in range(repeats):
        spent = 0.0
        for i in range(steps):
            for which in ((0, 1) if i % 2 == 0 else (1, 0)):
                t = time.perf_counter()
                (llm if which == 0 else ref_llm).engine.step()
                step_s[which].append(time.perf_counter() - t)
                spent += step_s[which][-1] * (which == 0)
        runs.append(steps / spent)
    r["profile"] = profile_decode(llm) if profile else None
    r["ref_profile"] = profile_decode(ref_llm) if profile else None
    finish(llm)
    finish(ref_llm)
    r.update(decode=1 / statistics.median(step_s[0]), ref=1 / statistics.median(step_s[1]), runs=runs)
    return r


def v4_flash_bytes_per_token(context: int) -> tuple[float, float]:
    """(V4 layout, dense) bytes per token at V4-Flash dims in bf16, page 128, one sequence."""
    from transformers import DeepseekV4Config

    cfg = DeepseekV4Config()
    n = cfg.num_hidden_layers
    csa = sum(t == "compressed_sparse_attention" for t in cfg.layer_types)
    hca = sum(t == "heavily_compressed_attention" for t in cfg.layer_types)
    D, cI, bf16, f32, P = cfg.head_dim, cfg.index_head_dim, 2, 4, 128
    window = cfg.sliding_window
    swa_tokens = min(context, (-(-(window - 1) // P) + 1) * P)
    state_tokens = min(context, (-(-(max(8, 128) - 1) // P) + 1) * P)
    per_token_history = csa * (D + cI) * bf16 / 4 + hca * D * bf16 / 128
    state_row = f32 * (csa * (4 * D + 4 * cI) + hca * 2 * D)
    v4 = per_token_history + (swa_tokens * n * D * bf16 + state_tokens * state_row) / context
    return v4, n * D * bf16


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 65536, 131072])
    ap.add_argument("--decode-steps", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ref-context", type=int, default=4096,
                    help="the reference decode, in a second engine, interleaved step by step with each context's")
    ap.add_argument("--chunk", type=int, default=4096, help="max_num_batched_tokens (the prefill chunk)")
    ap.add_argument("--index-heads", type=int, default=8)
    ap.add_argument("--index-dim", type=int, default=64)
    ap.add_argument("--model", default=None, help="a V4 checkpoint folder (default: build the tiny one)")
    ap.add_argument("--torch-indexer", action="store_true",
                    help="score the indexer with the torch path instead of the fused CPU kernel (the A/B)")
    ap.add_argument("--torch-attention", action="store_true",
                    help="run the joint softmax attention and mHC's Sinkhorn loop in torch ops instead of the fused "
                         "CPU kernels (the A/B)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                    help="the measured engine's KV pools; the reference engine keeps auto, so with --ref-context "
                         "equal to the context the 'vs ref' column is this dtype's decode against auto's, interleaved")
    ap.add_argument("--profile", action="store_true",
                    help=f"also profile {PROFILE_STEPS} decode steps at each context and at the reference")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.torch_indexer:
        from hybridkv.attention_backends import hybrid_v4

        hybrid_v4.load_indexer_topk = lambda: None  # cpu_indexer_topk then runs indexer_topk
    if args.torch_attention:
        from hybridkv.attention_backends import hybrid_v4
        from hybridkv.model_executor.models.deepseek_v4 import mhc

        hybrid_v4.load_joint_attention = lambda: None  # cpu_joint_attention then runs torch_joint_attention
        mhc.fused_ops = lambda: None  # sinkhorn_ then runs its torch loop
    gemm = gemm_gflops(args.threads)
    print(f"CPU: {cpu_features().describe()}; torch {torch.__version__}, {args.threads} threads; "
          f"fp32 GEMM (2048^3) {gemm:.1f} GFLOP/s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or build_checkpoint(os.path.join(tmp, "v4"), args.index_heads, args.index_dim)
        max_len = max(max(args.contexts), args.ref_context) + args.decode_steps * args.repeats + PROFILE_STEPS + 8
        llm = LLM(path, dtype="float32", max_model_len=max_len, max_num_seqs=1, max_num_batched_tokens=args.chunk,
                  kv_cache_dtype=args.kv_cache_dtype)
        ref_len = args.ref_context + args.decode_steps * args.repeats + PROFILE_STEPS + 8
        ref_llm = LLM(path, dtype="float32", max_model_len=ref_len, max_num_seqs=1,
                      max_num_batched_tokens=args.chunk)
        cfg = llm.engine.runner.model.cfg
        # warm-up: first calls of every op, in both engines
        measure(llm, ref_llm, min(512, min(args.contexts)), min(512, args.ref_context), 4, 1, seed=99)
        rows = []
        for i, ctx in enumerate(args.contexts):
            r = measure(llm, ref_llm, ctx, args.ref_context, args.decode_steps, args.repeats, seed=i,
                        profile=args.profile)
            r["flops"] = prefill_flops(llm, ctx)
            rows.append(r)
            runs = " ".join(f"{x:.1f}" for x in r["runs"])
            print(f"  context {ctx:>6}: decode {r['decode']:6.1f} tok/s (runs {runs}; {args.ref_context}-token reference "
                  f"interleaved with it {r['ref']:.1f}), prefill {r['prefill_s']:.1f} s, peak RSS {r['peak_rss']:.0f} MiB",
                  flush=True)
        llm.engine.kv.assert_idle()
        ref_llm.engine.kv.assert_idle()
    base = rows[0]
    dense_per_token = cfg.num_layers * cfg.head_dim * 4
    bound = transient_bound_mib(llm, args.chunk)
    print()
    print(f"tiny V4: {cfg.num_layers} layers {list(cfg.layer_types)}, hidden {cfg.hidden_size}, {cfg.num_heads} heads x "
          f"head_dim {cfg.head_dim}, indexer {cfg.index_n_heads} x {cfg.index_head_dim} top-{cfg.index_topk}, ratios "
          f"{cfg.csa_ratio}/{cfg.hca_ratio}, window {cfg.sliding_window}, page {llm.engine.kv.page_size}, float32, "
          f"chunk {args.chunk}; indexer {'torch' if args.torch_indexer else 'fused CPU kernel where it builds'}; "
          f"attention and Sinkhorn {'torch' if args.torch_attention else 'fused CPU kernels where they build'}")
    print(f"CPU: {cpu_features().describe()}, {args.threads} threads; fp32 GEMM {gemm:.1f} GFLOP/s at the start "
          "(GEMM column: measured right before and after each prefill; vs GEMM uses it)")
    print(f"{'context':>8} {'decode tok/s':>12} {'vs ' + str(base['context']):>8} {'vs ' + str(args.ref_context):>8} "
          f"{'prefill s':>10} {'prefill tok/s':>13} {'GFLOP':>9} {'idx %':>6} {'GFLOP/s':>8} {'GEMM':>6} {'vs GEMM':>8} "
          f"{'prefill+decode s':>16} {'peak RSS MiB':>12} {'KV B/tok':>9}")
    for r in rows:
        total = sum(r["flops"].values())
        rate = total / r["prefill_s"] / 1e9
        wall = r["prefill_s"] + sum(args.decode_steps / x for x in r["runs"])
        print(f"{r['context']:>8} {r['decode']:>12.1f} {r['decode'] / base['decode']:>8.2f} "
              f"{r['decode'] / r['ref']:>8.2f} {r['prefill_s']:>10.1f} {r['context'] / r['prefill_s']:>13.0f} "
              f"{total / 1e9:>9.1f} {100 * r['flops']['indexer'] / total:>6.1f} {rate:>8.1f} {r['gemm']:>6.0f} "
              f"{rate / r['gemm']:>8.2f} "
              f"{wall:>16.1f} {r['peak_rss']:>12.0f} {r['bytes'] / (r['context'] + 2):>9.0f}")
    print(f"transient prefill memory bound from the block sizes: {bound:.0f} MiB (chunk {args.chunk} tokens, query "
          f"blocks of {PREFILL_BLOCK_ROWS} rows, indexer/entry key blocks); RSS growth over the largest prefill: "
          f"{rows[-1]['peak_rss'] - rows[-1]['rss_before']:.0f} MiB (KV pages are first touched then too)")
    print(f"dense cache of this model: {dense_per_token} B/token")
    print()
    print("V4-Flash dims (43 layers, D=512, c_I=128, bf16 entries, fp32 compress state), one sequence:")
    for ctx in (4096, 65536, 1 << 20):
        v4, dense = v4_flash_bytes_per_token(ctx)
        print(f"  context {ctx:>8}: V4 layout {v4:8.0f} B/token vs dense {dense} B/token ({v4 / dense:.3f}x)")
    if args.profile:
        print()
        profiles = [(args.ref_context, rows[0]["ref_profile"])] + [(r["context"], r["profile"]) for r in rows]
        for ctx, prof in profiles:
            print(f"profile of one decode step at context {ctx} (torch.profiler, {PROFILE_STEPS} steps; "
                  "self CPU ms per step, calls per step):")
            for name, ms, calls in prof:
                print(f"  {ms:8.3f} ms  {calls:>5}  {name}")
    fields = [f"decode_{r['context']}={r['decode']:.2f}" for r in rows]
    fields += [f"decode_x_{r['context']}={r['decode'] / r['ref']:.3f}" for r in rows]
    fields += [f"gemm_x_{r['context']}={sum(r['flops'].values()) / r['prefill_s'] / 1e9 / r['gemm']:.3f}" for r in rows]
    print("RESULT " + " ".join(fields) + f" gemm_gflops={gemm:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

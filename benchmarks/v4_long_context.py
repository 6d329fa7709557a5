"""DeepSeek-V4 long-context decode: tokens/s vs context length, and KV bytes per token.

Builds a tiny V4 checkpoint (real compression ratios 4 / 128, window 128, page 128), then for
each context length prefills one prompt of that length and times single-sequence greedy
decode steps. Prints decode tok/s as a ratio to the 1k-context figure measured in the same
run, and the KV bytes per token of context the engine actually holds (all five spaces, page
granularity) next to a dense cache of the same model (one K=V vector per token per layer),
plus the same arithmetic at DeepSeek-V4-Flash dimensions.

The seed article reports a < 10% decode-speed drop from 4k to 900k tokens on an H200 with
fused kernels; this is the torch-native CPU backend with a tiny model, where the per-step
O(context) work (indexer scores over every C4 entry, metadata over the page tables) is
not hidden behind large fixed per-token costs. Numbers are reported as measured.

    python benchmarks/v4_long_context.py [--contexts 1024 4096 16384 65536] [--decode-steps 32]
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402

from hybridkv.engine.sampling_params import SamplingParams  # noqa: E402
from hybridkv.entrypoints import LLM  # noqa: E402

BENCH_CONFIG = dict(
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    sliding_window=128,
    index_n_heads=4,  # keeps the 64k-token prefill (indexer over 16k entries per query) in seconds
    index_head_dim=16,
    index_topk=64,
    max_position_embeddings=1 << 17,
)


def build_checkpoint(path: str) -> str:
    from tiny_deepseek_v4 import build_v4_checkpoint

    return build_v4_checkpoint(path, **BENCH_CONFIG)


def held_bytes(llm: LLM, rid: str) -> int:
    kv = llm.engine.kv
    total = 0
    for name, spec in kv.specs.items():
        pages = sum(1 for p in kv.page_table(rid, name) if p >= 0)
        total += pages * spec.bytes_per_page(kv.page_size)
    return total


def measure(llm: LLM, context: int, steps: int, seed: int) -> tuple[float, int]:
    """Prefill `context` tokens, then time `steps` decode steps; returns (tok/s, bytes held)."""
    eng = llm.engine
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, eng.runner.config.vocab_size, (context,), generator=g).tolist()
    rid = f"ctx{context}"
    eng.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=steps + 3, ignore_eos=True))
    req = eng.scheduler.waiting[0]
    while req.num_computed_tokens < context or req.num_output_tokens < 2:  # prefill + 1 warm decode
        eng.step()
    bytes_held = held_bytes(llm, req.request_id)  # the engine's sequence id (a child of rid)
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    dt = time.perf_counter() - t0
    while eng.has_unfinished_requests():
        eng.step()
    return steps / dt, bytes_held


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default=None, help="a V4 checkpoint folder (default: build the tiny one)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or build_checkpoint(os.path.join(tmp, "v4"))
        max_len = max(args.contexts) + args.decode_steps + 8
        llm = LLM(path, dtype="float32", max_model_len=max_len, max_num_seqs=1, max_num_batched_tokens=4096)
        cfg = llm.engine.runner.model.cfg
        dense_per_token = cfg.num_layers * cfg.head_dim * 4
        rows = []
        for i, ctx in enumerate(args.contexts):
            t0 = time.perf_counter()
            tps, held = measure(llm, ctx, args.decode_steps, seed=i)
            rows.append((ctx, tps, held))
            print(f"  context {ctx:>6}: {tps:7.1f} decode tok/s  (prefill+decode {time.perf_counter() - t0:.1f}s, "
                  f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)",
                  flush=True)
        llm.engine.kv.assert_idle()
    base = rows[0][1]
    print()
    print(f"tiny V4: {cfg.num_layers} layers {cfg.layer_types}, head_dim {cfg.head_dim}, ratios 4/{cfg.hca_ratio}, "
          f"window {cfg.sliding_window}, page {llm.engine.kv.page_size}, float32, CPU threads {args.threads}")
    print(f"{'context':>8} {'decode tok/s':>13} {'vs ' + str(rows[0][0]):>9} {'KV B/token':>11} {'dense B/token':>14} {'V4/dense':>9}")
    for ctx, tps, held in rows:
        per_tok = held / (ctx + 2)
        print(f"{ctx:>8} {tps:>13.1f} {tps / base:>9.2f} {per_tok:>11.1f} {dense_per_token:>14} {per_tok / dense_per_token:>9.3f}")
    print()
    print("V4-Flash dims (43 layers, D=512, c_I=128, bf16 entries, fp32 compress state), one sequence:")
    for ctx in (4096, 65536, 1 << 20):
        v4, dense = v4_flash_bytes_per_token(ctx)
        print(f"  context {ctx:>8}: V4 layout {v4:8.0f} B/token vs dense {dense} B/token ({v4 / dense:.3f}x)")


if __name__ == "__main__":
    main()

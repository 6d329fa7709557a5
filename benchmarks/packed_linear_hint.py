"""oneDNN's packed linear weights: how the row count a weight is packed for changes each step's speed.

model_executor/layers.PackedLinearWeight packs every projection with PACK_ROWS_HINT rows in mind.
This times the demo model's projections (30 layers of qkv 576->960, o 576->576, gate_up
576->3072, down 1536->576) plus its 576->49,152 logits, one step of M rows, for each hint.
Every layer has its own weights, so they come from memory as in a real step, not from cache.
Hints are interleaved round by round, so the machine's drift hits them alike; medians printed.

    python benchmarks/packed_linear_hint.py [--hints 1,16] [--rows 1,2,16,32,1024] [--rounds 8]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

LAYERS = 30
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out) per layer
VOCAB = 49152


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hints", default="1,16")
    ap.add_argument("--rows", default="1,2,16,32,1024")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        raise SystemExit("this torch build has no oneDNN packed linear")
    hints = [int(h) for h in args.hints.split(",")]
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    flags = open("/proc/cpuinfo").read()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "?"
    print(f"CPU: {cpu} ({isa}), {args.threads} threads, float32; demo model's projections + logits per step")
    g = torch.Generator().manual_seed(0)

    def pack(n: int, k: int, hint: int) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k, generator=g), hint)

    packs = {h: ([[pack(n, k, h) for k, n in SHAPES] for _ in range(LAYERS)], pack(VOCAB, 576, h)) for h in hints}
    print("rows | " + " | ".join(f"hint {h} ms" for h in hints) + f" | hint {hints[0]} / hint {hints[-1]}")
    for m in (int(r) for r in args.rows.split(",")):
        x = {576: torch.randn(m, 576), 1536: torch.randn(m, 1536)}

        def step(h: int) -> None:
            layers, head = packs[h]
            for layer in layers:
                for (k, _), w in zip(SHAPES, layer):
                    torch.ops.mkldnn._linear_pointwise(x[k], w, None, "none", [], "")
            torch.ops.mkldnn._linear_pointwise(x[576], head, None, "none", [], "")

        times: dict[int, list[float]] = {h: [] for h in hints}
        for h in hints:
            step(h)  # warm-up
        rounds = args.rounds if m < 256 else max(2, args.rounds // 4)
        for _ in range(rounds):
            for h in hints:
                t = time.perf_counter()
                step(h)
                times[h].append(time.perf_counter() - t)
        med = [1000 * statistics.median(times[h]) for h in hints]
        print(f"{m:4d} | " + " | ".join(f"{t:.1f}" for t in med) + f" | {med[0] / med[-1]:.2f}x")


if __name__ == "__main__":
    main()

"""Hardware limits for a dense decoder checkpoint, measured in the same run as the benchmark.

Two numbers bound a CPU engine: the memory bandwidth that streams the weights (decode reads
every weight once per step, whatever the batch) and the matmul rate (prefill does ~2 FLOPs per
weight per token). Both are measured here with torch on this machine, then turned into
per-workload limits for the checkpoint and dtype the engine ran:

    decode tok/s limit  = copy bandwidth / weight bytes per step        (x batch, until GEMM-bound)
    prefill tok/s limit = fp32/bf16 GEMM rate / FLOPs per prompt token  (projections + attention)

The GEMM rate is what one torch matmul reaches, which an engine's own kernels can beat. The
vector FMA peak (`fma_peak`: FMAs on registers alone, compiled on first use) is the ceiling
above it, printed beside the GEMM line.

Copy bandwidth counts the bytes read and written. A weight stream is reads only, so the
read probe (a sum over a large tensor) is printed beside it as a second, diagnostic line. They
need not agree: on a 2-core Zen 4 VM one sitting read 33.1 GB/s by copy, 32.6 by torch's sum and
35.8 by an AVX-512 read of huge pages, while another phase of the same VM read 51.3 by copy. The
"of limit" figures keep the copy line, as the performance goals define it.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass

import torch

DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def median_seconds(fn, repeats: int, warmup: bool = True) -> float:
    """Median wall time of fn over repeats calls (after one untimed call when warmup: page
    faults, the thread pool's start)."""
    if warmup:
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(mib: int = 256, repeats: int = 7) -> float:
    """Bytes/s of a large tensor copy (read + write), far larger than any cache."""
    src = torch.ones(mib << 18)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / median_seconds(lambda: dst.copy_(src), repeats)


def read_bandwidth(mib: int = 256, repeats: int = 7) -> float:
    """Bytes/s of a sum over a large tensor (reads only), far larger than any cache; the pages
    are written first, so they are real memory and not the shared zero page."""
    src = torch.ones(mib << 18)
    return src.numel() * 4 / median_seconds(src.sum, repeats)


def gemm_rate(dtype: torch.dtype = torch.float32, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a square n^3 matmul in dtype (what prefill projections can reach at best)."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    return 2 * n**3 / median_seconds(lambda: a @ b, repeats)


def fma_peak(dtype: torch.dtype = torch.float32, seconds: float = 0.3, repeats: int = 3) -> float | None:
    """FLOP/s of vector FMAs on registers alone, every torch thread at once (fma_peak.cpp): the
    rate no matmul can pass, where gemm_rate is what one torch matmul reaches (the engine's
    own kernels may beat it). None when the probe cannot be built here (no compiler) or the CPU
    has no vector FMA of that dtype (bfloat16 without AVX512-BF16)."""
    from pathlib import Path

    from hybridkv.attention_backends.cpu_kernels import build_cpu_extension

    module = build_cpu_extension("hybridkv_fma_peak", Path(__file__).with_name("fma_peak.cpp"), ["fma_peak"],
                                 "FMA-peak probe")
    if module is None:
        return None
    kind = "bfloat16" if dtype == torch.bfloat16 else "float32"
    best = max(module.fma_peak(kind, seconds) for _ in range(repeats))
    return best or None


@dataclass
class DenseModelCost:
    """What one token costs a dense decoder (Llama-like) checkpoint, from its config and
    safetensors headers (no weights are loaded)."""

    weight_bytes: float  # bytes read per decode step: every linear weight + the LM head
    linear_params: int  # parameters in the layers' linear projections (no embeddings, no head)
    head_params: int  # LM head (tied or not): vocab x hidden
    num_layers: int
    attn_width: int  # heads x head_dim (queries)

    def prefill_flops(self, prompt_len: int) -> float:
        """FLOPs of one prompt's prefill: projections for every token, causal attention
        (QK^T and PV over (t+1) keys for token t), the LM head for the last token only."""
        causal_keys = prompt_len * (prompt_len + 1) / 2
        return (2.0 * self.linear_params * prompt_len + 4.0 * self.num_layers * self.attn_width * causal_keys
                + 2.0 * self.head_params)

    def decode_limit(self, bandwidth: float, gemm: float, batch: int = 1) -> float:
        """Output tok/s bound of a decode step over `batch` sequences: weights streamed once per
        step, or the matmul rate when the batch makes the step compute-bound."""
        step_flops = 2.0 * (self.linear_params + self.head_params) * batch
        step_s = max(self.weight_bytes / bandwidth, step_flops / gemm)
        return batch / step_s


def dense_model_cost(model_dir: str, dtype: torch.dtype) -> DenseModelCost:
    from safetensors import safe_open

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    shapes: dict[str, list[int]] = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, name), "pt") as st:
                for key in st.keys():
                    shapes[key] = st.get_slice(key).get_shape()
    numel = {k: int(torch.Size(s).numel()) for k, s in shapes.items()}
    embed = sum(v for k, v in numel.items() if k.endswith("embed_tokens.weight"))
    untied_head = sum(v for k, v in numel.items() if k.endswith("lm_head.weight"))
    head = untied_head or embed  # a tied head reads the embedding matrix
    norms = sum(v for k, v in numel.items() if len(shapes[k]) == 1)  # norm weights, biases
    linear = sum(numel.values()) - embed - untied_head - norms
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return DenseModelCost(weight_bytes=(linear + head + norms) * DTYPE_BYTES[dtype], linear_params=linear,
                          head_params=head, num_layers=cfg["num_hidden_layers"], attn_width=heads * head_dim)

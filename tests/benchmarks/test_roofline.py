"""benchmarks/roofline.py: the limits offline_throughput.py prints must be computed from the
checkpoint it ran (every linear weight counted once, a tied LM head once) and from rates
measured here; a wrong weight count would make every 'fraction of limit' figure wrong."""
from __future__ import annotations

import pytest
import torch

from bench_runner import load_benchmark
from tiny_checkpoints import build_checkpoint

roofline = load_benchmark("roofline")


@pytest.mark.parametrize("tied", [False, True])
def test_dense_model_cost_counts_every_weight_once(tmp_path, tied):
    path = build_checkpoint(str(tmp_path / "m"), tie_word_embeddings=tied)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    cfg = model.config
    linear = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n and "lm_head" not in n)
    norms = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    head = cfg.vocab_size * cfg.hidden_size
    for dtype, nbytes in ((torch.float32, 4), (torch.bfloat16, 2)):
        cost = roofline.dense_model_cost(path, dtype)
        assert (cost.linear_params, cost.head_params) == (linear, head)
        assert cost.weight_bytes == (linear + head + norms) * nbytes  # the input embedding is a gather
    T = 100
    attn = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads) * T * (T + 1) / 2
    assert cost.prefill_flops(T) == 2 * linear * T + attn + 2 * head


def test_decode_limit_is_bandwidth_bound_at_batch_one_and_compute_bound_at_large_batches():
    cost = roofline.DenseModelCost(weight_bytes=4e8, linear_params=9e7, head_params=1e7, num_layers=2, attn_width=64)
    bw, gemm = 2e10, 1e11
    assert cost.decode_limit(bw, gemm) == pytest.approx(bw / 4e8)
    assert cost.decode_limit(bw, gemm, batch=10**4) == pytest.approx(gemm / (2 * 1e8))


def test_measured_rates_are_positive_and_finite():
    bw = roofline.copy_bandwidth(mib=8, repeats=2)
    read = roofline.read_bandwidth(mib=8, repeats=2)
    gemm = roofline.gemm_rate(torch.float32, n=128, repeats=2)
    assert 1e8 < bw < 1e13 and 1e8 < read < 1e13 and 1e7 < gemm < 1e14


def test_the_fma_peak_is_a_ceiling_above_the_gemm_line_and_counts_bf16_pairs():
    """The vector FMA peak bounds every matmul (a probe below a torch GEMM would count FLOPs
    wrong or time the wrong thing), and vdpbf16ps counts twice float32's FLOPs an instruction."""
    peak = roofline.fma_peak(torch.float32, seconds=0.05)
    if peak is None:
        pytest.skip("the FMA-peak probe cannot be built here")
    gemm = roofline.gemm_rate(torch.float32, n=256, repeats=3)
    assert peak > gemm, (peak, gemm)
    bf16 = roofline.fma_peak(torch.bfloat16, seconds=0.05)
    if bf16 is not None:  # AVX512-BF16: 2 products and 2 sums a float32 lane, same issue rate
        assert 1.4 < bf16 / peak < 2.6, (bf16, peak)

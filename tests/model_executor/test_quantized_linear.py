"""The pieces of block-quantized loading: codecs, the tiled kernel, QuantizedLinear, pairing.

References are written from the format definitions (torch's own float8 conversion, the e2m1
value table, 2**(e - 127)), independently of hybridkv's bit tricks.
"""
from __future__ import annotations

import pytest
import torch

from hybridkv.model_executor.quantization import (
    QuantizedLinear, attach_block_scales, block_quantized_from_checkpoint, parse_quantization_config,
)
from hybridkv.model_executor.quantization.codecs import decode_e2m1, decode_e4m3, decode_e8m0
from hybridkv.model_executor.quantization.matmul import dequantizing_matmul
from hybridkv.model_executor.quantization.summary import name_patterns
from tiny_quantized import quantize_fp8_blocks, quantize_mxfp4

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
V4 = parse_quantization_config({"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                "weight_block_size": [128, 128], "expert_dtype": "fp4"})
QWEN = parse_quantization_config({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                  "activation_scheme": "dynamic"})


def _reference(weight: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    if weight.dtype == torch.float8_e4m3fn:
        values = weight.float()
    else:
        b = weight.view(torch.uint8).long()
        values = torch.stack((E2M1[b & 15], E2M1[b >> 4]), -1).flatten(-2)
    s = torch.exp2(scale.view(torch.uint8).float() - 127) if scale.dtype == torch.float8_e8m0fnu else scale.float()
    rows, cols = values.shape
    return values * s.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def _fp8(rows: int, cols: int, ue8m0: bool, seed: int = 0, name: str = "w"):
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * cols**-0.5
    codes, scale = quantize_fp8_blocks(w, ue8m0=ue8m0)
    config = V4 if ue8m0 else QWEN
    return block_quantized_from_checkpoint(f"{name}.weight", codes, f"{name}.scale", scale, config), _reference(codes, scale, (128, 128))


def _fp4(rows: int, cols: int, seed: int = 0):
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * cols**-0.5
    codes, scale = quantize_mxfp4(w)
    return block_quantized_from_checkpoint("e.weight", codes, "e.scale", scale, V4), _reference(codes, scale, (1, 32))


# --------------------------------------------------------------------------- codecs


def test_e4m3_decoding_matches_torch_for_every_code():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = (codes & 0x7F) != 0x7F
    want = codes.view(torch.float8_e4m3fn).float()[finite]
    got = decode_e4m3(codes.view(torch.int8)).float()[finite] * 256
    assert torch.equal(got, want)  # exact, subnormals and signed zero included
    assert torch.equal(torch.signbit(got), torch.signbit(want))


def test_e2m1_and_e8m0_decoding_match_their_definitions():
    byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = decode_e2m1(byte.view(1, 256)).float().view(256, 2)
    assert torch.equal(got[:, 0], E2M1[byte.long() & 15]) and torch.equal(got[:, 1], E2M1[byte.long() >> 4])
    e = torch.arange(255, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(decode_e8m0(e), torch.exp2(e.float() - 127))  # 2^-127 (a subnormal) included
    assert torch.equal(decode_e8m0(e), e.view(torch.float8_e8m0fnu).float())


# --------------------------------------------------------------------------- the kernel


@pytest.mark.parametrize("ue8m0", [True, False])
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_fp8_matmul_equals_dense_matmul_across_tiles_and_partial_blocks(ue8m0, tokens):
    """[300, 200]: row blocks 128 + 128 + 44, column blocks 128 + 72. Small tiles force tiles
    inside a block row; 1 and 5 tokens take the scale-x path, 300 the scale-the-tile path."""
    q, ref = _fp8(300, 200, ue8m0)
    x = torch.randn(tokens, 200, generator=torch.Generator().manual_seed(1))
    want = x @ ref.t()
    for tile in (200 * 50, 1 << 19):
        torch.testing.assert_close(dequantizing_matmul(x, q, 0, 300, tile_elements=tile), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dequantizing_matmul(x, q, 100, 260, tile_elements=7000), want[:, 100:260],
                               atol=1e-5, rtol=1e-5)  # a row range starting mid-block (grouped wo_a)


@pytest.mark.parametrize("tokens", [1, 9])
def test_mxfp4_matmul_equals_dense_matmul(tokens):
    q, ref = _fp4(48, 96)
    x = torch.randn(tokens, 96, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(dequantizing_matmul(x, q, 0, 48, tile_elements=96 * 5), x @ ref.t(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("make", [lambda: _fp8(130, 160, ue8m0=False), lambda: _fp4(64, 160)])
def test_bfloat16_activations_multiply_in_float32_and_round_once(make):
    """bfloat16 in, bfloat16 out; the product is the float32 one rounded once."""
    q, ref = make()
    for tokens in (3, 40):  # scale-x and scale-the-tile paths
        x = torch.randn(tokens, 160, generator=torch.Generator().manual_seed(3)).bfloat16()
        got = dequantizing_matmul(x, q, 0, q.shape[0])
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, (x.float() @ ref.t()).bfloat16(), atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(q.dequantize(torch.bfloat16), ref.bfloat16(), atol=0, rtol=0)


# --------------------------------------------------------------------------- QuantizedLinear


def test_shards_whose_grids_line_up_merge_and_others_stay_apart():
    aligned = [(0, _fp8(128, 64, True, 0, "q")[0]), (128, _fp8(128, 64, True, 1, "k")[0]), (256, _fp8(40, 64, True, 2, "v")[0])]
    merged = QuantizedLinear(64, 296, aligned)
    assert len(merged.layout) == 1 and merged.checkpoint_names == ["q.weight", "k.weight", "v.weight"]
    small = [(0, _fp8(64, 64, True, 0)[0]), (64, _fp8(32, 64, True, 1)[0]), (96, _fp8(32, 64, True, 2)[0])]
    apart = QuantizedLinear(64, 128, small, bias=torch.nn.Parameter(torch.randn(128)))
    assert len(apart.layout) == 3
    for layer, shards in ((merged, aligned), (apart, small)):
        dense = torch.cat([t.dequantize() for _, t in shards])
        x = torch.randn(2, 3, 64)
        want = torch.nn.functional.linear(x, dense, layer.bias)
        torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer.dequantized_weight(), dense)
    with pytest.raises(ValueError, match=r"rows from 64 are not covered"):
        QuantizedLinear(64, 128, [small[0], small[2]])


def test_grouped_forward_equals_the_grouped_einsum():
    q, ref = _fp8(32, 96, True)  # DeepSeek-V4 wo_a: 2 groups of 16 rows inside one 128-row block
    layer = QuantizedLinear(96, 32, [(0, q)])
    x = torch.randn(5, 2, 96)
    want = torch.einsum("tgi,gri->tgr", x, ref.view(2, 16, 96))
    torch.testing.assert_close(layer.grouped_forward(x), want, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- pairing


def _pairs(*items):
    return list(attach_block_scales(iter(items), V4))


def test_pairing_is_order_and_naming_independent():
    codes, scale = quantize_fp8_blocks(torch.randn(8, 8))
    for items in ([("a.weight", codes), ("a.scale", scale)], [("a.scale", scale), ("a.weight", codes)],
                  [("a.weight_scale_inv", scale.float()), ("b.weight", torch.ones(2)), ("a.weight", codes)]):
        out = dict(attach_block_scales(iter(items), V4))
        assert out["a.weight"].shape == (8, 8) and "a.scale" not in out and "a.weight_scale_inv" not in out
    dense = dict(attach_block_scales(iter([("a.weight", codes), ("a.scale", scale)]), V4, dequantize=True))
    torch.testing.assert_close(dense["a.weight"], _reference(codes, scale, (128, 128)))
    # A `.scale` with no `.weight` at all is some model's own parameter: passed on untouched.
    assert dict(_pairs(("norm.scale", torch.ones(3))))["norm.scale"].shape == (3,)


@pytest.mark.parametrize("items,config,message", [
    ([("a.weight", torch.zeros(4, 4).to(torch.float8_e4m3fn))], V4,
     r"missing the block scale of 1 quantized weight\(s\): 'a.weight'"),
    ([("a.weight_scale_inv", torch.ones(1, 1))], V4, r"block scale 'a.weight_scale_inv' has no weight"),
    ([("a.weight", torch.ones(4, 4)), ("a.scale", torch.ones(1, 1))], V4,
     r"block scale 'a.scale' belongs to 'a.weight', which is stored unquantized"),
    ([("a.scale", torch.ones(1, 1)), ("a.weight_scale_inv", torch.ones(1, 1))], V4, r"has two block scales"),
    ([("a.weight", torch.zeros(4, 2, dtype=torch.int8)), ("a.scale", torch.ones(4, 1))], QWEN,
     r"'a.weight' is torch.int8 with a block scale, i.e. packed FP4.*expert_dtype is None"),
    ([("a.weight", torch.zeros(2, 4, 4).to(torch.float8_e4m3fn)), ("a.scale", torch.ones(2, 1, 1))], V4,
     r"'a.weight' is a 3-D quantized weight"),
    ([("a.weight", torch.zeros(4, 4).to(torch.float8_e5m2)), ("a.scale", torch.ones(1, 1))], V4,
     r"'a.weight' is stored as torch.float8_e5m2.*fmt 'e4m3'"),
    ([("a.weight", torch.zeros(4, 4).to(torch.float8_e4m3fn)),
      ("a.scale", torch.full((1, 1), 255, dtype=torch.uint8))], V4, r"'a.scale' holds the ue8m0 NaN code"),
    ([("a.weight", torch.zeros(4, 4).to(torch.float8_e4m3fn)), ("a.scale", torch.ones(1, 1, dtype=torch.int32))],
     V4, r"'a.scale' is stored as torch.int32"),
    ([("a.weight", torch.zeros(4, 64, dtype=torch.int8)), ("a.scale", torch.ones(4, 2))], V4,
     r"'a.scale' has shape \(4, 2\), but weight 'a.weight' \[4, 128\] in MXFP4 groups of 1x32 needs scale shape \[4, 4\]"),
    ([("a.weight_scale_inv", torch.ones(1, 1))], None, r"'a.weight_scale_inv' is an FP8 block scale, but config.json "
                                                        r"has no quantization_config"),
    ([("a.weight", torch.zeros(4, 4).to(torch.float8_e4m3fn))], None, r"'a.weight' is stored as torch.float8_e4m3fn, "
                                                                      r"a quantized format, but config.json has no"),
])
def test_broken_pairs_are_errors_naming_the_tensor(items, config, message):
    with pytest.raises(ValueError, match=message):
        list(attach_block_scales(iter(items), config))


def test_quantization_config_fields():
    assert parse_quantization_config({"quant_method": "fp8", "weight_block_size": [128, 128]}, "fp4").allows_fp4
    with pytest.raises(ValueError, match=r"expert_dtype='int4'"):
        parse_quantization_config({"quant_method": "fp8", "weight_block_size": [128, 128], "expert_dtype": "int4"})
    with pytest.raises(ValueError, match="no weight_block_size"):
        parse_quantization_config({"quant_method": "fp8"})
    assert parse_quantization_config({"quant_method": "fp8", "weight_block_size": [1, 32], "dequantize": True}).dequantize


def test_name_patterns_collapse_layer_and_expert_indices():
    names = [f"layers.{i}.ffn.experts.{e}.w1" for i in range(3) for e in range(4)] + ["head"]
    assert name_patterns(names) == "head, layers.*.ffn.experts.*.w1 (x12)"

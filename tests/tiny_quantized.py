"""Builds tiny block-quantized checkpoints on disk, in the formats models are released in.

  DeepSeek-V4 release format (deepseek_v4.md §10): original tensor names, FP8 e4m3 projections
  with 128x128 block scales, routed experts MXFP4 (e2m1 packed two per byte, one ue8m0 scale
  per 32 values) or FP8, the compressor / indexer projections, router, embedding and head in
  BF16 without scales, norms / hyper-connection / sinks in F32, a release-style config.json
  (legacy fields, top-level expert_dtype, quantization_config), MTP tensors, two shards.
  HF fine-grained FP8 (Qwen3-FP8 / Llama FP8): HF names, FP8 projections with float32
  `weight_scale_inv`, the rest dense.

The quantizers here only *write* checkpoints; tests dequantize them back with their own
reference code, so the quantization error itself never matters to a comparison.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile

import torch
from safetensors.torch import load_file, save_file

from tiny_checkpoints import build_checkpoint, build_tokenizer
from tiny_deepseek_v4 import mtp_tensors, randomize_

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
FP8_MAX, FP4_MAX = 448.0, 6.0


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(x)))


def _block_amax(w: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    rows, cols = w.shape
    gr, gc = -(-rows // br), -(-cols // bc)
    padded = torch.zeros(gr * br, gc * bc)
    padded[:rows, :cols] = w.abs()
    return padded.view(gr, br, gc, bc).amax(dim=(1, 3))


def quantize_fp8_blocks(w: torch.Tensor, block=(128, 128), ue8m0: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """float weight [N, K] -> (float8_e4m3fn codes [N, K], scales [cdiv(N,128), cdiv(K,128)]).

    ue8m0: power-of-two scales stored as float8_e8m0fnu (DeepSeek-V4); else float32 amax/448
    (DeepSeek-V3, Qwen3-FP8)."""
    w = w.float()
    br, bc = block
    amax = _block_amax(w, br, bc).clamp(min=1e-12)
    scales = _pow2_ceil(amax / FP8_MAX) if ue8m0 else amax / FP8_MAX
    full = scales.repeat_interleave(br, 0)[: w.shape[0]].repeat_interleave(bc, 1)[:, : w.shape[1]]
    codes = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scales.to(torch.float8_e8m0fnu) if ue8m0 else scales


def quantize_mxfp4(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """float weight [N, K] -> (int8 packed codes [N, K/2], low nibble first; e8m0 scales [N, K/32])."""
    w = w.float()
    rows, cols = w.shape
    assert cols % group == 0, "MXFP4 needs K to be a multiple of 32"
    amax = w.view(rows, cols // group, group).abs().amax(-1).clamp(min=1e-12)
    scales = _pow2_ceil(amax / FP4_MAX)
    q = w / scales.repeat_interleave(group, 1)
    codes = (q.unsqueeze(-1) - E2M1_VALUES).abs().argmin(-1)  # nearest e2m1 value (+0 before -0)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return packed.view(torch.int8), scales.to(torch.float8_e8m0fnu)


# --------------------------------------------------------------------------- DeepSeek-V4 release


def release_v4_config(vocab_size: int, expert_dtype: str = "fp4", **overrides) -> dict:
    """A config.json in the schema DeepSeek releases V4 with (legacy field names), tiny sizes.

    Widths are chosen so FP8 blocks are both whole and partial (hidden 160 = 128 + 32, q heads
    4 x 48 = 192) and MXFP4 groups whole (160 and 64 are multiples of 32)."""
    cfg = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": vocab_size, "hidden_size": 160, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 48, "qk_rope_head_dim": 12, "q_lora_rank": 96, "o_groups": 2,
        "o_lora_rank": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "moe_intermediate_size": 64, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc", "norm_topk_prob": True, "swiglu_limit": 10.0,
        "compress_ratios": [0, 4, 128, 4, 0],  # 4 layers + the MTP layer, as released
        "num_hash_layers": 1, "sliding_window": 16, "index_n_heads": 16, "index_head_dim": 16, "index_topk": 8,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "max_position_embeddings": 1024,
        "rope_scaling": {"type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 256},
        "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "expert_dtype": expert_dtype,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    }
    cfg.update(overrides)
    return cfg


def dense_config(config: dict) -> dict:
    """The same config without quantization (for the dequantized reference folder)."""
    cfg = {k: v for k, v in config.items() if k not in ("quantization_config", "expert_dtype")}
    return cfg


_FP8_PROJ = re.compile(r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight$|\.ffn\.shared_experts\.w[123]\.weight$"
                       r"|\.(e_proj|h_proj)\.weight$")
_EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
_BF16 = re.compile(r"compressor\.(wkv|wgate)\.weight$|indexer\.weights_proj\.weight$|ffn\.gate\.weight$"
                   r"|(^|\.)embed(_tokens)?\.weight$|^head\.weight$")
_RELEASE_RENAMES = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn",
                    "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}
HF_FROM_RELEASE = {v: k for k, v in _RELEASE_RENAMES.items()}


def hf_name_of_release(name: str) -> str:
    """Original release name -> transformers save_pretrained name (what from_pretrained reads)."""
    if name.startswith("model.") or name == "head.weight":
        return name
    return "model." + HF_FROM_RELEASE.get(name, name)


def _write_shards(path: str, tensors: dict[str, torch.Tensor], num_shards: int) -> None:
    """Sorted names dealt round-robin: a weight and its scale (adjacent names) land in different shards."""
    names = sorted(tensors)
    shard_names = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    weight_map = {n: shard_names[i % num_shards] for i, n in enumerate(names)}
    for shard in shard_names:
        save_file({n: tensors[n].contiguous() for n in names if weight_map[n] == shard}, os.path.join(path, shard),
                  metadata={"format": "pt"})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def build_release_v4_checkpoint(
    path: str, expert_dtype: str = "fp4", naming: str = "original", seed: int = 0, num_shards: int = 2,
    mtp: bool = False, **config_overrides,
) -> str:
    """Write a tiny DeepSeek-V4 checkpoint as DeepSeek releases it (see the module docstring).

    naming "original": release names, `<module>.scale` ue8m0 scales. naming "hf": save_pretrained
    names ("model." prefix), `<module>.weight_scale_inv` float32 FP8 scales (scale_fmt unset;
    MXFP4 experts keep ue8m0, which is what MX means). mtp: a whole MTP layer (tiny_deepseek_v4.
    mtp_tensors, quantized like the trunk); without it only two of its tensors, which a load
    without MTP speculation must skip."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    tok = build_tokenizer()
    config = release_v4_config(len(tok), expert_dtype, bos_token_id=tok.bos_token_id,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **config_overrides)
    if naming == "hf":
        config["quantization_config"] = {k: v for k, v in config["quantization_config"].items() if k != "scale_fmt"}
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**dense_config(config))).eval()
    randomize_(model, seed)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        dense = load_file(os.path.join(tmp, "model.safetensors"))
    if mtp:
        dense.update(mtp_tensors(model.config, seed))
    ue8m0 = naming == "original"
    out: dict[str, torch.Tensor] = {}
    for hf_name, t in dense.items():
        name = hf_name
        if naming == "original":
            name = hf_name.removeprefix("model.")
            name = _RELEASE_RENAMES.get(name, name)
        scale_suffix = ".scale" if naming == "original" else ".weight_scale_inv"
        module = name[: -len(".weight")]
        if _EXPERT.search(name) and expert_dtype == "fp4":
            out[name], out[module + scale_suffix] = quantize_mxfp4(t)
        elif _EXPERT.search(name) or _FP8_PROJ.search(name):
            out[name], out[module + scale_suffix] = quantize_fp8_blocks(t, ue8m0=ue8m0)
        elif _BF16.search(name):
            out[name] = t.to(torch.bfloat16)
        elif name.endswith("tid2eid"):
            out[name] = t.to(torch.int32) if naming == "original" else t
        else:
            out[name] = t.float()
    if not mtp:  # part of an MTP layer (FP8, like the trunk); inference without MTP speculation ignores it
        prefix = "mtp.0" if naming == "original" else "model.mtp.0"
        out[f"{prefix}.e_proj.weight"], out[f"{prefix}.e_proj{'.scale' if naming == 'original' else '.weight_scale_inv'}"] = (
            quantize_fp8_blocks(torch.randn(config["hidden_size"], config["hidden_size"]) * 0.05, ue8m0=ue8m0))
        out[f"{prefix}.norm.weight"] = torch.ones(config["hidden_size"])
    os.makedirs(path, exist_ok=True)
    _write_shards(path, out, num_shards)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tok.save_pretrained(path)
    return path


# --------------------------------------------------------------------------- HF fine-grained FP8

_DENSE_PROJ = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


def build_hf_fp8_checkpoint(
    path: str, arch: str = "qwen3", quantize_lm_head: bool = False, seed: int = 0, **overrides
) -> str:
    """A tiny dense-architecture checkpoint in HF's fine-grained FP8 format (as Qwen3-*-FP8):
    every attention / MLP projection FP8 e4m3 with a float32 `weight_scale_inv` per 128x128
    block, embedding / norms dense, lm_head dense unless `quantize_lm_head`."""
    with tempfile.TemporaryDirectory() as tmp:
        dense_dir = build_checkpoint(os.path.join(tmp, "dense"), arch, seed=seed, **overrides)
        tensors = {}
        for f in sorted(os.listdir(dense_dir)):
            if f.endswith(".safetensors"):
                tensors.update(load_file(os.path.join(dense_dir, f)))
        with open(os.path.join(dense_dir, "config.json")) as f:
            config = json.load(f)
        os.makedirs(path, exist_ok=True)
        for f in os.listdir(dense_dir):
            if not f.endswith(".safetensors") and f != "model.safetensors.index.json":
                shutil.copy(os.path.join(dense_dir, f), os.path.join(path, f))
    out = {}
    for name, t in tensors.items():
        if _DENSE_PROJ.search(name) or (quantize_lm_head and name == "lm_head.weight"):
            out[name], out[name[: -len(".weight")] + ".weight_scale_inv"] = quantize_fp8_blocks(t, ue8m0=False)
        else:
            out[name] = t
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": [128, 128]}
    if not quantize_lm_head:
        config["quantization_config"]["modules_to_not_convert"] = ["lm_head"]
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path

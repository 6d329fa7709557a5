"""DeepSeek-V4 building blocks against transformers' own modules, and checkpoint naming."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from hybridkv.engine.sampling_params import SamplingParams
from hybridkv.entrypoints import LLM
from hybridkv.model_executor.models.deepseek_v4.compressor import Compressor
from hybridkv.model_executor.models.deepseek_v4.config import V4Config
from hybridkv.model_executor.models.deepseek_v4.mhc import HyperConnection, HyperHead
from hybridkv.model_executor.models.deepseek_v4.moe import V4MoE
from hybridkv.model_executor.models.deepseek_v4.rope import InterleavedRope, inv_freq_from_params
from hybridkv.model_executor.models.deepseek_v4.weights import canonical_name
from tiny_deepseek_v4 import build_v4_checkpoint, randomize_, single_thread, v4_config

hf_v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")


@pytest.fixture(autouse=True)
def _one_thread():
    with single_thread():
        yield


def _hf_config(**kw):
    cfg = v4_config(320, **kw)
    cfg._attn_implementation = "eager"
    return cfg


def test_yarn_frequencies_match_transformers_for_the_flash_rope():
    """V4-Flash compress rope: θ=160000, YaRN factor 16 over 65536, β 32/1, rope dim 64."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    yarn = {"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}
    hf_cfg = v4_config(320, head_dim=512, partial_rotary_factor=0.125, rope_parameters=dict(yarn),
                       index_head_dim=128, max_position_embeddings=1 << 20)
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, None, layer_type="compress")
    assert factor == 1.0  # V4 never rescales cos/sin
    cfg = V4Config.from_hf(hf_cfg)
    assert cfg.rope_dim == 64
    got = inv_freq_from_params(cfg.compress_rope, cfg.rope_dim, 1 << 20)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    # Sliding layers keep the plain main rope.
    main = inv_freq_from_params(cfg.main_rope, cfg.rope_dim)
    torch.testing.assert_close(main, 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64)))


def test_interleaved_rope_matches_transformers_and_inverts():
    cfg = _hf_config()
    rotary = hf_v4.DeepseekV4RotaryEmbedding(cfg)
    pos = torch.tensor([0, 1, 7, 130, 999])
    x = torch.randn(5, 4, cfg.head_dim, generator=torch.Generator().manual_seed(0))
    cos, sin = rotary(x, position_ids=pos[None], layer_type="compress")
    want = hf_v4.apply_rotary_pos_emb(x.transpose(0, 1)[None], cos, sin)[0].transpose(0, 1)
    rope = InterleavedRope(rotary.compress_inv_freq)
    got = rope(x, pos)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(rope(got, pos, inverse=True), x, atol=1e-5, rtol=0)
    assert torch.equal(got[..., : cfg.head_dim - 8], x[..., : cfg.head_dim - 8])  # nope channels untouched


@pytest.mark.parametrize("kind", ["hca", "csa"])
def test_compressor_pooling_matches_transformers(kind):
    """Entries pooled from raw rows (as the paged state space stores them) equal HF's
    stateless full-sequence compressor, including CSA's overlapping windows."""
    cfg = _hf_config()
    torch.manual_seed(0)
    hf_mod = (hf_v4.DeepseekV4HCACompressor if kind == "hca" else hf_v4.DeepseekV4CSACompressor)(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in hf_mod.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (p.shape[-1] ** -0.5 if p.dim() == 2 else 0.5))
    m = cfg.compress_rates["heavily_compressed_attention" if kind == "hca" else "compressed_sparse_attention"]
    S, D = 5 * m + 3, cfg.head_dim
    x = torch.randn(1, S, cfg.hidden_size, generator=g)
    pos = torch.arange(S)[None]
    with torch.no_grad():
        want = hf_mod(x, torch.randn(1, S, cfg.q_lora_rank, generator=g), pos, None, 0)[0][0, 0]
        rope = InterleavedRope(hf_mod.rotary_emb.compress_inv_freq)
        ours = Compressor(cfg.hidden_size, D, m, kind == "csa", cfg.rms_norm_eps, rope)
        ours.wkv.weight.copy_(hf_mod.kv_proj.weight)
        ours.wgate.weight.copy_(hf_mod.gate_proj.weight)
        ours.ape.copy_(hf_mod.position_bias)
        ours.norm.weight.copy_(hf_mod.kv_norm.weight)
        kv, gate = ours.project(x[0])
        w = torch.arange(S // m)
        first = w * m - (m if kind == "csa" else 0)
        rows = first[:, None] + torch.arange(ours.rows_per_entry)[None]
        valid = rows >= 0
        got = ours.pool(kv[rows.clamp(min=0)], gate[rows.clamp(min=0)], valid, w * m, torch.float32)
    assert got.shape == want.shape == (S // m, D)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_hyper_connection_and_head_match_transformers():
    cfg = _hf_config()
    g = torch.Generator().manual_seed(2)
    hf_hc, hf_head = hf_v4.DeepseekV4HyperConnection(cfg), hf_v4.DeepseekV4HyperHead(cfg)
    ours = HyperConnection(cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
    head = HyperHead(cfg.hc_mult, cfg.hidden_size, cfg.hc_eps, cfg.rms_norm_eps)
    with torch.no_grad():
        for src, dst in ((hf_hc, ours), (hf_head, head)):
            for (n, p), (_, q) in zip(src.named_parameters(), dst.named_parameters()):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if n.endswith("scale") else 0.0))
                q.copy_(p)
    x = torch.randn(1, 6, cfg.hc_mult, cfg.hidden_size, generator=g)
    post, comb, collapsed = hf_hc(x)
    got_collapsed, got_post, got_comb = ours(x[0])
    torch.testing.assert_close(got_collapsed, collapsed[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(got_post, post[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(got_comb, comb[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(head(x[0]), hf_head(x)[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("layer", [0, 1])  # hash_moe, moe
def test_moe_matches_transformers(layer):
    cfg = _hf_config()
    model = hf_v4.DeepseekV4ForCausalLM(cfg).eval()
    randomize_(model, seed=3)
    hf_moe = model.model.layers[layer].mlp
    ours = V4MoE(V4Config.from_hf(cfg), layer)
    f = cfg.moe_intermediate_size
    with torch.no_grad():
        ours.gate.weight.copy_(hf_moe.gate.weight)
        if layer == 0:
            ours.gate.tid2eid.copy_(hf_moe.gate.tid2eid)
        else:
            ours.gate.bias.copy_(hf_moe.gate.e_score_correction_bias)
        for e, expert in enumerate(ours.experts):
            expert.w1.weight.copy_(hf_moe.experts.gate_up_proj[e, :f])
            expert.w3.weight.copy_(hf_moe.experts.gate_up_proj[e, f:])
            expert.w2.weight.copy_(hf_moe.experts.down_proj[e])
        ours.shared_experts.w1.weight.copy_(hf_moe.shared_experts.gate_proj.weight)
        ours.shared_experts.w3.weight.copy_(hf_moe.shared_experts.up_proj.weight)
        ours.shared_experts.w2.weight.copy_(hf_moe.shared_experts.down_proj.weight)
        g = torch.Generator().manual_seed(4)
        x = torch.randn(1, 9, cfg.hidden_size, generator=g) * 3  # large enough to hit the SwiGLU clamp
        ids = torch.randint(0, cfg.vocab_size, (1, 9), generator=g)
        torch.testing.assert_close(ours(x[0], ids[0]), hf_moe(x, input_ids=ids)[0], atol=1e-5, rtol=0)


def test_release_naming_loads_the_same_model(tmp_path):
    """The original release names (no "model." prefix, embed.weight, hc_head_fn, ...) load
    into the same model as save_pretrained's names; MTP tensors are skipped."""
    from safetensors.torch import load_file, save_file

    src = build_v4_checkpoint(str(tmp_path / "hf"))
    dst = tmp_path / "release"
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    release = {}
    for name, t in tensors.items():
        name = name.removeprefix("model.")
        name = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn",
                "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}.get(name, name)
        release[name] = t.to(torch.int32) if name.endswith("tid2eid") else t
    release["mtp.0.emb.weight"] = torch.zeros(2, 2)
    assert "embed.weight" in release and "layers.1.hc_attn_fn" in release
    save_file(release, str(dst / "model.safetensors"))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(3, 140))}
    outs = []
    for path in (src, str(dst)):
        llm = LLM(path, dtype="float32", max_model_len=256, max_num_seqs=2)
        llm.engine.runner.captured_logits = {}
        outs.append((llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids,
                     torch.cat(next(iter(llm.engine.runner.captured_logits.values())))))
    assert outs[0][0] == outs[1][0]
    assert torch.equal(outs[0][1], outs[1][1])


def test_fp8_block_scales_are_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="FP8 block scale"):
        canonical_name("layers.0.attn.wq_a.scale")
    assert canonical_name("layers.3.hc_ffn_scale") == "layers.3.hc_ffn.scale"
    assert canonical_name("model.hc_head.hc_scale") == "hc_head.hc_scale"
    assert canonical_name("mtp.0.norm.weight") is None


def test_legacy_config_fields_are_understood(tmp_path):
    """Older configs ship compress_ratios / num_hash_layers / qk_rope_head_dim instead."""
    path = build_v4_checkpoint(str(tmp_path / "ck"))
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    for k in ("layer_types", "mlp_layer_types", "compress_rates", "partial_rotary_factor", "rope_parameters"):
        raw.pop(k, None)
    raw.update(compress_ratios=[0, 4, 128, 4], num_hash_layers=1, qk_rope_head_dim=8)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    from hybridkv.model_executor.checkpoint import load_config

    cfg = V4Config.from_hf(load_config(path))
    assert cfg.layer_types == ("sliding_attention", "compressed_sparse_attention",
                               "heavily_compressed_attention", "compressed_sparse_attention")
    assert cfg.mlp_layer_types == ("hash_moe", "moe", "moe", "moe")
    assert (cfg.csa_ratio, cfg.hca_ratio, cfg.rope_dim) == (4, 128, 8)

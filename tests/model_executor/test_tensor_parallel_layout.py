"""The tensor-parallel shard layout (model_executor/parallel/layout.py) and the slice loader: which
heads, rows and columns each rank holds, and that a rank reads exactly those from the files."""
from __future__ import annotations

import re

import pytest
import torch
from safetensors import safe_open

from hybridkv.model_executor.checkpoint import iter_weights, load_config, weight_files
from hybridkv.model_executor.model_runner import model_skeleton
from hybridkv.model_executor.models.deepseek_v4.config import V4Config
from hybridkv.model_executor.models.deepseek_v4.sharding import V4Shard
from hybridkv.model_executor.parallel.block_slices import BlockGeometry
from hybridkv.model_executor.parallel.layout import HeadShard, Slice, VocabShard, split_evenly
from hybridkv.model_executor.parallel.shard_loader import iter_weight_shards
from hybridkv.model_executor.parallel.state import TensorParallel
from hybridkv.model_executor.quantization import BlockQuantizedTensor, attach_block_scales, quantization_config_of


@pytest.mark.parametrize("heads,kv,size,want", [
    (4, 4, 2, [HeadShard(2, 2, 0, 0), HeadShard(2, 2, 2, 2)]),  # GQA split
    (8, 2, 4, [HeadShard(2, 1, 2 * r, r // 2) for r in range(4)]),  # one KV head per two ranks
    (4, 1, 2, [HeadShard(2, 1, 0, 0), HeadShard(2, 1, 2, 0)]),  # one KV head, replicated
])
def test_head_shards_keep_each_query_head_with_its_kv_head(heads, kv, size, want):
    shards = [HeadShard.of(heads, kv, r, size) for r in range(size)]
    assert shards == want
    group = heads // kv  # query heads per KV head
    for s in shards:
        for q in range(s.q_start, s.q_start + s.num_heads):
            assert s.kv_start <= q // group < s.kv_start + s.num_kv_heads


@pytest.mark.parametrize("heads,kv,size,match", [
    (3, 3, 2, "3 attention heads"), (4, 3, 2, "3 key/value heads"), (8, 3, 4, "3 key/value heads"),
])
def test_heads_that_do_not_split_are_refused(heads, kv, size, match):
    with pytest.raises(ValueError, match=match):
        HeadShard.of(heads, kv, 0, size)


def test_vocab_shards_cover_the_vocabulary_once_padded_to_one_size():
    shards = [VocabShard.of(321, r, 2) for r in range(2)]
    assert shards == [VocabShard(0, 161, 161), VocabShard(161, 321, 161)]
    assert [VocabShard.of(5, r, 4) for r in range(4)][-1] == VocabShard(5, 5, 2)  # an empty tail rank
    with pytest.raises(ValueError, match="intermediate_size"):
        split_evenly(10, 0, 4, "intermediate_size")


def test_each_rank_reads_its_slices_and_together_they_rebuild_every_tensor(tiny_ckpt):
    path = tiny_ckpt("llama", num_key_value_heads=4, attention_bias=True)  # o_proj has a bias
    whole = {}
    for f in weight_files(path):
        with safe_open(f, "pt") as h:
            whole.update({n: h.get_tensor(n) for n in h.keys()})
    parts = []
    for rank in range(2):
        model = model_skeleton(path, "float32", 128, "cpu", parallel=TensorParallel(rank, 2)).model
        parts.append(dict(iter_weight_shards(path, model.shard().slice_of)))
    config = load_config(path)
    D = config.hidden_size // config.num_attention_heads
    for name, tensor in whole.items():
        a, b = parts[0][name], parts[1][name]
        if name.endswith("o_proj.bias"):  # added once, by rank 0
            assert torch.equal(a, tensor) and not b.any()
        elif any(k in name for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")):
            assert torch.equal(torch.cat([a, b]), tensor), name
        elif any(k in name for k in ("o_proj", "down_proj")):
            assert torch.equal(torch.cat([a, b], dim=1), tensor), name
        else:
            assert torch.equal(a, tensor) and torch.equal(b, tensor), name
    assert parts[0]["model.layers.0.self_attn.k_proj.weight"].shape[0] == 2 * D  # 2 of the 4 KV heads


def test_models_without_experts_refuse_expert_parallelism(tiny_ckpt):
    with pytest.raises(ValueError, match="LlamaForCausalLM has no routed experts"):
        model_skeleton(tiny_ckpt("llama"), "float32", 128, "cpu", parallel=TensorParallel(0, 2, expert_parallel=True))


# -- DeepSeek-V4 (models/deepseek_v4/sharding.py) ------------------------------------------------

def _whole(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in weight_files(path):
        with safe_open(f, "pt") as h:
            out.update({n: h.get_tensor(n) for n in h.keys()})
    return out


def _v4_shards(path: str, expert_parallel: bool = False) -> list[V4Shard]:
    config = load_config(path)
    return [V4Shard.of(V4Config.from_hf(config), TensorParallel(r, 2, expert_parallel), quantization_config_of(config))
            for r in range(2)]


def _rank_parts(path: str, shards: list[V4Shard]) -> list[dict[str, torch.Tensor]]:
    return [dict(iter_weight_shards(path, shard.slice_of)) for shard in shards]


_V4_ROWS = re.compile(r"attn\.(wq_b|wo_a)\.weight$|attn_sink$|(shared_experts|experts\.\d+)\.w[13]\.weight$"
                      r"|embed_tokens\.weight$|^head\.weight$")
_V4_COLS = re.compile(r"attn\.wo_b\.weight$|(shared_experts|experts\.\d+)\.w2\.weight$")


@pytest.fixture(scope="module")
def v4_path(tmp_path_factory) -> str:
    from tiny_deepseek_v4 import build_v4_checkpoint

    return build_v4_checkpoint(str(tmp_path_factory.mktemp("v4")))


def test_v4_ranks_split_query_heads_groups_and_experts_and_replicate_the_kv_path(v4_path):
    whole = _whole(v4_path)
    parts = _rank_parts(v4_path, _v4_shards(v4_path))
    for name, tensor in whole.items():
        a, b = parts[0][name], parts[1][name]
        if _V4_ROWS.search(name):
            assert a.shape[0] < tensor.shape[0] and torch.equal(torch.cat([a, b]), tensor), name
        elif _V4_COLS.search(name):
            assert torch.equal(torch.cat([a, b], dim=1), tensor), name
        else:  # wkv, wq_a, norms, compressors, the indexer (wq_b included), mHC, routers
            assert torch.equal(a, tensor) and torch.equal(b, tensor), name
    assert parts[1]["model.layers.1.attn.wq_b.weight"].shape == (2 * 32, 32)  # heads 2, 3 of head_dim 32
    assert parts[1]["model.layers.1.attn.wo_a.weight"].shape == (16, 64)  # group 1's o_lora_rank rows


def test_v4_expert_parallel_ranks_read_only_their_whole_experts(v4_path):
    whole = _whole(v4_path)
    parts = _rank_parts(v4_path, _v4_shards(v4_path, expert_parallel=True))
    for rank, part in enumerate(parts):
        experts = {int(m.group(1)) for n in part if (m := re.search(r"experts\.(\d+)\.", n))}
        assert experts == {2 * rank, 2 * rank + 1}  # the others are never read
        for name, t in part.items():
            if re.search(r"\.experts\.\d+\.", name):
                assert torch.equal(t, whole[name]), name
    shared = "model.layers.0.ffn.shared_experts.w1.weight"
    assert torch.equal(torch.cat([parts[0][shared], parts[1][shared]]), whole[shared])  # the shared expert stays split
    assert _v4_shards(v4_path, expert_parallel=True)[1].local_name("layers.3.ffn.experts.3.w2.weight") == \
        "layers.3.ffn.experts.1.w2.weight"


@pytest.mark.parametrize("expert_dtype", ["fp4", "fp8"])
def test_v4_quantized_slices_cut_codes_and_scales_together(tmp_path, expert_dtype):
    """Each rank's paired (codes, scale) slices dequantize to the slices of the dequantized weight:
    wq_b on whole 128-row blocks, wo_a / wo_b / the experts within one block or 32-wide groups."""
    from tiny_quantized import build_release_v4_checkpoint

    path = build_release_v4_checkpoint(str(tmp_path / "v4"), expert_dtype, head_dim=64, qk_rope_head_dim=16)
    quantization = quantization_config_of(load_config(path))
    whole = {n: t.dequantize() if isinstance(t, BlockQuantizedTensor) else t
             for n, t in attach_block_scales(iter_weights(path), quantization)}
    parts = [{n: t.dequantize() if isinstance(t, BlockQuantizedTensor) else t
              for n, t in attach_block_scales(part.items(), quantization)}
             for part in _rank_parts(path, _v4_shards(path))]
    checked = 0
    for name, tensor in whole.items():
        if name.startswith("mtp."):
            assert name not in parts[0] and name not in parts[1]  # never read
            continue
        a, b = parts[0][name], parts[1][name]
        if _V4_ROWS.search(name.replace("embed.weight", "embed_tokens.weight")):
            full = torch.cat([a, b])[: tensor.shape[0]]  # the head's padding cut
            assert torch.equal(full, tensor.to(full.dtype)), name
            checked += 1
        elif _V4_COLS.search(name):
            assert torch.equal(torch.cat([a, b], dim=1), tensor), name
            checked += 1
        else:
            assert torch.equal(a, tensor) and torch.equal(b, tensor), name
    assert checked > 40


def test_v4_a_split_across_quantization_blocks_names_the_tensor_and_the_alignment(tmp_path):
    from tiny_quantized import build_release_v4_checkpoint

    path = build_release_v4_checkpoint(str(tmp_path / "v4"))  # 4 heads of 48: rank 1 starts at row 96
    config = load_config(path)
    with pytest.raises(ValueError, match=r"'layers\.0\.attn\.wq_b\.weight' \(rows \[96, 192\)\) is not aligned to its "
                                         r"FP8 quantization blocks of 128x128.*multiple of 128"):
        V4Shard.check_every_rank(V4Config.from_hf(config), TensorParallel(0, 2), quantization_config_of(config))
    geometry = BlockGeometry((1, 32), packed=2, kind="MXFP4")
    with pytest.raises(ValueError, match=r"'x' \(columns \[16, 48\)\) is not aligned .* MXFP4 .*multiple of 32"):
        geometry.codes_slice("x", Slice(1, 16, 48))
    assert geometry.codes_slice("x", Slice(1, 32, 64)) == Slice(1, 16, 32)  # two codes a byte
    assert geometry.scale_slice("x", Slice(1, 32, 64)) == Slice(1, 1, 2)


@pytest.mark.parametrize("overrides,size,expert_parallel,match", [
    (dict(num_attention_heads=6, o_groups=3), 2, False, r"num_attention_heads \(6\) and o_groups \(3\)"),
    (dict(o_groups=1), 2, False, r"o_groups \(1\)"),
    (dict(n_routed_experts=5), 2, True, r"enable_expert_parallel: .* n_routed_experts \(5\)"),
    (dict(moe_intermediate_size=31), 2, False, r"moe_intermediate_size \(31\)"),
])
def test_v4_sizes_that_do_not_split_are_refused_naming_the_constraint(overrides, size, expert_parallel, match):
    from tiny_deepseek_v4 import v4_config

    cfg = V4Config.from_hf(v4_config(320, **overrides))
    with pytest.raises(ValueError, match=match):
        V4Shard.of(cfg, TensorParallel(0, size, expert_parallel))

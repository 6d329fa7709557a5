"""The tensor-parallel shard layout (model_executor/parallel/layout.py) and the slice loader: which
heads, rows and columns each rank holds, and that a rank reads exactly those from the files."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from hybridkv.model_executor.checkpoint import load_config, weight_files
from hybridkv.model_executor.model_runner import model_skeleton
from hybridkv.model_executor.parallel.layout import HeadShard, VocabShard, split_evenly
from hybridkv.model_executor.parallel.shard_loader import iter_weight_shards
from hybridkv.model_executor.parallel.state import TensorParallel


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


def test_models_without_a_sharded_form_are_refused(tmp_path):
    from tiny_deepseek_v4 import build_v4_checkpoint

    path = build_v4_checkpoint(str(tmp_path / "v4"))
    with pytest.raises(ValueError, match="DeepseekV4ForCausalLM is not supported yet with tensor_parallel_size > 1"):
        model_skeleton(path, "float32", 128, "cpu", parallel=TensorParallel(0, 2))

"""DeepSeek-V4 with tensor_parallel_size=2 on the CPU (gloo): the same greedy tokens and prompt
logprobs as one process, with the routed experts split on their intermediate size or held whole
per rank (enable_expert_parallel), across prefix hits, chunked prefill and preemption, and on
block-quantized (FP8 / MXFP4) release-format checkpoints; settings that cannot shard are refused
before any worker starts."""
from __future__ import annotations

import pytest

from hybridkv.entrypoints import LLM
from tiny_deepseek_v4 import build_v4_checkpoint
from tiny_quantized import build_release_v4_checkpoint
from tp_helpers import (  # noqa: F401 - shut_down: a fixture
    assert_logprobs_close, kv_bytes, no_workers_left, prompts_with_prefix, run_passes, shut_down,
)

# Pages of 16 tokens (the tiny model's ratios are 4 and 16), 16-token chunks, and a budget that
# leaves the growing spaces (c4, c128, indexer) 5 pages once the windowed ones have theirs, so
# prompts are chunked, decodes preempt each other and the second pass hits the first one's
# prefix pages.
COMMON = dict(dtype="float32", max_model_len=80, block_size=16, max_num_batched_tokens=16, max_num_seqs=4)
PAGES = 4.75
# The release format's compress ratios are 4 and 128: 128-token pages, prompts sharing 130 tokens.
# head_dim 64: each rank's query heads are 128 wq_b rows, whole 128x128 FP8 blocks.
QUANTIZED = dict(head_dim=64, qk_rope_head_dim=16)
QUANTIZED_COMMON = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def v4(tmp_path_factory) -> str:
    return build_v4_checkpoint(str(tmp_path_factory.mktemp("v4")))


@pytest.fixture(scope="module")
def v4_one_process(v4) -> tuple[list[dict], dict]:
    """The prompts and tensor_parallel_size=1's results (shared by both layouts' tests)."""
    one = LLM(v4, kv_cache_memory_bytes=kv_bytes(v4, 1, PAGES), **COMMON)
    prompts = prompts_with_prefix(one.engine.runner.config.vocab_size, 8)
    return prompts, run_passes(one, prompts)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["experts-split", "expert-parallel"])
def test_two_ranks_match_one_process(v4, v4_one_process, shut_down, expert_parallel):
    prompts, want = v4_one_process
    two = LLM(v4, kv_cache_memory_bytes=kv_bytes(v4, 2, PAGES), tensor_parallel_size=2,
              enable_expert_parallel=expert_parallel, **COMMON)
    shut_down(two)
    experts = [len(layer.ffn.experts) for layer in two.engine.runner.driver.model.layers]
    assert experts == [2 if expert_parallel else 4] * 4  # rank 0 holds experts 0, 1 under EP
    got = run_passes(two, prompts)
    two.shutdown()
    assert [p.exitcode for p in two.engine.runner.workers.processes] == [0], "a worker did not stop cleanly"
    assert got["pages"] == want["pages"]  # the block spaces are replicated: one rank's are the whole model's
    assert want["preemptions"] > 0 and want["cached"] > 0, "the setting should preempt and hit the prefix cache"
    assert got["tokens"] == want["tokens"]
    assert (got["preemptions"], got["cached"]) == (want["preemptions"], want["cached"])
    assert_logprobs_close(got["prompt_logprobs"], want["prompt_logprobs"])


@pytest.fixture(scope="module")
def release_v4(tmp_path_factory):
    built: dict[str, str] = {}

    def get(expert_dtype: str) -> str:
        if expert_dtype not in built:
            built[expert_dtype] = build_release_v4_checkpoint(
                str(tmp_path_factory.mktemp(f"v4_{expert_dtype}")), expert_dtype, **QUANTIZED)
        return built[expert_dtype]

    return get


@pytest.mark.parametrize("expert_dtype,expert_parallel", [("fp4", False), ("fp4", True), ("fp8", False)],
                         ids=["mxfp4-experts-split", "mxfp4-expert-parallel", "fp8-experts-split"])
def test_quantized_checkpoint_two_ranks_match_one_process(release_v4, shut_down, expert_dtype, expert_parallel):
    path = release_v4(expert_dtype)
    one = LLM(path, **QUANTIZED_COMMON)
    prompts = prompts_with_prefix(one.engine.runner.config.vocab_size, 3, shared=130)
    want = run_passes(one, prompts)
    two = LLM(path, tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **QUANTIZED_COMMON)
    shut_down(two)
    got = run_passes(two, prompts)
    assert want["cached"] > 0
    assert got["tokens"] == want["tokens"] and got["cached"] == want["cached"]
    assert_logprobs_close(got["prompt_logprobs"], want["prompt_logprobs"])


def test_a_split_across_quantization_blocks_is_refused_before_any_worker_starts(tmp_path):
    # The release shapes: 4 heads of 48 -> rank 1 would hold wq_b rows [96, 192), across an FP8 block.
    path = build_release_v4_checkpoint(str(tmp_path / "v4"))
    with pytest.raises(ValueError, match=r"'layers\.0\.attn\.wq_b\.weight' \(rows \[96, 192\)\) is not aligned .* "
                                         r"multiple of 128"):
        LLM(path, dtype="float32", tensor_parallel_size=2)
    assert no_workers_left()


def test_expert_parallel_is_refused_without_ranks_or_experts(v4, tiny_ckpt):
    with pytest.raises(ValueError, match="enable_expert_parallel .* needs tensor_parallel_size > 1"):
        LLM(v4, dtype="float32", enable_expert_parallel=True)
    with pytest.raises(ValueError, match="LlamaForCausalLM has no routed experts"):
        LLM(tiny_ckpt("llama", num_key_value_heads=4), dtype="float32", tensor_parallel_size=2,
            enable_expert_parallel=True)
    assert no_workers_left()


def test_heads_or_groups_that_do_not_split_are_refused(tmp_path):
    path = build_v4_checkpoint(str(tmp_path / "v4"), o_groups=1)
    with pytest.raises(ValueError, match=r"must divide DeepSeek-V4's num_attention_heads \(4\) and o_groups \(1\)"):
        LLM(path, dtype="float32", tensor_parallel_size=2)
    assert no_workers_left()

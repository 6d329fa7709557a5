"""The host tier (HiCache L2) under tensor_parallel_size=2 (CPU, gloo): every rank runs the
driver's one plan's tier copies on its own KV shard and host buffers.

Invariants checked:
- a prefix loaded back from the host at every page boundary (every device page evicted first)
  gives the no-cache run's greedy tokens and logprobs, with two ranks as with one;
- swap preemption under a tiny device budget gives the unconstrained single-process outputs,
  each resume loading its pages back from every rank's host buffers, nothing recomputed;
- the storage tier (file backend) stores one value per page holding every rank's shard: a
  second two-rank engine on the same store serves the prefix from storage with the no-cache
  run's outputs, while a single-process engine on that store gets no hit (the group's size is
  part of the KV fingerprint);
- no worker process outlives its engine.
"""
from __future__ import annotations

import multiprocessing

import pytest
import torch
import torch.distributed as dist

from host_tier_helpers import assert_host_hit_at_every_boundary
from hybridkv.entrypoints import LLM, SamplingParams
from prefix_hit_helpers import LOGPROB_ATOL, run_one, sampled_logprobs


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@pytest.fixture
def engines():
    """LLMs registered here are shut down when the test ends; then no worker may be left."""
    llms: list[LLM] = []
    yield llms.append
    for llm in llms:
        llm.shutdown()
    assert not multiprocessing.active_children() and not dist.is_initialized(), "a worker process was left behind"


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_host_hit_at_every_boundary_with_two_ranks_equals_no_cache(tiny_ckpt, engines, policy):
    path = tiny_ckpt("llama", num_key_value_heads=4)
    ref = LLM(path, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    prompt = _prompt(70, ref.engine.runner.config.vocab_size, seed=11)
    want = run_one(ref, prompt, 12)
    llm = LLM(path, dtype="float32", max_model_len=256, enable_hierarchical_cache=True, hicache_write_policy=policy,
              tensor_parallel_size=2)
    engines(llm)
    assert assert_host_hit_at_every_boundary(llm, want, prompt, 12) == [16, 32, 48, 64]
    stats = llm.engine.kv.host_tier.stats
    assert sum(stats.loaded_pages.values()) > 0 and sum(stats.written_pages.values()) > 0
    assert llm.engine.tier_stats["load_back_bytes"] > 0


def test_swap_preemption_with_two_ranks_equals_unconstrained(tiny_ckpt, engines):
    path = tiny_ckpt("llama", num_key_value_heads=4)
    prompts = [{"prompt_token_ids": _prompt(100, 300, seed=20 + i)} for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    big = LLM(path, dtype="float32", max_model_len=256)
    want = [o.outputs[0].token_ids for o in big.generate(prompts, params, use_tqdm=False)]
    # Each rank holds half of the KV heads: a page of its shard is half the single-process page.
    page_bytes = big.engine.kv.specs["full"].bytes_per_page(16) // 2
    llm = LLM(path, dtype="float32", max_model_len=160, kv_cache_memory_bytes=16 * page_bytes,
              enable_hierarchical_cache=True, hicache_ratio=8.0, preemption_mode="swap", tensor_parallel_size=2)
    engines(llm)
    assert llm.engine.kv.spaces["full"].num_pages <= 17
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0, "the device budget should force preemptions"
    assert got == want, "swap preemption under tensor parallelism changed the outputs"
    assert sched.num_swap_ins > 0 and sched.num_resumed_host_tokens > 0
    assert sched.num_recomputed_after_preemption == 0
    assert all(s["pending_load_backs"] == 0 for s in llm.engine.runner.rank_states()), "a rank kept load-backs"


def _file_llm(path: str, store: str, tp: int) -> LLM:
    return LLM(path, dtype="float32", max_model_len=256, enable_hierarchical_cache=True,
               hicache_storage_backend="file", hicache_storage_dir=store,
               hicache_storage_prefetch_policy="wait_complete", tensor_parallel_size=tp)


def test_storage_hits_across_two_rank_engines_and_none_for_one_rank(tiny_ckpt, engines, tmp_path):
    path = tiny_ckpt("llama", num_key_value_heads=4)
    ref = LLM(path, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    prompt = _prompt(100, ref.engine.runner.config.vocab_size, seed=3)
    want = run_one(ref, prompt, 10)
    first = _file_llm(path, str(tmp_path), 2)
    engines(first)
    assert run_one(first, prompt, 10).outputs[0].token_ids == want.outputs[0].token_ids
    first.engine.storage.drain()
    assert first.engine.storage.stats.writes_queued > 0
    first.shutdown()

    second = _file_llm(path, str(tmp_path), 2)  # a new group: empty device and host on every rank
    engines(second)
    out = run_one(second, prompt, 10)
    assert out.metrics["prompt_tokens_from_storage"] == 96, out.metrics
    assert out.outputs[0].token_ids == want.outputs[0].token_ids, "a storage hit under tensor parallelism changed the tokens"
    torch.testing.assert_close(torch.tensor(sampled_logprobs(out)), torch.tensor(sampled_logprobs(want)),
                               atol=LOGPROB_ATOL, rtol=0)
    second.shutdown()

    single = _file_llm(path, str(tmp_path), 1)
    out = run_one(single, prompt, 2)
    assert out.num_cached_tokens == 0, "a single process read pages a two-rank group stored"
    assert single.engine.storage.stats.corrupt_values == 0, "keys should differ, not only headers"

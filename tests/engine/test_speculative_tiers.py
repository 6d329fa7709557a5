"""N-gram speculative decoding beside the KV tiers and tensor parallelism: the host tier (prefix
hits loaded back from host memory, swap preemption), the storage tier (a second engine on the same
directory) and two ranks give plain greedy decoding's tokens; only accepted tokens' pages are ever
written below the device, and every tier ends with nothing held. A rank killed during a verify step
fails generate cleanly, naming it."""
from __future__ import annotations

import pytest

from hybridkv.entrypoints import LLM, SamplingParams
from host_tier_helpers import evict_device
from speculative_helpers import assert_drafts_accepted_and_rejected, greedy_tokens
from tp_helpers import kv_bytes, shut_down  # noqa: F401 - shut_down: a fixture

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
KW = dict(dtype="float32", max_model_len=256, num_scheduler_steps=1)


def _prompts(vocab: int, n: int = 4) -> list[dict]:
    """Copy-friendly prompts (so drafts are proposed, accepted and rejected) sharing a 48-token
    prefix (so later passes hit the cache)."""
    import torch

    g = torch.Generator().manual_seed(11)
    shared = torch.randint(3, vocab, (48,), generator=g).tolist()
    pattern = torch.randint(3, vocab, (6,), generator=g).tolist()
    return [{"prompt_token_ids": shared + pattern * (2 + i) + torch.randint(3, vocab, (i + 1,), generator=g).tolist()}
            for i in range(n)]


def _tokens(llm: LLM, prompts: list[dict], max_tokens: int = 40) -> list[list[int]]:
    return greedy_tokens(llm, prompts, max_tokens)


def test_host_tier_hits_and_swap_preemption_keep_the_tokens(tiny_ckpt):
    """Pass 1 under a budget that preempts (swapping to the host), then every device page evicted
    to the host, pass 2 loads the prefixes back: the tokens of plain decoding both times."""
    path = tiny_ckpt("llama")
    kw = dict(KW, max_model_len=128)
    plain = LLM(path, block_size=4, **kw)
    prompts = _prompts(plain.engine.runner.config.vocab_size)
    want = _tokens(plain, prompts)
    budget = 40 * plain.engine.kv_cache_bytes["device"]["full"] // plain.engine.kv.spaces["full"].num_pages
    spec = LLM(path, block_size=4, kv_cache_memory_bytes=budget, enable_hierarchical_cache=True,
               preemption_mode="swap", speculative_config=SPEC, **kw)
    assert _tokens(spec, prompts) == want
    assert spec.engine.scheduler.num_preemptions > 0, "the budget should preempt"
    evict_device(spec)
    loaded = spec.engine.kv.host_tier.stats.loaded_pages["full"]
    assert _tokens(spec, prompts) == want
    assert spec.engine.kv.host_tier.stats.loaded_pages["full"] > loaded, "pass 2 should load prefixes from the host"
    assert_drafts_accepted_and_rejected(spec)


def test_storage_tier_pages_written_with_speculation_serve_a_second_engine(tiny_ckpt, tmp_path):
    """An engine with speculation writes its pages to a file store; a second engine (speculation
    off) on the same directory hits them and gives the same tokens as plain decoding."""
    path = tiny_ckpt("llama")
    plain = LLM(path, **KW)
    prompts = _prompts(plain.engine.runner.config.vocab_size)
    want = _tokens(plain, prompts)
    store = dict(enable_hierarchical_cache=True, hicache_storage_backend="file", hicache_storage_dir=str(tmp_path),
                 hicache_storage_prefetch_policy="wait_complete")
    first = LLM(path, speculative_config=SPEC, **store, **KW)
    assert _tokens(first, prompts) == want
    assert_drafts_accepted_and_rejected(first)
    first.engine.storage.drain()
    second = LLM(path, speculative_config=SPEC, **store, **KW)
    got = second.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert sum(o.metrics["prompt_tokens_from_storage"] for o in got) > 0, "the second engine should hit the store"
    second.engine.check_invariants()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_two_ranks_with_speculation_match_one_process_without(tiny_ckpt, shut_down, arch):
    """tensor_parallel_size=2 with speculation: every rank splits the verified rows alike and joins
    the same logits gathers; the tokens of one process decoding plainly, prefix hits included."""
    path = tiny_ckpt(arch, num_key_value_heads=4)
    common = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=24, num_scheduler_steps=1)
    one = LLM(path, kv_cache_memory_bytes=kv_bytes(path, 1, 40), **common)
    prompts = _prompts(one.engine.runner.config.vocab_size)
    want = [_tokens(one, prompts) for _ in range(2)]
    two = LLM(path, kv_cache_memory_bytes=kv_bytes(path, 2, 40), tensor_parallel_size=2, speculative_config=SPEC,
              **common)
    shut_down(two)
    got = [_tokens(two, prompts) for _ in range(2)]
    assert got == want
    assert_drafts_accepted_and_rejected(two)
    assert two.engine.kv.prefix_hits > 0


@pytest.mark.slow
def test_a_rank_killed_during_a_verify_step_fails_generate_naming_it(tiny_ckpt, shut_down):
    """A worker killed while the ranks run a verify step (a token and its drafts): generate raises
    naming the rank within the step timeout, no worker is left behind, and the engine stays failed."""
    import os
    import signal
    import time

    from tp_helpers import no_workers_left

    path = tiny_ckpt("llama", num_key_value_heads=4)
    llm = LLM(path, tensor_parallel_size=2, speculative_config=SPEC, **KW)
    shut_down(llm)
    runner = llm.engine.runner
    worker, execute, verify_steps = runner.workers.processes[0], runner.execute, []

    def execute_then_kill(batch, plan):
        if batch.verify:
            verify_steps.append(1)
            if len(verify_steps) == 2:  # drafts verified once already; the second verify loses rank 1
                os.kill(worker.pid, signal.SIGKILL)
        return execute(batch, plan)

    runner.execute = execute_then_kill
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="worker rank 1 exited with code -9"):
        _tokens(llm, _prompts(300))
    assert len(verify_steps) == 2 and time.monotonic() - t0 < 30
    assert no_workers_left()
    with pytest.raises(RuntimeError, match="rank 1"):
        _tokens(llm, _prompts(300, 1))

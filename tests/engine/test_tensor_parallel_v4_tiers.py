"""DeepSeek-V4's tiers under tensor_parallel_size=2 (CPU, gloo): HiSparse keeps hot buffers and a
host mirror on every rank, the host tier holds every block space's pages on every rank, and the
outputs equal one process without them.

Invariants checked:
- HiSparse with two ranks (experts split or expert parallel) gives the greedy tokens and
  logprobs of one process without HiSparse, across a prefix hit and under preemption (the
  requests that left reach the workers' hot buffers: every rank's rows end free);
- a V4 prefix loaded back from the host tier at each page boundary (every device page evicted
  first) gives the no-cache run's outputs with two ranks;
- no worker process outlives its engine.
"""
from __future__ import annotations

import pytest

from hisparse_helpers import assert_same_outputs, generate_greedy, random_prompts
from host_tier_helpers import assert_host_hit_at_every_boundary
from hybridkv.entrypoints import LLM
from prefix_hit_helpers import run_one
from tiny_deepseek_v4 import build_v4_checkpoint, single_thread
from tp_helpers import shut_down  # noqa: F401 - a fixture

KW = dict(dtype="float32", block_size=32, max_model_len=384, max_num_seqs=4, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def v4(tmp_path_factory) -> str:
    with single_thread():
        return build_v4_checkpoint(str(tmp_path_factory.mktemp("v4tp_tiers")))


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["experts-split", "expert-parallel"])
def test_hisparse_with_two_ranks_equals_one_process_without_it(v4, shut_down, expert_parallel):
    base = random_prompts([300], seed=2)[0]
    prompts = [base, base + random_prompts([60], seed=3)[0], *random_prompts([280, 260], seed=4)]
    with single_thread():
        want = generate_greedy(LLM(v4, **KW), prompts[:1], 24) + generate_greedy(LLM(v4, **KW), prompts[1:], 24)
    # The device budget of test_hisparse's preemption case: about two sequences' whole-history pages.
    llm = LLM(v4, enable_hisparse=True, hisparse_config={"hot_buffer_size": 10}, kv_cache_memory_bytes=405_288,
              tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **KW)
    shut_down(llm)
    got = generate_greedy(llm, prompts[:1], 24) + generate_greedy(llm, prompts[1:], 24)
    assert got[1].num_cached_tokens >= 288, "the second prompt should hit the first one's pages"
    assert llm.engine.scheduler.num_preemptions > 0, "the budget forced no preemption"
    assert_same_outputs(got, want, "tokens differ from one process without the tier")
    assert llm.engine.hisparse_stats()
    idle = {"hot_buffer_rows": 0, "hot_buffer_requests_counted": 0, "pending_load_backs": 0}
    states = llm.engine.runner.rank_states()
    assert states[1] == idle, f"rank 1 holds hot-buffer rows or load-backs after every request left: {states}"
    assert states[0]["hot_buffer_rows"] == 0 and states[0]["pending_load_backs"] == 0


def test_host_tier_hit_at_every_boundary_with_two_ranks(v4, shut_down):
    kw = dict(dtype="float32", block_size=32, max_model_len=256, max_num_seqs=2)
    with single_thread():
        ref = LLM(v4, enable_prefix_caching=False, **kw)
        prompt = random_prompts([100], seed=5)[0]
        want = run_one(ref, prompt, 16)
    llm = LLM(v4, enable_hierarchical_cache=True, tensor_parallel_size=2, **kw)
    shut_down(llm)
    assert assert_host_hit_at_every_boundary(llm, want, prompt, 16) == [32, 64, 96]
    loaded = llm.engine.kv.host_tier.stats.loaded_pages
    assert all(loaded[s] > 0 for s in ("swa", "c4", "c128", "indexer", "state_c4")), loaded
    assert all(s["pending_load_backs"] == 0 for s in llm.engine.runner.rank_states())

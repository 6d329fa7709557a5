"""Cache-aware scheduling policies (engine/scheduling_policy.py): fcfs, lpm, dfs-weight, with
in-batch prefix grouping. Ordering is checked directly on SchedulingPolicy.order over a real
KVCacheManager; the end-to-end effect (one request computes a shared prefix, the others hit
it, outputs unchanged) through the LLM entry point on a tiny Llama."""
from __future__ import annotations

import pytest
import torch

from hybridkv.block_manager.kv_cache_manager import KVCacheManager
from hybridkv.block_manager.space_spec import SpaceSpec
from hybridkv.engine.request import Request, RequestStatus
from hybridkv.engine.sampling_params import SamplingParams
from hybridkv.engine.scheduling_policy import SchedulingPolicy
from hybridkv.entrypoints import LLM

P = 4


def _kv() -> KVCacheManager:
    return KVCacheManager([SpaceSpec("full", bytes_per_slot=8)], {"full": 64}, P, True)


def _cache(kv: KVCacheManager, tokens: list[int]) -> None:
    """Compute and publish tokens as a finished request would."""
    assert kv.allocate("seed", len(tokens))
    kv.cache_computed_pages("seed", tokens, len(tokens))
    kv.free("seed")


def _req(rid: str, tokens: list[int], status: RequestStatus = RequestStatus.WAITING) -> Request:
    r = Request(rid, list(tokens), SamplingParams(max_tokens=1), max_tokens=1)
    r.status = status
    return r


def _ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


# -- ordering ----------------------------------------------------------------------------------
def test_fcfs_keeps_arrival_order_and_never_defers():
    kv = _kv()
    shared = list(range(100, 140))
    reqs = [_req(f"r{i}", shared + [i]) for i in range(4)]
    order = SchedulingPolicy("fcfs").order(reqs, kv)
    assert _ids(order.requests) == ["r0", "r1", "r2", "r3"] and not order.deferred


def test_lpm_orders_longest_cached_prefix_first_ties_in_arrival_order():
    kv = _kv()
    _cache(kv, list(range(100, 124)))  # 6 pages cached
    reqs = [
        _req("none", list(range(500, 530))),
        _req("two_pages", list(range(100, 108)) + list(range(600, 620))),
        _req("five_pages", list(range(100, 120)) + [7, 7, 7, 7, 7]),
        _req("two_pages_b", list(range(100, 108)) + list(range(700, 720))),
    ]
    order = SchedulingPolicy("lpm").order(reqs, kv)
    assert _ids(order.requests) == ["five_pages", "two_pages", "two_pages_b", "none"]
    assert order.hits == {"none": 0, "two_pages": 8, "five_pages": 20, "two_pages_b": 8}
    kv.assert_idle()  # ordering matched without touching or locking anything


def test_dfs_weight_runs_requests_sharing_a_prefix_back_to_back():
    kv = _kv()
    a, b = list(range(100, 112)), list(range(200, 212))
    _cache(kv, a + [0] * P)
    _cache(kv, b + [0] * P)
    # Arrival interleaves the two prefixes; A's subtree is heavier (3 requests vs 2).
    reqs = [
        _req("b1", b + [1, 2, 3]),
        _req("a1", a + [1, 2, 3]),
        _req("b2", b + [4, 5, 6]),
        _req("a2", a + [4, 5, 6]),
        _req("a3", a + [7, 8, 9]),
    ]
    order = SchedulingPolicy("dfs-weight").order(reqs, kv)
    assert _ids(order.requests) == ["a1", "a2", "a3", "b1", "b2"]


def test_dfs_weight_visits_a_deeper_shared_node_before_its_siblings_requests():
    kv = _kv()
    root = list(range(100, 108))
    deep = root + list(range(300, 308))
    _cache(kv, deep + [0] * P)
    reqs = [
        _req("shallow", root + [9, 9, 9, 9, 9]),  # hit ends at the 2-page node
        _req("deep1", deep + [1]),  # hit ends at the 4-page node, below it
        _req("uncached", list(range(900, 910))),
        _req("deep2", deep + [2]),
    ]
    order = SchedulingPolicy("dfs-weight").order(reqs, kv)
    # Parent node's own requests first, then its (heavier) subtree; the uncached namespace-top
    # request carries weight 1 only with the whole tree, so it comes first as the top's own.
    assert _ids(order.requests) == ["uncached", "shallow", "deep1", "deep2"]


@pytest.mark.parametrize("name", ["lpm", "dfs-weight"])
def test_preempted_requests_go_first_whatever_their_hit(name):
    kv = _kv()
    _cache(kv, list(range(100, 124)))
    reqs = [
        _req("hit", list(range(100, 124)) + [1]),
        _req("resumed", list(range(800, 820)), RequestStatus.PREEMPTED),
        _req("hit2", list(range(100, 120)) + [2]),
    ]
    order = SchedulingPolicy(name).order(reqs, kv)
    assert order.requests[0].request_id == "resumed"
    assert set(_ids(order.requests)) == {"hit", "resumed", "hit2"}


@pytest.mark.parametrize("name", ["lpm", "dfs-weight"])
def test_in_batch_grouping_defers_all_but_one_of_a_shared_uncached_prefix(name):
    kv = _kv()
    shared = list(range(100, 140))  # 10 uncached pages >= group_min_tokens (32)
    reqs = [_req(f"r{i}", shared + [i, i, i]) for i in range(5)]
    reqs.append(_req("other", list(range(500, 540))))
    reqs.append(_req("short_share", list(range(100, 108)) + [1] * 20))  # shares only 8 tokens: not worth waiting
    order = SchedulingPolicy(name).order(reqs, kv)
    assert order.deferred == {"r1", "r2", "r3", "r4"}
    # Once the prefix is cached, nobody waits.
    _cache(kv, shared + [0])
    assert not SchedulingPolicy(name).order(reqs, kv).deferred


def test_cache_aware_ordering_scales_past_128_waiting_requests():
    """Invariant: a long queue stays cache-aware (no silent fcfs fallback), and each step runs at
    most max_matches_per_step prefix matches: every request is matched once, hits are reused."""
    kv = _kv()
    _cache(kv, list(range(100, 124)))
    reqs = [_req(f"none{i}", [500 + i] * 30) for i in range(300)]
    reqs.append(_req("hit", list(range(100, 124)) + [1]))
    policy = SchedulingPolicy("lpm", max_matches_per_step=64)
    calls = []
    real = kv.match_prefix
    kv.match_prefix = lambda *a, **k: calls.append(1) or real(*a, **k)
    orders = [policy.order(reqs, kv) for _ in range(6)]  # 301 requests need 5 steps of 64 matches
    assert len(calls) == 6 * 64, "each step runs exactly its match budget while requests are stale"
    assert _ids(orders[0].requests)[0] == "none0", "not matched yet: arrival order"
    assert _ids(orders[-1].requests)[0] == "hit", "once matched, the hit goes first (lpm) even with 301 waiting"
    calls.clear()
    policy.order(reqs[:10], kv)  # the queue shrank: cached hits of the rest are dropped, not re-matched
    assert len(calls) == 10 and len(policy._cache) == 10


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        SchedulingPolicy("lifo")


# -- end to end --------------------------------------------------------------------------------
def _count_computed_tokens(llm: LLM) -> list[int]:
    """Wrap the runner: per step, tokens actually computed (prefill chunks + decode tokens)."""
    runner = llm.engine.runner
    steps: list[int] = []
    original = runner.execute

    def execute(batch, plan):
        steps.append(sum(s.num_new_tokens for s in batch.sequences))
        return original(batch, plan)

    runner.execute = execute
    return steps


def _shared_prefix_prompts(vocab: int, n: int = 8, prefix_len: int = 64, suffix_len: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    prefix = torch.randint(3, vocab, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(3, vocab, (suffix_len,), generator=g).tolist() for _ in range(n)]


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int = 3):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("name", ["lpm", "dfs-weight"])
def test_shared_new_prefix_is_computed_once_and_outputs_equal_fcfs(tiny_ckpt, name):
    """8 waiting requests share a 4-page prefix nobody has computed: the cache-aware policy runs
    one first, the other 7 hit its 64 tokens; fcfs admits all 8 together and computes the prefix
    8 times. Greedy tokens and logprobs are the same."""
    path = tiny_ckpt("llama")
    fcfs = LLM(path, dtype="float32", max_model_len=128, scheduling_policy="fcfs")
    prompts = _shared_prefix_prompts(fcfs.engine.runner.config.vocab_size)
    fcfs_steps = _count_computed_tokens(fcfs)
    want = _generate(fcfs, prompts)
    aware = LLM(path, dtype="float32", max_model_len=128, scheduling_policy=name)
    aware_steps = _count_computed_tokens(aware)
    got = _generate(aware, prompts)

    assert [o.num_cached_tokens for o in want] == [0] * 8
    assert sorted(o.num_cached_tokens for o in got) == [0] + [64] * 7
    assert all(o.metrics["cached_tokens_per_space"] == {"full": 64} for o in got if o.num_cached_tokens)
    decode = 8 * 2  # max_tokens=3: the first token comes from the prefill step
    assert sum(fcfs_steps) == 8 * 69 + decode
    assert sum(aware_steps) == 69 + 7 * 5 + decode
    assert aware.engine.kv.prefix_hits == 7 * 64
    for w, o in zip(want, got):
        assert o.outputs[0].token_ids == w.outputs[0].token_ids
        assert [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] == pytest.approx(
            [lp[t].logprob for t, lp in zip(w.outputs[0].token_ids, w.outputs[0].logprobs)], abs=1e-4
        )


def test_greedy_outputs_identical_across_policies_with_caching(tiny_ckpt):
    """A mix of shared prefixes (cached from an earlier batch and new ones), unrelated prompts and a
    request preempted by a tight KV budget: each policy admits in its own order, the tokens agree."""
    path = tiny_ckpt("llama")
    g = torch.Generator().manual_seed(12)
    vocab = 200
    sys_a = torch.randint(3, vocab, (40,), generator=g).tolist()
    sys_b = torch.randint(3, vocab, (36,), generator=g).tolist()
    warm = [sys_a + [5, 6, 7]]
    batch = []
    for i in range(9):
        base = (sys_a, sys_b, [])[i % 3]
        batch.append(base + torch.randint(3, vocab, (4 + 3 * i,), generator=g).tolist())
    results = {}
    for name in ("fcfs", "lpm", "dfs-weight"):
        # max_num_seqs 3 keeps requests waiting so the policies really choose between them; 9
        # pages of 16 tokens (tiny Llama: 8 KiB a page) cannot hold 3 of the longer requests.
        llm = LLM(path, dtype="float32", max_model_len=128, max_num_seqs=3, scheduling_policy=name,
                  kv_cache_memory_bytes=9 * 8192)
        assert llm.engine.kv.spaces["full"].num_pages == 9
        _generate(llm, warm, 2)
        outs = _generate(llm, batch, 16)  # long enough decodes that running requests outgrow the pool
        results[name] = [o.outputs[0].token_ids for o in outs]
        assert llm.engine.scheduler.num_preemptions > 0, name
        if name != "fcfs":
            assert sum(o.num_cached_tokens for o in outs) > 0
    assert results["lpm"] == results["fcfs"]
    assert results["dfs-weight"] == results["fcfs"]


def test_priority_eviction_keeps_the_high_priority_prefix_through_the_engine(tiny_ckpt):
    """eviction_policy="priority": under eviction pressure the cached prefix of a high-priority
    request survives while the low-priority one is evicted (priority flows request -> index)."""
    path = tiny_ckpt("llama")
    page_bytes = 2 * 2 * 2 * 16 * 4 * 16
    llm = LLM(path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=10 * page_bytes,
              eviction_policy="priority")
    greedy = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    keep = {"prompt_token_ids": [5] * 48 + [6]}
    drop = {"prompt_token_ids": [7] * 48 + [8]}
    # keep arrives first (LRU would evict it first); its priority must protect it instead.
    llm.generate([keep, drop], greedy, use_tqdm=False, priority=[10, 0])
    filler = {"prompt_token_ids": [9] * 64 + [1]}  # needs 5 pages: forces evicting 3 cached pages
    llm.generate(filler, greedy, use_tqdm=False)
    assert llm.generate(keep, greedy, use_tqdm=False)[0].num_cached_tokens == 48
    assert llm.generate(drop, greedy, use_tqdm=False)[0].num_cached_tokens < 48

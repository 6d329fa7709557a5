"""HiCache part 1, end to end: a host tier (L2) under every block space.

Invariants checked:
- a prefix served from the host tier (every device copy evicted first, windowed pages too)
  gives the no-cache run's greedy tokens and logprobs, at every page boundary, on Llama,
  Gemma-3 and both V4 test configs, for each write policy and both host layouts;
- the per-request cache report says how many prompt tokens came from device, host, or were
  computed, and the host tokens are exactly the boundary's;
- swap preemption under a tiny device budget gives the unconstrained run's outputs, and the
  resumed requests recompute no whole page the host still held;
- a device page queued for the host and handed out again in the same scheduling pass (a
  decode's new page is the one an eviction just freed) is copied before the forward writes it;
- a decode aborted while some of its pages still wait for batched publication publishes them
  at retire, and they reach the host (write-through at the abort, write-back on eviction);
- every test ends with all device pages free or cached, no lock, no copy left unexecuted, and
  the host pools' ledgers equal to the index's host shadows (conftest's idle check).
"""
from __future__ import annotations

import pytest
import torch

from hybridkv.entrypoints import LLM, SamplingParams
from host_tier_helpers import assert_host_hit_at_every_boundary, evict_device
from prefix_hit_helpers import LOGPROB_ATOL, run_one, sampled_logprobs
from tiny_deepseek_v4 import build_v4_checkpoint, single_thread

POLICIES = ["write_through", "write_through_selective", "write_back"]


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize("policy", POLICIES)
def test_llama_host_hit_at_every_boundary_equals_no_cache(tiny_ckpt, policy):
    path = tiny_ckpt("llama")
    ref = LLM(path, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    prompt = _prompt(70, ref.engine.runner.config.vocab_size, seed=11)
    want = run_one(ref, prompt, 12)
    llm = LLM(path, dtype="float32", max_model_len=256, enable_hierarchical_cache=True, hicache_write_policy=policy)
    seed_runs = 3 if policy == "write_through_selective" else 1
    assert assert_host_hit_at_every_boundary(llm, want, prompt, 12, seed_runs) == list(range(16, 70, 16))
    stats = llm.engine.kv.host_tier.stats
    assert sum(stats.loaded_pages.values()) > 0 and sum(stats.written_pages.values()) > 0
    assert llm.engine.tier_stats["load_back_bytes"] > 0


def test_layer_first_layout_equals_no_cache(tiny_ckpt):
    path = tiny_ckpt("llama")
    ref = LLM(path, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    prompt = _prompt(40, ref.engine.runner.config.vocab_size, seed=12)
    want = run_one(ref, prompt, 8)
    llm = LLM(path, dtype="float32", max_model_len=256, enable_hierarchical_cache=True,
              hicache_mem_layout="layer_first")
    assert assert_host_hit_at_every_boundary(llm, want, prompt, 8) == [16, 32]


@pytest.mark.parametrize("policy", POLICIES)
def test_gemma3_host_hit_with_swa_only_on_the_host(tiny_ckpt, policy):
    """Gemma-3 (full + SWA): the SWA window of every boundary exists only on the host; the hit
    loads it back, bit-exact, no window replay."""
    path = tiny_ckpt("gemma3_text")
    ref = LLM(path, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    prompt = _prompt(90, ref.engine.runner.config.vocab_size, seed=7)
    want = run_one(ref, prompt, 12)
    llm = LLM(path, dtype="float32", max_model_len=256, enable_hierarchical_cache=True, hicache_write_policy=policy)
    assert set(llm.engine.kv.index.windows) == {"swa"}
    seed_runs = 3 if policy == "write_through_selective" else 1
    assert assert_host_hit_at_every_boundary(llm, want, prompt, 12, seed_runs) == list(range(16, 90, 16))
    assert llm.engine.kv.host_tier.stats.loaded_pages["swa"] > 0


V4_CONFIGS = {
    "w16_p32": (dict(), 32, 100),
    "w40_p32": (dict(sliding_window=40, index_topk=5), 32, 110),
}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", list(V4_CONFIGS))
def test_v4_host_hit_at_every_boundary_equals_no_cache(tmp_path_factory, name, policy):
    """DeepSeek-V4: the spaces a hit reads (swa, c4, c128, indexer, state_c4) come back from the
    host; the SWA window and the CSA compression state are offloaded too, so the hit is exact.
    HCA's state is not read at a page boundary (the page size is a multiple of the HCA ratio, so
    every page end closes an HCA block: its aligned window holds no earlier row), so none loads."""
    overrides, P, n = V4_CONFIGS[name]
    with single_thread():
        path = build_v4_checkpoint(str(tmp_path_factory.mktemp(f"v4hc_{name}")), **overrides)
        kw = dict(dtype="float32", block_size=P, max_model_len=256, max_num_seqs=2)
        ref = LLM(path, enable_prefix_caching=False, **kw)
        prompt = _prompt(n, ref.engine.runner.config.vocab_size, seed=5)
        want = run_one(ref, prompt, 16)
        llm = LLM(path, enable_hierarchical_cache=True, hicache_write_policy=policy, **kw)
        seed_runs = 3 if policy == "write_through_selective" else 1
        assert assert_host_hit_at_every_boundary(llm, want, prompt, 16, seed_runs) == list(range(P, n, P))
        loaded = llm.engine.kv.host_tier.stats.loaded_pages
        assert all(loaded[s] > 0 for s in ("swa", "c4", "c128", "indexer", "state_c4")), loaded
        assert loaded["state_c128"] == 0, loaded


def test_v4_multi_turn_with_early_swa_pages_only_on_the_host(tmp_path_factory):
    """A V4 conversation whose device SWA pool holds one window: the SWA (and compress-state)
    pages of earlier turns leave the device and live only on the host; every turn's output
    equals the no-cache run, and later turns load their history back from the host."""
    with single_thread():
        path = build_v4_checkpoint(str(tmp_path_factory.mktemp("v4hc_mt")))
        kw = dict(dtype="float32", block_size=32, max_model_len=1024, max_num_seqs=1, max_num_batched_tokens=64)
        ref = LLM(path, enable_prefix_caching=False, **kw)
        vocab = ref.engine.runner.config.vocab_size
        llm = LLM(path, enable_hierarchical_cache=True, hicache_ratio=4.0, **kw)
        assert llm.engine.kv.spaces["swa"].num_pages <= 5
        history = _prompt(200, vocab, seed=40)
        from_host = []
        for t in range(5):
            prompt = history + _prompt(30, vocab, seed=41 + t)
            out, want = run_one(llm, prompt, 8), run_one(ref, prompt, 8)
            assert out.outputs[0].token_ids == want.outputs[0].token_ids, f"turn {t}: tokens differ"
            torch.testing.assert_close(torch.tensor(sampled_logprobs(out)), torch.tensor(sampled_logprobs(want)),
                                       atol=LOGPROB_ATOL, rtol=0)
            from_host.append(out.metrics["prompt_tokens_from_host"])
            history = prompt + out.outputs[0].token_ids
            index = llm.engine.kv.index
            if t == 2:
                only_host = sum(1 for nd in index.nodes() if nd.shadows["swa"] is None and nd.host["swa"] is not None)
                assert only_host > 0, "early turns' SWA pages should live only on the host"
                evict_device(llm)  # the next turn's whole history, window included, comes from the host
        assert from_host[3] > 0 and llm.engine.kv.host_tier.stats.loaded_pages["swa"] > 0, from_host


def test_load_back_threshold_recomputes_short_host_hits(tiny_ckpt):
    """A host hit shorter than load_back_threshold is not loaded: the prompt is recomputed
    (output unchanged); a longer one is loaded."""
    path = tiny_ckpt("llama")
    ref = LLM(path, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    prompt = _prompt(70, ref.engine.runner.config.vocab_size, seed=13)
    want = run_one(ref, prompt, 6)
    llm = LLM(path, dtype="float32", max_model_len=256, enable_hierarchical_cache=True, load_back_threshold=40)
    for b, loaded in ((32, False), (48, True)):
        llm.engine.reset_prefix_cache()
        run_one(llm, prompt[:b] + [3], 1)
        evict_device(llm)
        out = run_one(llm, prompt, 6)
        assert out.metrics["prompt_tokens_from_host"] == (b if loaded else 0), (b, out.metrics)
        assert out.outputs[0].token_ids == want.outputs[0].token_ids


def test_swap_preemption_equals_unconstrained_and_recomputes_nothing_the_host_held(tiny_ckpt):
    """Eight 100-token prompts decoding 30 tokens each in a device pool that holds about two of
    them: requests are preempted and swapped out; outputs equal the unconstrained run, and each
    resume loads its whole pages back instead of recomputing them."""
    path = tiny_ckpt("llama")
    vocab = 300
    prompts = [_prompt(100, vocab, seed=20 + i) for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    big = LLM(path, dtype="float32", max_model_len=256)
    want = [o.outputs[0].token_ids for o in big.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    page_bytes = big.engine.kv.specs["full"].bytes_per_page(16)
    llm = LLM(path, dtype="float32", max_model_len=160, kv_cache_memory_bytes=16 * page_bytes,
              enable_hierarchical_cache=True, hicache_ratio=8.0, preemption_mode="swap")
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0, "the device budget should force preemptions"
    assert got == want, "swap preemption changed the outputs"
    assert llm.engine.kv.num_swap_outs == sched.num_preemptions
    assert sched.num_swap_ins > 0 and sched.num_resumed_host_tokens > 0
    assert sched.num_recomputed_after_preemption == 0, (
        "a resume recomputed tokens the host still held (whole pages or the partial last page)")


def test_abort_of_a_swapped_out_request_frees_its_host_pages(tiny_ckpt):
    """A request preempted with swap (its pages and partial last page on the host) is aborted
    while it waits: its held host pages go back, the others finish with unchanged outputs."""
    path = tiny_ckpt("llama")
    prompts = [_prompt(100, 300, seed=60 + i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    big = LLM(path, dtype="float32", max_model_len=256)
    want = {f"q{i}": o.outputs[0].token_ids for i, o in enumerate(
        big.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))}
    page_bytes = big.engine.kv.specs["full"].bytes_per_page(16)
    llm = LLM(path, dtype="float32", max_model_len=160, kv_cache_memory_bytes=16 * page_bytes,
              enable_hierarchical_cache=True, hicache_ratio=8.0, preemption_mode="swap")
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"q{i}", {"prompt_token_ids": p}, params)
    got, aborted = {}, None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                got[o.request_id] = o.outputs[0].token_ids
        if aborted is None and eng.kv._swapped:
            internal = next(iter(eng.kv._swapped))
            aborted = eng._request_to_group[internal].request_id
            held = sum(len(t.host_pages) for t in eng.kv._swapped.values())
            used = sum(p.num_used for p in eng.kv.host_tier.pools.values())
            eng.abort_request(aborted)
            assert internal not in eng.kv._swapped
            assert sum(p.num_used for p in eng.kv.host_tier.pools.values()) < used or held == 0
            eng.kv.check_invariants()
    assert aborted is not None, "no request was swapped out"
    assert got == {k: v for k, v in want.items() if k != aborted}


def test_swapped_out_request_whose_host_copy_was_evicted_resumes_by_recompute(tiny_ckpt):
    """The host tier is too small to keep what was swapped out: the resume recomputes the lost
    pages, and the outputs are still those of the unconstrained run."""
    path = tiny_ckpt("llama")
    prompts = [_prompt(100, 300, seed=30 + i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    big = LLM(path, dtype="float32", max_model_len=256)
    want = [o.outputs[0].token_ids for o in big.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    page_bytes = big.engine.kv.specs["full"].bytes_per_page(16)
    llm = LLM(path, dtype="float32", max_model_len=160, kv_cache_memory_bytes=16 * page_bytes,
              enable_hierarchical_cache=True, hicache_size=4 * page_bytes, preemption_mode="swap")
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == want
    assert llm.engine.scheduler.num_recomputed_after_preemption > 0, "a 4-page host tier cannot keep them all"


def test_abort_after_a_load_back_was_decided_leaves_nothing(tiny_ckpt):
    """A request admitted with a host hit is aborted before its step ran: the copy still runs
    (its pages stay cached, valid), nothing is locked or pending, and the next request that
    hits the same prefix gets the right output."""
    path = tiny_ckpt("llama")
    ref = LLM(path, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    prompt = _prompt(60, ref.engine.runner.config.vocab_size, seed=14)
    want = run_one(ref, prompt, 6)
    llm = LLM(path, dtype="float32", max_model_len=256, enable_hierarchical_cache=True)
    run_one(llm, prompt[:49], 1)
    evict_device(llm)
    eng = llm.engine
    eng.add_request("victim", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=4))
    sched = eng.scheduler.schedule()  # admits it: the load-back is decided, not yet executed
    assert sched.scheduled and eng.kv.host_tier.transfers.to_device, "the hit should need a load-back"
    eng.abort_request("victim")
    assert eng.kv.host_tier.transfers.empty, "the abort left copies unexecuted"
    eng.kv.assert_idle()
    out = run_one(llm, prompt, 6)
    assert out.num_cached_tokens == 48 and out.outputs[0].token_ids == want.outputs[0].token_ids


def test_host_pool_full_during_write_through_keeps_serving(tiny_ckpt):
    """A host tier of 3 pages under write_through: writes that find no room are counted and
    skipped, host eviction keeps the ledgers exact, and outputs equal the no-cache run."""
    path = tiny_ckpt("llama")
    ref = LLM(path, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    vocab = ref.engine.runner.config.vocab_size
    prompts = [_prompt(70, vocab, seed=50 + i) for i in range(4)]
    want = [run_one(ref, p, 4).outputs[0].token_ids for p in prompts]
    page_bytes = ref.engine.kv.specs["full"].bytes_per_page(16)
    llm = LLM(path, dtype="float32", max_model_len=256, enable_hierarchical_cache=True, hicache_size=3 * page_bytes)
    for _ in range(2):
        for p, w in zip(prompts, want):
            assert run_one(llm, p, 4).outputs[0].token_ids == w
            llm.engine.kv.check_invariants()
        evict_device(llm)
    stats = llm.engine.kv.host_tier.stats
    assert stats.host_evicted_nodes + stats.host_copies_dropped + stats.write_failures > 0
    assert llm.engine.kv.host_tier.pools["full"].num_used <= 3


def test_config_errors_name_the_problem(tiny_ckpt):
    path = tiny_ckpt("llama")
    with pytest.raises(ValueError, match="enable_hierarchical_cache=True"):
        LLM(path, preemption_mode="swap")
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(path, enable_hierarchical_cache=True, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="hicache_write_policy"):
        LLM(path, enable_hierarchical_cache=True, hicache_write_policy="sometimes")
    with pytest.raises(ValueError, match="page_first"):
        LLM(path, enable_hierarchical_cache=True, hicache_mem_layout="diagonal")
    with pytest.raises(ValueError, match="preemption_mode"):
        LLM(path, preemption_mode="pause")


# -- load-backs waited for layer by layer (model_executor/kv_loads.py) ---------------------------
def _record_loads(llm: LLM) -> list:
    """Every PendingKVLoads the runner hands a forward, kept for inspection."""
    host_cache = llm.engine.runner.host_cache
    seen, take = [], host_cache.take_loads

    def recording():
        loads = take()
        if loads is not None:
            seen.append(loads)
        return loads

    host_cache.take_loads = recording
    return seen


@pytest.mark.parametrize("model", ["llama", "v4"])
def test_load_backs_are_waited_for_by_each_layer_before_it_reads(tiny_ckpt, tmp_path_factory, model):
    """On the CPU a load-back's copies are deferred until a reader waits for them, so a layer
    that reads its cache without waiting would read stale pages: the outputs equal the no-cache
    run's, and every load unit was completed by a reader's wait (none was left for the
    after-forward safety net)."""
    with single_thread():
        if model == "llama":
            path, kw = tiny_ckpt("llama"), dict(max_model_len=256)
        else:
            path = build_v4_checkpoint(str(tmp_path_factory.mktemp("v4loads")), sliding_window=40, index_topk=5)
            kw = dict(block_size=32, max_model_len=256, max_num_seqs=2)
        ref = LLM(path, dtype="float32", enable_prefix_caching=False, **kw)
        prompt = _prompt(100, ref.engine.runner.config.vocab_size, seed=60)
        want = run_one(ref, prompt, 6)
        llm = LLM(path, dtype="float32", enable_hierarchical_cache=True, **kw)
        seen = _record_loads(llm)
        run_one(llm, prompt[:96] + [7], 1)
        evict_device(llm)
        out = run_one(llm, prompt, 6)
        assert out.metrics["prompt_tokens_from_host"] == 96, out.metrics
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        torch.testing.assert_close(torch.tensor(sampled_logprobs(out)), torch.tensor(sampled_logprobs(want)),
                                   atol=LOGPROB_ATOL, rtol=0)
        assert len(seen) == 1, "one step loads the hit back"
        loads = seen[0]
        assert loads.num_waits == loads.num_units > 0, "a load unit was not waited for by any reader"


def test_a_forward_that_raises_still_completes_its_load_backs(tiny_ckpt, monkeypatch):
    """A forward that fails before any layer waited: the runner completes the step's load-backs
    anyway (its finally), so no copy is left pending to land later over reused pages, and the
    pages hold the host data: the same step run again (forward restored) gives the no-cache
    run's output."""
    path = tiny_ckpt("llama")
    ref = LLM(path, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    prompt = _prompt(100, ref.engine.runner.config.vocab_size, seed=62)
    want = run_one(ref, prompt, 4)
    llm = LLM(path, dtype="float32", max_model_len=256, enable_hierarchical_cache=True)
    seen = _record_loads(llm)
    run_one(llm, prompt[:96] + [7], 1)
    evict_device(llm)
    for t in llm.engine.runner.kv_caches["full"]:  # freed device pages: no stale read can pass
        t[..., 16:, :].normal_()
    model = llm.engine.runner.model

    def boom(*args, **kwargs):
        raise RuntimeError("forward failed")

    monkeypatch.setattr(model, "forward", boom)
    engine = llm.engine
    rid = engine.add_request(None, {"prompt_token_ids": prompt}, params=SamplingParams(max_tokens=4, temperature=0))
    with pytest.raises(RuntimeError, match="forward failed"):
        engine.step()
    assert len(seen) == 1, "the failed step had load-backs"
    loads = seen[0]
    assert loads.num_waits == 0 and loads.num_done == loads.num_units > 0, (
        f"{loads.num_done} of {loads.num_units} load units completed after a failed forward")
    monkeypatch.undo()
    outputs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outputs[o.request_id] = o
    out = outputs[rid]
    assert out.metrics["prompt_tokens_from_host"] == 96, out.metrics
    assert out.outputs[0].token_ids == want.outputs[0].token_ids, "the loaded pages do not hold the host data"


def test_a_reader_that_does_not_wait_reads_stale_pages(tiny_ckpt, monkeypatch):
    """The check above can fail: with the backend's wait removed, the first layer reads the
    deferred pages before they are copied and the output changes (the CPU twin of a missing
    event wait on the GPU side stream)."""
    from hybridkv.model_executor import kv_loads

    path = tiny_ckpt("llama")
    ref = LLM(path, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    prompt = _prompt(100, ref.engine.runner.config.vocab_size, seed=61)
    want = run_one(ref, prompt, 4)
    llm = LLM(path, dtype="float32", max_model_len=256, enable_hierarchical_cache=True)
    run_one(llm, prompt[:96] + [7], 1)
    evict_device(llm)
    # Scribble over the freed device pages so a stale read cannot happen to find the right data.
    for t in llm.engine.runner.kv_caches["full"]:
        t[..., 16:, :].normal_()
    monkeypatch.setattr(kv_loads.PendingKVLoads, "wait", lambda self, *tensors: None)
    out = run_one(llm, prompt, 4)
    assert out.metrics["prompt_tokens_from_host"] == 96
    assert sampled_logprobs(out) != sampled_logprobs(want), "a reader that skipped its wait still read the right pages"


def test_a_device_page_queued_for_the_host_and_reused_in_the_same_pass_is_copied_first(tiny_ckpt):
    """Decodes take their new page from the back of the free list, which is where the page an
    eviction just freed lands. Under write_back, a page crossing therefore often evicts a cached
    node (its device->host copy queued, its device page freed) and takes that very page in the
    same scheduling pass; the forward then writes the decode's K/V into it. TierTransfers'
    contract (every copy before the next forward) must hold for that interleaving: the run sees
    it happen, its outputs equal the unconstrained run's, and the demoted prefixes, served back
    from the host, still give the reference outputs (their host copies hold the old content)."""
    path = tiny_ckpt("llama")
    vocab = 300
    seeds = [_prompt(48, vocab, seed=60 + i) for i in range(6)]  # cached, then demoted
    decoders = [_prompt(40, vocab, seed=80 + i) for i in range(2)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    big = LLM(path, dtype="float32", max_model_len=256)
    want = {tuple(p): o.outputs[0].token_ids
            for p, o in zip(seeds + decoders,
                            big.generate([{"prompt_token_ids": p} for p in seeds + decoders], params, use_tqdm=False))}
    page_bytes = big.engine.kv.specs["full"].bytes_per_page(16)
    llm = LLM(path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=24 * page_bytes,
              enable_hierarchical_cache=True, hicache_ratio=8.0, hicache_write_policy="write_back")
    kv = llm.engine.kv
    space = kv.spaces["full"]
    taken: set[int] = set()  # device pages handed out since the last flush
    reused: list[int] = []  # pages both queued as a copy's source and handed out in one pass
    allocate, take = space.allocate, kv.take_transfers

    def spy_allocate(n, *args, **kwargs):
        pages = allocate(n, *args, **kwargs)
        taken.update(pages)
        return pages

    def spy_take():
        transfers = take()
        reused.extend(p for p in transfers.to_host.get("full", {}).values() if p in taken)
        taken.clear()
        return transfers

    space.allocate, kv.take_transfers = spy_allocate, spy_take
    for p in seeds:  # one at a time: each leaves its pages cached and unlocked
        assert llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids == want[tuple(p)]
    outs = llm.generate([{"prompt_token_ids": p} for p in decoders], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want[tuple(p)] for p in decoders]
    assert reused, "no page was queued for the host and handed out again in the same pass: the scenario did not happen"
    from_host = 0
    for p in seeds:  # demoted prefixes come back from the host with their old content
        out = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want[tuple(p)], "a host copy of a reused device page was corrupted"
        from_host += out.metrics["prompt_tokens_from_host"]
    assert from_host > 0, "no prefix was served from the host"
    space.allocate, kv.take_transfers = allocate, take


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_pages_pending_publication_when_a_decode_is_aborted_reach_the_host(tiny_ckpt, policy):
    """A decoding request's pages are published in batches (KVCacheManager.publish_pages); aborted
    while some are still pending, retire publishes them and the abort runs their host copies
    (write-through) or leaves them to eviction (write-back). Then, with every device page
    evicted, its prompt + generated tokens are a host hit over all those pages, and the output
    equals a no-cache run's."""
    path = tiny_ckpt("llama")
    llm = LLM(path, dtype="float32", max_model_len=256, enable_hierarchical_cache=True, hicache_write_policy=policy)
    eng, kv = llm.engine, llm.engine.kv
    P = kv.page_size
    assert kv.publish_pages > 2, "the test needs batched publication"
    prompt = _prompt(20, eng.runner.config.vocab_size, seed=70)
    eng.add_request("a", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=150, ignore_eos=True))
    req = None
    while True:
        eng.step()
        req = eng.scheduler.running[0]
        whole = req.num_computed_tokens // P
        if whole - kv.request_pages[req.request_id].num_inserted_pages >= 2:
            break  # at least two decoded pages computed but not yet in the index
    computed = list(req.all_token_ids[: whole * P])
    eng.abort_request("a")
    kv.check_invariants()
    evict_device(llm)
    probe = computed + [(computed[-1] + 1) % 50 + 3]
    ref = LLM(path, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    want = run_one(ref, probe, 6)
    out = run_one(llm, probe, 6)
    assert out.num_cached_tokens == whole * P, f"hit {out.num_cached_tokens} of {whole * P}: pending pages were lost"
    assert out.metrics["prompt_tokens_from_host"] == whole * P
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
    torch.testing.assert_close(torch.tensor(sampled_logprobs(out)), torch.tensor(sampled_logprobs(want)),
                               atol=LOGPROB_ATOL, rtol=0)

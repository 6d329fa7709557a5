"""HiSparse end to end on tiny DeepSeek-V4 checkpoints: decode reads C4 entries from per-request
hot buffers over the host mirror, and nothing about the output changes.

Invariants checked:
- greedy tokens and logprobs with HiSparse equal those without, on both V4 test configs, for
  prompts whose C4 history is many times the buffer, in mixed-length batches, with chunked
  prefill, with prefix hits and under preemption;
- a buffer of exactly top-k (misses nearly every step) and one that holds every entry (no
  loads at all after the hand-off) both give the reference output;
- at equal kv_cache_memory_bytes, the device's whole-history spaces get more pages (the c4
  mirror is charged to host memory), and a mirror_bytes limit is what bounds the c4 space;
- configurations that cannot work are refused with errors naming the problem;
- every engine ends idle (conftest): no hot-buffer row is left held.
"""
from __future__ import annotations

import pytest

from hisparse_helpers import assert_same_outputs, generate_greedy, random_prompts
from hybridkv.entrypoints import LLM, SamplingParams
from tiny_deepseek_v4 import build_v4_checkpoint, single_thread

V4_CONFIGS = {
    "w16_topk8": dict(),
    "w40_topk5": dict(sliding_window=40, index_topk=5),
}


@pytest.fixture(scope="module")
def v4_path(tmp_path_factory):
    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in built:
            built[name] = build_v4_checkpoint(str(tmp_path_factory.mktemp(f"v4hs_{name}")), **V4_CONFIGS[name])
        return built[name]

    return get


@pytest.fixture(autouse=True)
def _one_thread():
    with single_thread():
        yield


KW = dict(dtype="float32", block_size=32, max_model_len=2048, max_num_seqs=4)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(V4_CONFIGS))
def test_long_mixed_batch_with_chunked_prefill_equals_hisparse_off(v4_path, name):
    """Prompts up to 3,000 tokens (750 C4 entries, ~47x a 16-entry buffer), prefilled in
    512-token chunks, decoded side by side."""
    path = v4_path(name)
    prompts = random_prompts([3000, 90, 1200])
    kw = dict(KW, max_model_len=3072, max_num_batched_tokens=512)
    want = generate_greedy(LLM(path, **kw), prompts, 20)
    llm = LLM(path, enable_hisparse=True, hisparse_config={"hot_buffer_size": 16}, **kw)
    got = generate_greedy(llm, prompts, 20)
    assert_same_outputs(got, want)
    st = llm.engine.runner.hot_buffers.stats
    assert st.loaded > 0 and st.handoffs == 3, st
    assert all(o.metrics["hisparse_hit_rate"] is not None for o in got)


@pytest.mark.parametrize("name", list(V4_CONFIGS))
def test_buffer_of_exactly_topk_and_buffer_that_holds_everything(v4_path, name):
    path = v4_path(name)
    topk = {"w16_topk8": 8, "w40_topk5": 5}[name]
    prompts = random_prompts([400, 130], seed=1)
    want = generate_greedy(LLM(path, **KW), prompts, 16)
    tight = LLM(path, enable_hisparse=True, hisparse_config={"hot_buffer_size": topk}, **KW)
    assert_same_outputs(generate_greedy(tight, prompts, 16), want)
    st = tight.engine.runner.hot_buffers.stats
    assert st.loaded > st.lookups // 4, f"a buffer of top-k should miss often: {st}"
    roomy = LLM(path, enable_hisparse=True, hisparse_config={"hot_buffer_size": 128}, **KW)
    assert_same_outputs(generate_greedy(roomy, prompts, 16), want)
    st = roomy.engine.runner.hot_buffers.stats
    assert st.loaded == 0 and st.hits == st.lookups > 0, f"every entry fits: nothing may be loaded: {st}"


def test_prefix_hit_then_decode_equals_hisparse_off(v4_path):
    path = v4_path("w16_topk8")
    base = random_prompts([320], seed=2)[0]
    longer = base + random_prompts([70], seed=3)[0]
    ref = LLM(path, enable_prefix_caching=False, **KW)
    want = [generate_greedy(ref, [base], 12)[0], generate_greedy(ref, [longer], 12)[0]]
    llm = LLM(path, enable_hisparse=True, hisparse_config={"hot_buffer_size": 12}, **KW)
    first = generate_greedy(llm, [base], 12)[0]
    second = generate_greedy(llm, [longer], 12)[0]
    assert second.num_cached_tokens >= 288, "the second prompt should hit the first's cached pages"
    assert_same_outputs([first, second], want)


def test_preemption_equals_hisparse_off(v4_path):
    """A device budget that holds about two of the four sequences: requests are preempted (their
    hot-buffer rows released) and resume with a fresh hand-off."""
    path = v4_path("w16_topk8")
    prompts = random_prompts([300, 280, 260, 240], seed=4)
    kw = dict(KW, max_model_len=384, max_num_batched_tokens=64)
    want = generate_greedy(LLM(path, **kw), prompts, 40)
    # Windowed spaces: 10 pages (3 decoding x 2 + one 64-token chunk with its window, 4) of swa +
    # state_c4 + state_c128 (32,768 B each); hot buffers 11,840 B (4 rows x 10 entries of 128 B
    # and a null slot per CSA layer, 1,344 B of slot tables); the device spaces' null pages
    # 34,048 B; whole-history: 24 pages of 1,280 B with HiSparse (about two sequences of 340 tokens).
    llm = LLM(path, enable_hisparse=True, hisparse_config={"hot_buffer_size": 10}, kv_cache_memory_bytes=405_288,
              **kw)
    assert llm.engine.kv.spaces["indexer"].num_pages == 24
    got = generate_greedy(llm, prompts, 40)
    assert llm.engine.scheduler.num_preemptions > 0, "the budget forced no preemption"
    assert_same_outputs(got, want)


def test_equal_device_budget_gives_more_device_pages_and_the_mirror_bounds_c4(v4_path):
    path = v4_path("w16_topk8")
    # Windowed spaces capped at 8 pages (2 x 3 + one 64-token chunk), so the rest of the budget
    # goes to the whole-history spaces: c4 is 2/3 of their bytes in this config.
    kw = dict(KW, max_model_len=512, max_num_seqs=2, max_num_batched_tokens=64, kv_cache_memory_bytes=700_000)
    off = LLM(path, **kw).engine.kv.spaces
    on = LLM(path, enable_hisparse=True, hisparse_config={"hot_buffer_size": 16}, **kw).engine.kv.spaces
    assert on["indexer"].num_pages > off["indexer"].num_pages and on["c128"].num_pages > off["c128"].num_pages
    assert on["c4"].num_pages == on["indexer"].num_pages
    c4_page = LLM(path, **kw).engine.kv.specs["c4"].bytes_per_page(32)
    capped = LLM(path, enable_hisparse=True, hisparse_config={"hot_buffer_size": 16, "mirror_bytes": 20 * c4_page},
                 **kw).engine.kv.spaces
    assert capped["c4"].num_pages == 20


def test_configurations_that_cannot_work_are_refused(v4_path, tiny_ckpt):
    path = v4_path("w16_topk8")
    with pytest.raises(ValueError, match="smaller than the model's index_topk"):
        LLM(path, enable_hisparse=True, hisparse_config={"hot_buffer_size": 4}, **KW)
    with pytest.raises(ValueError, match="unknown hisparse_config key"):
        LLM(path, enable_hisparse=True, hisparse_config={"buffer": 4}, **KW)
    with pytest.raises(ValueError, match="not valid JSON"):
        LLM(path, enable_hisparse=True, hisparse_config="{hot_buffer_size: 4", **KW)
    with pytest.raises(ValueError, match="enable_hisparse is False"):
        LLM(path, hisparse_config={"hot_buffer_size": 16}, **KW)
    with pytest.raises(ValueError, match="compressed sparse attention"):
        LLM(tiny_ckpt("llama"), dtype="float32", max_model_len=256, enable_hisparse=True)


def test_metrics_report_hit_rate_loads_and_mirror_use(v4_path):
    """The per-request report carries the hit rate; /metrics' collector exports the engine's
    HiSparse counters, and they agree with the hot buffers' own."""
    from prometheus_client import generate_latest

    from hybridkv.engine.async_llm_engine import EngineSnapshot
    from hybridkv.entrypoints.openai.metrics import ServerMetrics

    path = v4_path("w16_topk8")
    llm = LLM(path, enable_hisparse=True, hisparse_config={"hot_buffer_size": 8}, **KW)
    out = generate_greedy(llm, random_prompts([200], seed=5), 10)[0]
    st = llm.engine.runner.hot_buffers.stats
    assert out.metrics["hisparse_lookups"] == st.lookups > 0
    assert out.metrics["hisparse_hit_rate"] == pytest.approx(st.hits / st.lookups)
    text = generate_latest(ServerMetrics("m", lambda: EngineSnapshot.capture(llm.engine)).registry).decode()
    assert f'hybridkv:hisparse_loaded_entries_total{{model_name="m"}} {float(st.loaded)}' in text, text
    assert 'hybridkv:hisparse_hot_buffer_rows{model_name="m"} 0.0' in text
    mirror = llm.engine.kv.spaces["c4"]
    assert f'hybridkv:hisparse_mirror_pages{{model_name="m"}} {float(mirror.num_cached)}' in text


def test_abort_mid_decode_releases_the_row_and_leaves_the_others_unchanged(v4_path):
    """A request aborted while it decodes with a hot buffer: its buffer row is released (and
    emptied) at once, a request that starts later reuses it with a fresh hand-off, and the
    surviving requests' tokens are those of a run without the aborted one."""
    path = v4_path("w16_topk8")
    a, b, late = random_prompts([300, 220, 180], seed=7)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = {o.request_id: o.outputs[0].token_ids for o in
            LLM(path, **KW).generate([{"prompt_token_ids": p} for p in (a, late)], sp, use_tqdm=False)}
    llm = LLM(path, enable_hisparse=True, hisparse_config={"hot_buffer_size": 16}, **KW)
    eng = llm.engine
    hs = eng.runner.hot_buffers
    eng.add_request("a", {"prompt_token_ids": a}, sp)
    eng.add_request("b", {"prompt_token_ids": b}, sp)
    (b_seq,) = eng.sequence_ids("b")  # hot-buffer rows belong to sequences
    out: dict[str, list[int]] = {}
    for _ in range(400):  # until b has decoded a few tokens from its buffer
        for o in eng.step():
            out[o.request_id] = o.outputs[0].token_ids
        if hs.row_of(b_seq) is not None and len(out.get("b", [])) >= 3:
            break
    row = hs.row_of(b_seq)
    assert row is not None and len(out["b"]) < 12, "b never decoded from a hot buffer, or finished first"
    eng.abort_request("b")
    assert hs.row_of(b_seq) is None and hs.num_active == 1
    assert bool((hs.entry[:, row] == -1).all()), "the aborted request's buffer row was not emptied"
    hs.check_invariants()
    eng.add_request("late", {"prompt_token_ids": late}, sp)
    while eng.has_unfinished_requests():
        for o in eng.step():
            out[o.request_id] = o.outputs[0].token_ids
    assert out["a"] == want["0"] and out["late"] == want["1"]
    assert hs.num_active == 0 and hs.num_tracked == 0


def test_hisparse_with_the_host_tier_equals_both_off(v4_path):
    """HiSparse and HiCache L2 together: the first prompt's pages are all evicted from the device
    (to the host tier: the c4 mirror, swa, state, c128 and indexer pages alike), then a longer
    prompt over it is loaded back layer by layer and decodes through the hot buffers; outputs
    equal the run with neither."""
    path = v4_path("w16_topk8")
    base = random_prompts([320], seed=4)[0]
    longer = base + random_prompts([70], seed=5)[0]
    ref = LLM(path, enable_prefix_caching=False, **KW)
    want = [generate_greedy(ref, [base], 12)[0], generate_greedy(ref, [longer], 12)[0]]
    llm = LLM(path, enable_hisparse=True, hisparse_config={"hot_buffer_size": 12}, enable_hierarchical_cache=True,
              **KW)
    first = generate_greedy(llm, [base], 12)[0]
    kv = llm.engine.kv
    for name, space in kv.spaces.items():
        kv.index.evict(name, space.num_pages)
    llm.engine.executor.flush_copies()
    second = generate_greedy(llm, [longer], 12)[0]
    assert second.metrics["prompt_tokens_from_host"] >= 288, second.metrics
    assert_same_outputs([first, second], want)
    assert llm.engine.runner.hot_buffers.num_active == 0

"""The FP8 KV cache (kv_cache_dtype) on tiny DeepSeek-V4 checkpoints.

- the swa, c4, c128 and indexer pools are FP8 (HiSparse's hot buffers too) and the compressor
  state stays float32; teacher-forced next tokens mostly agree with the model-dtype cache;
- exactness relative to FP8 without the feature: prefix hits, chunked prefill, preemption, the
  host tier, the file storage tier, HiSparse, n-gram and MTP speculation and two ranks give the
  tokens and logprobs of a plain FP8 engine, since every path reads the pools' FP8 bytes and the
  tiers and hot buffers move those bytes as they are; a bfloat16 model's HiSparse tokens too;
- capacity: an equal budget holds about twice the 4k-token requests of a bfloat16 cache (the
  whole-history spaces halve; the windowed state rings, float32, do not).
"""
from __future__ import annotations

import pytest
import torch

from hisparse_helpers import assert_same_outputs, generate_greedy, random_prompts
from host_tier_helpers import evict_device
from hybridkv.entrypoints import LLM, SamplingParams
from hybridkv.model_executor.model_runner import model_skeleton
from prefix_hit_helpers import sampled_logprobs
from speculative_helpers import V4_KW, greedy_tokens, v4_prompts
from tiny_deepseek_v4 import build_v4_checkpoint, single_thread
from tp_helpers import shut_down  # noqa: F401 - a fixture

KW = dict(dtype="float32", block_size=32, max_model_len=512, max_num_seqs=4, kv_cache_dtype="fp8")
TOKEN_SPACES = ("swa", "c4", "c128", "indexer")
STATE_SPACES = ("state_c4", "state_c128")


@pytest.fixture(autouse=True)
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def v4(tmp_path_factory) -> str:
    return build_v4_checkpoint(str(tmp_path_factory.mktemp("v4fp8")))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Three prompts, two sharing a 96-token prefix (three pages: a prefix cache has something to hit)."""
    shared = random_prompts([96], seed=21)[0]
    tails = random_prompts([70, 9, 150], seed=22)
    return [shared + tails[0], tails[2], shared + tails[1]]


@pytest.fixture(scope="module")
def reference(v4, prompts):
    """A plain FP8 engine: no prefix cache, whole prompts in one step."""
    return generate_greedy(LLM(v4, enable_prefix_caching=False, max_num_batched_tokens=1024, **KW), prompts, 16)


def _budget(path: str, kv: str, pages: float) -> int:
    """`pages` 32-token pages of every space, in kv's bytes."""
    specs = model_skeleton(path, "float32", 512, "cpu", kv_cache_dtype=kv).specs
    return int(pages * 32 * sum(s.bytes_per_slot for s in specs))


# -- pools and agreement -------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,dtype", [("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_token_spaces_are_fp8_and_the_compressor_state_stays_float32(v4, fmt, dtype):
    llm = LLM(v4, **dict(KW, kv_cache_dtype=fmt))
    caches = llm.engine.runner.kv_caches
    assert {n: {t.dtype for t in caches[n]} for n in TOKEN_SPACES} == {n: {dtype} for n in TOKEN_SPACES}
    assert {n: {t.dtype for t in caches[n]} for n in STATE_SPACES} == {n: {torch.float32} for n in STATE_SPACES}
    auto = LLM(v4, **dict(KW, kv_cache_dtype="auto")).engine.kv.specs
    fp8 = llm.engine.kv.specs
    assert all(fp8[n].bytes_per_slot * 4 == auto[n].bytes_per_slot for n in TOKEN_SPACES)
    assert all(fp8[n].bytes_per_slot == auto[n].bytes_per_slot for n in STATE_SPACES)


def test_teacher_forced_next_tokens_mostly_agree_with_the_model_dtype_cache(v4, prompts):
    """prompt_logprobs over the prompts: the top-1 token at each position and the text's logprob.
    The tiny random model's agreement measured 0.90 over 3,000 positions of real text
    (benchmarks/kv_cache_dtype.py --tiny-v4); 0.8 here leaves room for these short prompts."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    rows = {}
    for kv in ("auto", "fp8"):
        llm = LLM(v4, **dict(KW, kv_cache_dtype=kv, enable_prefix_caching=False))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        rows[kv] = [(next(t for t, lp in e.items() if lp.rank == 1), e[tok].logprob)
                    for p, o in zip(prompts, outs) for tok, e in zip(p[1:], o.prompt_logprobs[1:])]
    pairs = list(zip(rows["auto"], rows["fp8"]))
    agree = sum(a[0] == b[0] for a, b in pairs) / len(pairs)
    deltas = [abs(a[1] - b[1]) for a, b in pairs]
    assert agree >= 0.8, agree
    assert 0 < sum(deltas) / len(deltas) < 0.2, "FP8 should round the keys a little, not leave them exact"


# -- exactness relative to FP8 -------------------------------------------------------------------
def test_prefix_hits_chunked_prefill_and_preemption_keep_the_fp8_tokens(v4, prompts, reference):
    llm = LLM(v4, max_num_batched_tokens=48, **KW)
    assert_same_outputs(generate_greedy(llm, prompts, 16), reference, "48-token chunks changed the FP8 tokens")
    assert_same_outputs(generate_greedy(llm, prompts, 16), reference, "prefix hits changed the FP8 tokens")
    assert llm.engine.kv.prefix_hits > 0
    # 10 pages of each whole-history space: the three requests need 13 (two share 3 pages)
    tight = LLM(v4, **dict(KW, max_model_len=192, max_num_batched_tokens=48,
                           kv_cache_memory_bytes=_budget(v4, "fp8", 2.95)))
    assert tight.engine.kv.spaces["c4"].num_pages == 10
    assert_same_outputs(generate_greedy(tight, prompts, 16), reference, "preemption changed the FP8 tokens")
    assert tight.engine.scheduler.num_preemptions > 0, "the budget should preempt"
    tight.engine.check_invariants()


def test_host_tier_moves_fp8_pages_bit_for_bit(v4, prompts, reference):
    """Every device page evicted to the host tier (all six spaces) and loaded back on the second pass."""
    llm = LLM(v4, enable_hierarchical_cache=True, **KW)
    assert_same_outputs(generate_greedy(llm, prompts, 16), reference)
    evict_device(llm)
    assert_same_outputs(generate_greedy(llm, prompts, 16), reference, "pages loaded from the host changed the tokens")
    loaded = llm.engine.kv.host_tier.stats.loaded_pages
    assert all(loaded.get(n, 0) > 0 for n in ("c4", "c128", "indexer")), loaded
    llm.engine.check_invariants()


def test_storage_tier_serves_fp8_pages_to_a_new_engine(v4, prompts, reference, tmp_path):
    def file_llm() -> LLM:
        return LLM(v4, enable_hierarchical_cache=True, hicache_storage_backend="file", hicache_storage_dir=str(tmp_path),
                   hicache_storage_prefetch_policy="wait_complete", **KW)

    first = file_llm()
    assert_same_outputs(generate_greedy(first, prompts[:1], 16), reference[:1])
    first.engine.storage.drain()
    second = file_llm()  # empty device and host tiers
    out = generate_greedy(second, prompts[:1], 16)
    assert out[0].metrics["prompt_tokens_from_storage"] == 160, out[0].metrics
    assert_same_outputs(out, reference[:1], "pages from storage changed the FP8 tokens")
    second.engine.check_invariants()


def test_hisparse_hot_buffers_hold_the_fp8_bytes_and_keep_the_tokens(v4, prompts, reference):
    """A buffer of exactly top-k (8): decode steps miss and copy FP8 entries in from the mirror."""
    llm = LLM(v4, enable_hisparse=True, hisparse_config={"hot_buffer_size": 8}, **KW)
    assert {t.dtype for t in llm.engine.runner.model.auxiliary_kv_tensors()["hot_buffer"][:2]} == {torch.float8_e4m3fn}
    assert_same_outputs(generate_greedy(llm, prompts, 16), reference, "HiSparse changed the FP8 tokens")
    assert llm.engine.runner.hot_buffers.stats.loaded > 0
    llm.engine.check_invariants()


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_speculation_keeps_the_fp8_tokens(tmp_path, method):
    """n-gram and MTP drafts verified over FP8 pools (the MTP layer's keys are one more layer of
    the FP8 swa pool): the tokens of plain FP8 decoding, chunks and prefix hits included."""
    path = build_v4_checkpoint(str(tmp_path / "v4"), mtp=method == "mtp")
    kw = dict(V4_KW, kv_cache_dtype="fp8")
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        spec.update(prompt_lookup_min=1, prompt_lookup_max=3)
    plain, llm = LLM(path, **kw), LLM(path, speculative_config=spec, **kw)
    prompts = v4_prompts(plain.engine.runner.config.vocab_size)
    want = greedy_tokens(plain, prompts, 40)
    assert greedy_tokens(llm, prompts, 40) == want, "verified drafts changed the FP8 tokens"
    assert greedy_tokens(llm, prompts, 40) == want, "prefix hits under speculation changed the FP8 tokens"
    assert llm.engine.runner.kv_caches["swa"][0].dtype == torch.float8_e4m3fn
    assert llm.engine.stats["spec_draft_tokens"] > 0 and llm.engine.kv.prefix_hits > 0


@pytest.mark.slow
def test_two_ranks_match_one_process_with_fp8_caches(v4, prompts, reference, shut_down):
    """Each rank holds the whole KV head (V4 shards query heads) and quantizes the same rows: the
    tokens are one process's; logprobs agree to float32 all-reduce rounding."""
    two = LLM(v4, tensor_parallel_size=2, enable_prefix_caching=False, max_num_batched_tokens=1024, **KW)
    shut_down(two)
    assert two.engine.runner.kv_caches["swa"][0].dtype == torch.float8_e4m3fn
    got = generate_greedy(two, prompts, 16)
    two.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in reference]
    for g, w in zip(got, reference):
        torch.testing.assert_close(torch.tensor(sampled_logprobs(g)), torch.tensor(sampled_logprobs(w)), atol=1e-2, rtol=0)


def test_a_bfloat16_model_reads_its_fp8_pools_and_hisparse_keeps_its_tokens(v4, prompts):
    """The bf16 paths (queries, compressor pooling and the joint softmax in bf16; the torch path,
    as the fused kernels take float32 queries) over FP8 pools: HiSparse's buffers hold the pools'
    bytes, so its tokens are the plain engine's."""
    kw = dict(KW, dtype="bfloat16", enable_prefix_caching=False)
    want = generate_greedy(LLM(v4, **kw), prompts, 12)
    llm = LLM(v4, enable_hisparse=True, hisparse_config={"hot_buffer_size": 8}, **kw)
    assert llm.engine.runner.kv_caches["c4"][0].dtype == torch.float8_e4m3fn
    got = generate_greedy(llm, prompts, 12)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.engine.runner.hot_buffers.stats.loaded > 0
    llm.engine.check_invariants()


# -- capacity ------------------------------------------------------------------------------------
def test_equal_budgets_hold_twice_the_4k_token_requests_and_more_host_tier_tokens(tmp_path):
    """The 4,096-token requests a device budget holds at once (each needs 4096/P pages of every
    whole-history space: c4, c128, indexer): slightly more than twice, since the windowed swa
    pages are FP8 too and the bytes they save go to the whole-history spaces. The host tier
    keeps one page of every space per cached page, the float32 state rings included, so an
    equal hicache_size holds (bytes of a page of every space, auto) / (the same, FP8) times
    the tokens: 1.55x for this config, whose state rings are 29% of a bfloat16 page set."""
    path = build_v4_checkpoint(str(tmp_path / "v4"), max_position_embeddings=4096)
    fit, host_tokens, page_set = {}, {}, {}
    for kv in ("auto", "fp8"):
        llm = LLM(path, dtype="bfloat16", block_size=128, max_model_len=4096, max_num_seqs=8,
                  kv_cache_memory_bytes=32 << 20, kv_cache_dtype=kv, enable_hierarchical_cache=True,
                  hicache_size=32 << 20)
        kv_manager = llm.engine.kv
        fit[kv] = min(kv_manager.spaces[n].num_pages // (4096 // 128) for n in ("c4", "c128", "indexer"))
        host_tokens[kv] = kv_manager.host_tier.pools["c4"].num_pages * 128
        page_set[kv] = sum(s.bytes_per_page(128) for s in kv_manager.specs.values())
        llm.engine.check_invariants()
    assert fit["auto"] >= 4, fit
    assert 1.95 <= fit["fp8"] / fit["auto"] <= 2.2, fit
    assert host_tokens["fp8"] / host_tokens["auto"] == pytest.approx(page_set["auto"] / page_set["fp8"], rel=0.01)
    assert host_tokens["fp8"] / host_tokens["auto"] >= 1.5, host_tokens

"""N-gram speculative decoding on DeepSeek-V4's hybrid cache: a rejected draft has written SWA
K/V, closed C4/C128/indexer windows and written compressor state rows. Greedy outputs equal plain
decoding's with chunked prefill, prefix hits, preemption, the host tier and two ranks; the state
rings are widened for the drafts (without that the outputs differ); every space ends with all
pages free or cached."""
from __future__ import annotations

import pytest

from hybridkv.engine.speculative.config import SpeculativeConfig, draft_space_specs
from hybridkv.entrypoints import LLM
from host_tier_helpers import evict_device
from speculative_helpers import V4_KW, assert_drafts_accepted_and_rejected, greedy_tokens, v4_prompts
from tiny_deepseek_v4 import build_v4_checkpoint, single_thread
from tp_helpers import kv_bytes, shut_down  # noqa: F401 - shut_down: a fixture

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# 32-token pages (the tiny model's ratios are 4 and 16), 48-token chunks, one step a call
KW = V4_KW


@pytest.fixture(autouse=True)
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def v4(tmp_path_factory) -> str:
    return build_v4_checkpoint(str(tmp_path_factory.mktemp("v4")))


def _tokens(llm: LLM, prompts: list[dict], max_tokens: int = 60) -> list[list[int]]:
    return greedy_tokens(llm, prompts, max_tokens)


def test_greedy_tokens_equal_plain_decoding_with_chunks_and_prefix_hits(v4):
    plain, spec = LLM(v4, **KW), LLM(v4, speculative_config=SPEC, **KW)
    prompts = v4_prompts(plain.engine.runner.config.vocab_size)
    want = _tokens(plain, prompts)
    assert _tokens(spec, prompts) == want
    assert spec.engine.stats["steps"] < plain.engine.stats["steps"]  # several tokens per verified step
    assert _tokens(spec, prompts) == want  # the second pass hits the first one's pages in every space
    assert spec.engine.kv.prefix_hits > 0
    assert_drafts_accepted_and_rejected(spec)
    rings = {n: s.ring for n, s in spec.engine.kv.specs.items() if s.ring is not None}
    assert rings == {"state_c4": 8 + 4, "state_c128": 16 + 4}, rings


def test_state_rings_one_window_wide_would_change_the_tokens(v4, monkeypatch):
    """The negative control of the widened rings: with rings of one window, a rejected draft's
    state row overwrites one the next windows read, and the outputs differ."""
    import hybridkv.engine.speculative.config as spec_config

    plain = LLM(v4, **KW)
    prompts = v4_prompts(plain.engine.runner.config.vocab_size)
    want = _tokens(plain, prompts)
    monkeypatch.setattr(spec_config, "draft_space_specs", lambda spec, specs: specs)
    narrow = LLM(v4, speculative_config=SPEC, **KW)
    assert _tokens(narrow, prompts) != want


def test_preemption_and_host_tier_hits_keep_the_tokens(v4):
    """A budget that preempts, then every device page evicted to the host tier and loaded back
    on the second pass (all six spaces)."""
    kw = dict(KW, max_model_len=128)
    plain = LLM(v4, **kw)
    prompts = v4_prompts(plain.engine.runner.config.vocab_size)
    want = _tokens(plain, prompts)
    budget = kv_bytes(v4, 1, 4, page_size=32)  # 4 pages of each growing space: one request at a time
    spec = LLM(v4, speculative_config=SPEC, kv_cache_memory_bytes=budget, enable_hierarchical_cache=True, **kw)
    assert _tokens(spec, prompts) == want
    assert spec.engine.scheduler.num_preemptions > 0, "the budget should preempt"
    evict_device(spec)
    assert _tokens(spec, prompts) == want
    assert sum(spec.engine.kv.host_tier.stats.loaded_pages.values()) > 0, "pass 2 should load pages from the host"
    assert_drafts_accepted_and_rejected(spec)


@pytest.mark.slow
def test_two_ranks_with_speculation_match_one_process_without(v4, shut_down):
    plain = LLM(v4, **KW)
    prompts = v4_prompts(plain.engine.runner.config.vocab_size)
    want = _tokens(plain, prompts)
    two = LLM(v4, speculative_config=SPEC, tensor_parallel_size=2, **KW)
    shut_down(two)
    assert [_tokens(two, prompts) for _ in range(2)] == [want, want]
    assert_drafts_accepted_and_rejected(two)


@pytest.mark.parametrize("hot_buffer_size", [8, 12])
def test_hisparse_hot_buffers_never_hold_a_rejected_drafts_entry(v4, hot_buffer_size):
    """HiSparse with a hot buffer of top-k (every selection swaps) and 1.5x top-k: a verified
    chunk's entries reach the host mirror only, and a rejected draft's entry is overwritten there
    before any decode row can select it; two passes (prefix hits) give plain decoding's tokens."""
    plain = LLM(v4, **KW)
    prompts = v4_prompts(plain.engine.runner.config.vocab_size)
    want = _tokens(plain, prompts)
    spec = LLM(v4, speculative_config=SPEC, enable_hisparse=True, hisparse_config={"hot_buffer_size": hot_buffer_size},
               **KW)
    assert [_tokens(spec, prompts) for _ in range(2)] == [want, want]
    assert_drafts_accepted_and_rejected(spec)
    assert spec.engine.runner.hot_buffers.stats.handoffs > 0, "requests should decode from hot buffers"
    assert spec.engine.runner.hot_buffers.num_active == 0


def test_drafts_longer_than_a_state_window_are_refused(v4):
    with pytest.raises(ValueError, match="at most 7"):
        LLM(v4, speculative_config=dict(SPEC, num_speculative_tokens=8), **KW)
    specs = LLM(v4, **KW).engine.kv.specs.values()
    widened = draft_space_specs(SpeculativeConfig.parse(dict(SPEC, num_speculative_tokens=7)), list(specs))
    assert [s.ring for s in widened if s.ring] == [15, 23]

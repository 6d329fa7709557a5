"""Speculative decoding with DeepSeek-V4's own MTP layer as the drafter (method "mtp").

Greedy outputs equal plain decoding's with chunked prefill, prefix hits, a sampled request in the
batch, preemption and the host tier; every space ends with all pages free or cached. The drafts
are the ones DeepSeek's MTP proposes (a reference from transformers' modules, tests/mtp_reference.py),
also after verify steps that accepted drafts. Random MTP weights rarely predict the model, so a
test forces accepted drafts by mixing in the model's own tokens. What is not supported is refused.
"""
from __future__ import annotations

import pytest

from hybridkv.entrypoints import LLM, SamplingParams
from hybridkv.model_executor.model_runner import model_skeleton
from host_tier_helpers import evict_device
from mtp_reference import ReferenceMTP
from speculative_helpers import V4_KW, v4_prompts
from tiny_deepseek_v4 import build_v4_checkpoint, single_thread

K = 3
SPEC = {"method": "mtp", "num_speculative_tokens": K}
KW = V4_KW


@pytest.fixture(autouse=True)
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def v4(tmp_path_factory) -> str:
    return build_v4_checkpoint(str(tmp_path_factory.mktemp("v4mtp")), mtp=True)


def _tokens(llm: LLM, prompts: list[dict], max_tokens: int = 40, sampled: bool = False) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True) for _ in prompts]
    if sampled:  # the last request samples: it decodes without drafts, in the same batches
        params[-1] = SamplingParams(temperature=1.0, seed=11, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.check_invariants()
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_tokens_equal_plain_decoding_with_chunks_prefix_hits_and_a_sampled_request(v4):
    plain, spec = LLM(v4, **KW), LLM(v4, speculative_config=SPEC, **KW)
    prompts = v4_prompts(plain.engine.runner.config.vocab_size)
    want = _tokens(plain, prompts, sampled=True)
    assert _tokens(spec, prompts, sampled=True) == want
    assert _tokens(spec, prompts, sampled=True) == want  # the second pass hits the first one's pages
    assert spec.engine.kv.prefix_hits > 0
    st = spec.engine.stats
    assert st["spec_drafts"] > 0 and st["spec_draft_tokens"] > st["spec_drafts"], "MTP drafts should be proposed"
    assert len(st["spec_accepted_per_position"]) == K


def test_drafts_are_the_reference_mtp_chain_also_after_accepted_drafts(v4, monkeypatch):
    """Every proposal's MTP drafts equal the reference's greedy drafts for the same tokens, for
    three requests drafting in one batched chain. The drafts verified are the model's own tokens
    for the first j positions (j = 0..K in turn), so steps accept 0..K drafts: the MTP state the
    draft extend keeps over accepted rows is checked by the next proposal."""
    plain = LLM(v4, **KW)
    prompts = v4_prompts(plain.engine.runner.config.vocab_size)
    want = _tokens(plain, prompts)
    spec = LLM(v4, speculative_config=SPEC, **KW)
    runner, scheduler = spec.engine.runner, spec.engine.scheduler
    propose, seen, batch_sizes = runner.propose_mtp, [], []

    def oracle_mix(request_ids, num_computed, last_tokens, num_drafts, plan):
        drafts = propose(request_ids, num_computed, last_tokens, num_drafts, plan)
        batch_sizes.append(len(drafts))
        requests = {r.request_id: r for r in scheduler.running}
        for rid, n in zip(request_ids, num_computed):
            if rid not in drafts:
                continue
            i = next(i for i, p in enumerate(prompts) if p["prompt_token_ids"] == requests[rid].prompt_token_ids)
            seen.append((i, n, list(drafts[rid])))
            j = len(seen) % (K + 1)
            future = want[i][n + 1 - len(prompts[i]["prompt_token_ids"]):]
            drafts[rid] = future[:j] + drafts[rid][j:]
        return drafts

    monkeypatch.setattr(runner, "propose_mtp", oracle_mix)
    assert _tokens(spec, prompts) == want
    assert spec.engine.stats["spec_accepted_tokens"] > 0
    assert max(batch_sizes) == len(prompts), "the requests should draft in one batch"
    reference = ReferenceMTP(v4)
    whole = 0  # proposals compared in full (the reference stops at a near-tie)
    for i, n, drafts in seen:
        sequence = prompts[i]["prompt_token_ids"] + want[i]
        expected = reference.drafts(sequence[: n + 1], len(drafts))
        assert drafts[: len(expected)] == expected, (i, n, drafts, expected)
        whole += len(expected) == len(drafts)
    assert whole >= 0.9 * len(seen)
    assert sum(len(d) for _, _, d in seen) > 2 * len(seen), "most proposals should chain drafts"


def test_preemption_and_host_tier_hits_keep_the_tokens(v4):
    """A budget that preempts, then every device page evicted to the host tier and loaded back on
    the second pass (the MTP keys travel in the swa pages)."""
    kw = dict(KW, max_model_len=128)
    plain = LLM(v4, **kw)
    prompts = v4_prompts(plain.engine.runner.config.vocab_size)
    want = _tokens(plain, prompts)
    specs = model_skeleton(v4, "float32", 128, "cpu", mtp=True).specs
    budget = int(4 * 32 * sum(s.bytes_per_slot for s in specs))  # 4 pages of each space: one request at a time
    spec = LLM(v4, speculative_config=SPEC, kv_cache_memory_bytes=budget, enable_hierarchical_cache=True, **kw)
    assert _tokens(spec, prompts) == want
    assert spec.engine.scheduler.num_preemptions > 0, "the budget should preempt"
    evict_device(spec)
    assert _tokens(spec, prompts) == want
    assert sum(spec.engine.kv.host_tier.stats.loaded_pages.values()) > 0, "pass 2 should load pages from the host"
    assert spec.engine.stats["spec_draft_tokens"] > 0


def test_the_mtp_layer_is_built_only_for_mtp_speculation(v4):
    """Without method "mtp" the mtp.* tensors are skipped (no module, no swa bytes); with it the
    swa space holds one more layer's keys."""
    plain, spec = LLM(v4, **KW), LLM(v4, speculative_config=SPEC, **KW)
    assert plain.engine.runner.model.mtp is None and spec.engine.runner.model.mtp is not None
    cfg = plain.engine.runner.model.cfg
    swa = {llm: llm.engine.kv.specs["swa"].bytes_per_slot for llm in (plain, spec)}
    assert swa[plain] == cfg.num_layers * cfg.head_dim * 4
    assert swa[spec] == (cfg.num_layers + 1) * cfg.head_dim * 4


def test_what_mtp_does_not_support_is_refused(v4, tmp_path, tiny_ckpt):
    without = build_v4_checkpoint(str(tmp_path / "no_mtp"))
    with pytest.raises(ValueError, match="ships no MTP weights"):
        LLM(without, speculative_config=SPEC, **KW)
    llama = tiny_ckpt("llama")
    with pytest.raises(ValueError, match="LlamaForCausalLM .* has none"):
        LLM(llama, speculative_config=SPEC, dtype="float32", max_model_len=128)
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        LLM(v4, speculative_config=SPEC, tensor_parallel_size=2, **KW)
    with pytest.raises(ValueError, match="apply to method 'ngram'"):
        LLM(v4, speculative_config=dict(SPEC, prompt_lookup_max=3), **KW)
    with pytest.raises(ValueError, match="at most 7"):
        LLM(v4, speculative_config=dict(SPEC, num_speculative_tokens=8), **KW)


def test_hisparse_with_mtp_drafts_keeps_the_tokens(v4):
    """HiSparse with a top-k-sized hot buffer: the MTP layer (sliding-window only) reads no C4
    entry, and verified chunks never enter the hot buffers; two passes equal plain decoding."""
    plain = LLM(v4, **KW)
    prompts = v4_prompts(plain.engine.runner.config.vocab_size)
    want = _tokens(plain, prompts, sampled=True)
    spec = LLM(v4, speculative_config=SPEC, enable_hisparse=True, hisparse_config={"hot_buffer_size": 8}, **KW)
    assert [_tokens(spec, prompts, sampled=True) for _ in range(2)] == [want, want]
    assert spec.engine.stats["spec_draft_tokens"] > 0
    assert spec.engine.runner.hot_buffers.stats.handoffs > 0 and spec.engine.runner.hot_buffers.num_active == 0

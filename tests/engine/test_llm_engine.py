"""Engine behaviour that must never change outputs: prefix caching, chunked prefill,
batching and preemption all give the same greedy tokens as a plain run."""
from __future__ import annotations

import pytest
import torch

from hybridkv.entrypoints import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompts(vocab: int, n: int, shared: int = 40, seed: int = 0) -> list[dict]:
    """n prompts sharing a `shared`-token prefix (so prefix caching has something to hit)."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, vocab, (shared,), generator=g).tolist()
    return [
        {"prompt_token_ids": prefix + torch.randint(3, vocab, (1 + (i * 7) % 23,), generator=g).tolist()}
        for i in range(n)
    ]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    """Greedy tokens from the simplest configuration: no caching, one request at a time."""
    path = tiny_ckpt("llama")
    llm = LLM(path, dtype="float32", enable_prefix_caching=False, max_num_seqs=1)
    prompts = _prompts(llm.engine.runner.config.vocab_size, 32)
    ref = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    llm.engine.kv.assert_idle()
    return path, prompts, ref


@pytest.mark.parametrize("chunk", [1, 7, 16, 64, None])
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("batch", [1, 32])
def test_greedy_equal_for_every_chunk_size_batch_and_cache_setting(reference, chunk, caching, batch):
    path, prompts, ref = reference
    llm = LLM(path, dtype="float32", enable_prefix_caching=caching, max_num_batched_tokens=chunk, max_num_seqs=batch)
    # Two passes: the second one hits whatever the first one cached.
    for _ in range(2):
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert _tokens(outs) == ref
    if caching:
        assert sum(o.num_cached_tokens for o in outs) >= 32 * 32, "the second pass should hit the shared prefix"
    else:
        assert all(o.num_cached_tokens == 0 for o in outs)


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_under_tiny_page_budget_keeps_outputs(reference, caching):
    path, prompts, ref = reference
    # 12 pages of 16 tokens (a page = 2 layers x K,V x 2 heads x 16 dims x 4 bytes x 16 tokens):
    # two or three sequences at a time, so decoding sequences must preempt each other.
    page_bytes = 2 * 2 * 2 * 16 * 4 * 16
    llm = LLM(path, dtype="float32", enable_prefix_caching=caching, max_model_len=128, kv_cache_memory_bytes=12 * page_bytes)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(outs) == ref
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(o.metrics["num_preemptions"] for o in outs) == llm.engine.scheduler.num_preemptions


def test_num_cached_tokens_counts_page_aligned_hits(reference):
    path, prompts, _ = reference
    llm = LLM(path, dtype="float32")
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    again = llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
    n = len(prompts[0]["prompt_token_ids"])
    assert again.num_cached_tokens == ((n - 1) // 16) * 16


def test_seeded_sampling_is_reproducible_and_batch_independent(reference):
    path, prompts, _ = reference
    llm = LLM(path, dtype="float32")
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate(prompts[:1], p, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(prompts[:5], [p] + [SamplingParams(temperature=1.0, max_tokens=10)] * 4, use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    llm2 = LLM(path, dtype="float32")
    assert llm2.generate(prompts[:1], p, use_tqdm=False)[0].outputs[0].token_ids == alone


def test_n_samples_share_prompt_and_differ(reference):
    path, prompts, _ = reference
    llm = LLM(path, dtype="float32")
    out = llm.generate(prompts[:1], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_logprobs_shape_and_cumulative(reference):
    path, prompts, _ = reference
    llm = LLM(path, dtype="float32")
    out = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2, ignore_eos=True), use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 5
    for tok, pos in zip(c.token_ids, c.logprobs):
        assert tok in pos and pos[tok].rank == 1  # greedy picks the top token
        assert 3 <= len(pos) <= 4
    assert abs(c.cumulative_logprob - sum(p[t].logprob for t, p in zip(c.token_ids, c.logprobs))) < 1e-4
    n = len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n
    for tok, pos in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert tok in pos


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda llm: llm.generate("", GREEDY), "empty"),
        (lambda llm: llm.generate({"prompt_token_ids": [5] * 600}, GREEDY), "max_model_len"),
        (lambda llm: llm.generate({"prompt_token_ids": [5] * 100}, SamplingParams(max_tokens=500)), "maximum context length"),
        (lambda llm: llm.generate("hi", SamplingParams(temperature=-1)), "temperature"),
        (lambda llm: llm.generate("hi", SamplingParams(top_p=0)), "top_p"),
        (lambda llm: llm.generate("hi", SamplingParams(top_p=1.5)), "top_p"),
        (lambda llm: llm.generate({"prompt_token_ids": [10**9]}, GREEDY), "token ids"),
    ],
)
def test_bad_input_raises_value_error_saying_what_to_fix(reference, make, match):
    path, _, _ = reference
    llm = LLM(path, dtype="float32", max_model_len=512)
    with pytest.raises(ValueError, match=match):
        make(llm)


def test_unknown_model_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_unknown_architecture_lists_supported(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["FooForCausalLM"]}))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        LLM(str(tmp_path))

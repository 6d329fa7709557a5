"""Helpers shared by the hybrid prefix-caching tests: force a prefix hit at a chosen page
boundary (with every windowed page outside the kept tails tombstoned) and compare against the
no-cache run."""
from __future__ import annotations

import torch

from hybridkv.entrypoints import LLM, SamplingParams

LOGPROB_ATOL = 1e-4


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)


def run_one(llm: LLM, prompt: list[int], max_tokens: int):
    return llm.generate({"prompt_token_ids": prompt}, greedy(max_tokens), use_tqdm=False)[0]


def sampled_logprobs(out) -> list[float]:
    c = out.outputs[0]
    return [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]


def tombstone_outside_tails(llm: LLM) -> int:
    """Drop every windowed page the index can drop without losing a likely hit (tier 0 of the
    windowed eviction): the pages far from any boundary. Returns pages dropped."""
    index = llm.engine.kv.index
    dropped = 0
    for space in index.windows:
        n = sum(1 for nd in index.nodes() if nd.shadows[space] is not None and nd.swa_lock_ref == 0 and not nd.tail_refs[space])
        if n:
            dropped += index.evict(space, n)
    index.check_invariants()
    return dropped


def assert_hit_at_every_boundary(cached: LLM, reference_out, prompt: list[int], max_tokens: int,
                                 seed_tail: int = 0) -> list[int]:
    """For each page boundary b < len(prompt): seed the cache with prompt[:b] + a different
    token, tombstone far windowed pages, then run the prompt: the hit is exactly b tokens and
    the greedy tokens and their logprobs equal the no-cache run. Returns the boundaries hit.

    seed_tail > 0: the seed runs on seed_tail tokens past the different one, in the same chunk,
    and nothing is tombstoned: the hit at b then reads windowed pages that were kept for the
    page's end, not for the sequence's (e.g. V4's state rings must hold each page's last rows)."""
    P = cached.engine.kv.page_size
    want_tokens = reference_out.outputs[0].token_ids
    want_lps = torch.tensor(sampled_logprobs(reference_out))
    hit = []
    dropped = 0
    for b in range(P, len(prompt), P):
        cached.engine.reset_prefix_cache()
        seed = prompt[:b] + [(prompt[b] + 1) % 50 + 3] + [(prompt[b] + 7 + i) % 50 + 3 for i in range(seed_tail)]
        run_one(cached, seed, 1)
        if not seed_tail:
            dropped += tombstone_outside_tails(cached)
        out = run_one(cached, prompt, max_tokens)
        assert out.num_cached_tokens == b, f"boundary {b}: hit {out.num_cached_tokens}"
        assert out.num_cached_tokens < len(prompt)
        assert out.metrics["cached_tokens_per_space"], "per-space cache report missing"
        assert out.outputs[0].token_ids == want_tokens, f"boundary {b}: tokens differ"
        torch.testing.assert_close(torch.tensor(sampled_logprobs(out)), want_lps, atol=LOGPROB_ATOL, rtol=0)
        cached.engine.kv.check_invariants()
        hit.append(b)
    assert dropped > 0 or seed_tail, "no windowed page was tombstoned: the hits did not cross tombstones"
    # The whole prompt cached: the hit still leaves the last token to compute.
    cached.engine.reset_prefix_cache()
    run_one(cached, prompt, 1)
    out = run_one(cached, prompt, max_tokens)
    assert 0 < out.num_cached_tokens < len(prompt) and out.num_cached_tokens == (len(prompt) - 1) // P * P
    assert out.outputs[0].token_ids == want_tokens
    return hit

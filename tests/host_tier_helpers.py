"""Helpers shared by the host-tier (HiCache L2) tests: evict every device page to the host, and
check that a prefix loaded back from the host at each page boundary gives the no-cache run's
outputs."""
from __future__ import annotations

import torch

from hybridkv.entrypoints import LLM
from prefix_hit_helpers import LOGPROB_ATOL, run_one, sampled_logprobs


def evict_device(llm: LLM) -> None:
    """Evict every unlocked page of every space from the device (demoting what the policy sends
    to the host), then run the copies that decided, as the engine does each step."""
    kv = llm.engine.kv
    for name, space in kv.spaces.items():
        kv.index.evict(name, space.num_pages)
    llm.engine.executor.flush_copies()
    kv.check_invariants()


def assert_host_hit_at_every_boundary(llm: LLM, reference_out, prompt: list[int], max_tokens: int,
                                      seed_runs: int = 1) -> list[int]:
    """For each page boundary b: seed the cache with prompt[:b] + another token (seed_runs times:
    the selective policy writes a node once it is hit twice), evict the device copies, then run
    the prompt: its whole b-token hit is loaded back from the host, and the output equals the
    no-cache run's."""
    P = llm.engine.kv.page_size
    want_tokens = reference_out.outputs[0].token_ids
    want_lps = torch.tensor(sampled_logprobs(reference_out))
    hit = []
    for b in range(P, len(prompt), P):
        llm.engine.reset_prefix_cache()
        seed = prompt[:b] + [(prompt[b] + 1) % 50 + 3]
        for _ in range(seed_runs):
            run_one(llm, seed, 1)
        evict_device(llm)
        index = llm.engine.kv.index
        assert all(nd.shadows[s] is None for nd in index.nodes() for s in index.whole), "a device page survived"
        out = run_one(llm, prompt, max_tokens)
        assert out.num_cached_tokens == b, f"boundary {b}: hit {out.num_cached_tokens}"
        assert out.metrics["prompt_tokens_from_host"] == b, f"boundary {b}: {out.metrics}"
        assert out.metrics["prompt_tokens_from_device"] == 0
        assert out.metrics["prompt_tokens_computed"] == len(prompt) - b
        assert out.outputs[0].token_ids == want_tokens, f"boundary {b}: tokens differ after a host load-back"
        torch.testing.assert_close(torch.tensor(sampled_logprobs(out)), want_lps, atol=LOGPROB_ATOL, rtol=0)
        llm.engine.kv.check_invariants()
        hit.append(b)
    return hit

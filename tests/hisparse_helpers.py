"""Helpers shared by the HiSparse end-to-end tests: random prompts, greedy generation with
logprobs, and the check that two runs gave the same tokens and logprobs."""
from __future__ import annotations

import torch

from hybridkv.entrypoints import LLM, SamplingParams
from prefix_hit_helpers import LOGPROB_ATOL, sampled_logprobs


def random_prompts(lengths, seed=0, vocab=200) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def generate_greedy(llm: LLM, prompts, max_tokens: int):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def assert_same_outputs(got, want, what: str = "HiSparse changed the greedy tokens") -> None:
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids, what
        torch.testing.assert_close(torch.tensor(sampled_logprobs(g)), torch.tensor(sampled_logprobs(w)),
                                   atol=LOGPROB_ATOL, rtol=0)

"""Helpers shared by the speculative decoding tests: DeepSeek-V4's engine settings and copy-friendly
prompts, greedy tokens with the block-space invariants checked, and the check that drafts were
both accepted and rejected (so a test exercises the rollback, not only the happy path)."""
from __future__ import annotations

import torch

from hybridkv.entrypoints import LLM, SamplingParams

# Tiny DeepSeek-V4 (ratios 4 and 16): 32-token pages, 48-token chunks, one step a call
V4_KW = dict(dtype="float32", block_size=32, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=48,
             num_scheduler_steps=1)


def v4_prompts(vocab: int) -> list[dict]:
    """A repeated pattern (drafts found and mostly accepted), a random prompt and a mix."""
    g = torch.Generator().manual_seed(3)
    pattern = torch.randint(3, vocab, (7,), generator=g).tolist()
    return [{"prompt_token_ids": pattern * 6}, {"prompt_token_ids": torch.randint(3, vocab, (50,), generator=g).tolist()},
            {"prompt_token_ids": pattern * 3 + torch.randint(3, vocab, (9,), generator=g).tolist()}]


def greedy_tokens(llm: LLM, prompts: list[dict], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens; every block space is checked afterwards."""
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    llm.engine.check_invariants()
    return [o.outputs[0].token_ids for o in outs]


def assert_drafts_accepted_and_rejected(llm: LLM) -> None:
    st = llm.engine.stats
    assert 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"], "drafts should be accepted and rejected"

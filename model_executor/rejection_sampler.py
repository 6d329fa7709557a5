"""Speculative sampling of n-gram drafts for requests that sample at temperature > 0.

Speculative sampling (vLLM's rejection sampler) verifies drafts d_1..d_k, drawn from a draft
distribution q_i, against the target distributions p_i of the verify rows: d_i is accepted with
probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the replacement is drawn from
max(p_i - q_i, 0) renormalised and the rest are dropped; when all k are accepted a bonus token is
drawn from p_{k+1}. Every kept token then has the law plain sampling gives it. An n-gram draft is
certain, q_i is a point mass at d_i: d_i is accepted with probability p_i(d_i), and the
replacement is drawn from p_i with d_i removed, renormalised.

Here each row's token t_i is drawn from p_i exactly as the Sampler draws a token (one uniform
from the request's generator, the same inverse-CDF draw), d_i is accepted when t_i == d_i, and
the first t_i that differs, or t_{k+1}, is the token that follows the accepted drafts. That is the
same sampler: P(t_i = d_i) = p_i(d_i), and a t_i that differs from d_i is distributed as p_i
conditioned on not being d_i, which is max(p_i - q_i, 0) renormalised. Drawing it this way, not as
an acceptance uniform plus a residual draw, means that

- a step draws one uniform per token it keeps, the uniform plain decoding draws for that position:
  a seeded request gets the same tokens with speculation on and off wherever the verify rows'
  logits equal the decode rows' (the engine's batch invariance: verify rows run as one-token
  decodes, batch.verify_rows), and it stays reproducible run to run;
- acceptance reads "the model's token after row i equals draft i", as for greedy drafts, so the
  verifier books both kinds alike from the tokens alone (engine/speculative/verifier.py);
- no draw is made from a residual that float rounding left empty.

p_i is the Sampler's own distribution for the row (process_logits, then temperature, min_p, top_k
and top_p: sampler.random_row_probs), computed with the first i - 1 drafts as generated tokens. The
proposer drafts only rows that distribution fully describes (sampler.drafts_verifiable).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.model_executor.sampler import SamplingBatch, _inverse_cdf, process_logits, random_row_probs
from hybridkv.model_executor.sampling_params import SamplingParams


@dataclass
class DraftedSequence:
    """One sampled request's verify chunk (its last known token, then k drafts: k + 1 rows):
    what the distributions of its rows depend on besides their logits."""

    params: SamplingParams
    generator: torch.Generator | None  # the request's own (seeded); None: the runner's default one
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated before this step (its last token is row 0's input)
    drafts: list[int]  # k drafts: row i + 1's input token, and the candidate for row i's output


def target_probs(logits: torch.Tensor, seqs: list[DraftedSequence]) -> torch.Tensor:
    """[sum(k + 1), V] float32: each verify row's sampling distribution, rows of seqs in order.
    Row i of a sequence is the position after its first i drafts, so the Sampler's processing
    sees them as generated tokens there."""
    params, prompts, outputs = [], [], []
    for s in seqs:
        for i in range(len(s.drafts) + 1):
            params.append(s.params)
            prompts.append(s.prompt_token_ids)
            outputs.append(s.output_token_ids + s.drafts[:i])
    batch = SamplingBatch(params=params, generators=[None] * len(params), prompt_token_ids=prompts,
                          output_token_ids=outputs)
    return random_row_probs(process_logits(logits, batch), params)


def sample_after_drafts(probs: torch.Tensor, drafts: list[int], generator: torch.Generator) -> list[int]:
    """The tokens one verify chunk yields: probs [k + 1, V] (row i: the distribution after i drafts),
    drafts k tokens. Returns the accepted drafts, then the replacement of the first rejected one or
    the bonus token after all k: a + 1 tokens for a accepted. Draws one uniform per token
    returned, from `generator`, as Sampler does for one row (float64, U[0, 1))."""
    if probs.shape[0] != len(drafts) + 1:
        raise ValueError(f"sample_after_drafts: {len(drafts)} drafts need {len(drafts) + 1} rows, got {probs.shape[0]}")
    tokens: list[int] = []
    for i in range(len(drafts) + 1):
        u = torch.empty(1, dtype=torch.float64, device=probs.device).uniform_(generator=generator)
        tok = int(_inverse_cdf(probs[i : i + 1], u)[0])
        tokens.append(tok)
        if i == len(drafts) or tok != drafts[i]:
            break
    return tokens


def sample_drafted(logits: torch.Tensor, seqs: list[DraftedSequence],
                   default_generator: torch.Generator) -> list[list[int]]:
    """Per sequence, the tokens its verify rows yield (sample_after_drafts): logits [sum(k + 1), V],
    the sequences' rows in order, on the host. Unseeded sequences draw from default_generator."""
    probs = target_probs(logits, seqs)
    out, first = [], 0
    for s in seqs:
        n = len(s.drafts) + 1
        gen = s.generator if s.generator is not None else default_generator
        out.append(sample_after_drafts(probs[first : first + n], s.drafts, gen))
        first += n
    return out

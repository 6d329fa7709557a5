"""Speculative sampling of point-mass (n-gram) drafts (model_executor/rejection_sampler.py): the
tokens a verify chunk yields have the target law, checked with Pearson's chi-square over many
draws from fixed distributions; the same statistic rejects biased samplers; a seeded draw
consumes the uniforms plain sampling would and yields its tokens."""
from __future__ import annotations

from collections import Counter

import torch

from chi_square import chi_square, critical_value
from hybridkv.model_executor.rejection_sampler import (
    DraftedSequence, sample_after_drafts, sample_drafted, target_probs,
)
from hybridkv.model_executor.sampler import Sampler, SamplingBatch, _inverse_cdf, drafts_verifiable
from hybridkv.model_executor.sampling_params import SamplingParams
from hybridkv.model_executor.structured_outputs import StructuredOutputsParams

# Three rows over a 6-token vocabulary: the distributions after 0, 1 and 2 drafts. Draft 0 is
# likely (0.45), draft 1 less so (0.3); token 5 is impossible in rows 0 and 1.
PROBS = torch.tensor([[0.10, 0.45, 0.20, 0.15, 0.10, 0.00],
                      [0.30, 0.10, 0.25, 0.05, 0.30, 0.00],
                      [0.20, 0.20, 0.20, 0.20, 0.10, 0.10]])
DRAFTS = [1, 4]
DRAWS = 12_000


def _path_law(probs: torch.Tensor, drafts: list[int]) -> dict[tuple[int, ...], float]:
    """The law of what a verify chunk yields: accepted drafts then one token. A path ending at row
    i has probability prod_{j<i} p_j(d_j) * p_i(t) (t != d_i unless i is the bonus row)."""
    law: dict[tuple[int, ...], float] = {}
    prefix_p = 1.0
    for i in range(len(drafts) + 1):
        for t in range(probs.shape[1]):
            p = prefix_p * float(probs[i, t])
            if p > 0 and (i == len(drafts) or t != drafts[i]):
                law[tuple(drafts[:i]) + (t,)] = p
        if i < len(drafts):
            prefix_p *= float(probs[i, drafts[i]])
    return law


def _draw(sampler, n: int = DRAWS, seed: int = 0) -> Counter:
    g = torch.Generator().manual_seed(seed)
    return Counter(tuple(sampler(PROBS, DRAFTS, g)) for _ in range(n))


def _always_accept(probs, drafts, g):
    """Biased: takes every draft, then a bonus token from the last row."""
    u = torch.empty(1, dtype=torch.float64).uniform_(generator=g)
    return drafts + [int(_inverse_cdf(probs[-1:], u)[0])]


def _resample_from_p(probs, drafts, g):
    """Biased: accepts with probability p(d) but draws the replacement from p itself (the draft
    included) instead of max(p - q, 0): the draft's token comes out too often."""
    tokens = []
    for i in range(len(drafts) + 1):
        u = torch.empty(2, dtype=torch.float64).uniform_(generator=g)
        if i < len(drafts) and float(u[0]) < float(probs[i, drafts[i]]):
            tokens.append(drafts[i])
            continue
        tokens.append(int(_inverse_cdf(probs[i : i + 1], u[1:])[0]))
        break
    return tokens


def test_chi_square_critical_values_match_the_tables():
    # chi-square upper quantiles (any statistics table): alpha 0.05 and 1e-4
    assert abs(critical_value(1, 0.05) - 3.841) < 1e-3 and abs(critical_value(10, 0.05) - 18.307) < 1e-3
    assert abs(critical_value(5) - 25.745) < 1e-2 and abs(critical_value(20) - 52.386) < 1e-2


def test_yielded_tokens_follow_the_target_law():
    """Every path (accepted drafts, then the replacement or the bonus token) has its exact
    probability (4 + 4 + 6 cells, 13 degrees of freedom: critical value 40.87 at alpha 1e-4); the
    first token alone has law p_0; a rejected draft's replacement has law max(p_0 - q_0, 0)
    renormalised, q_0 the point mass at the draft."""
    counts = _draw(sample_after_drafts)
    law = _path_law(PROBS, DRAFTS)
    stat, df = chi_square(counts, law)
    assert df == 13 and stat < critical_value(df), (stat, df, counts)
    first = Counter({(t,): n for t, n in Counter(path[0] for path in counts.elements()).items()})
    p0 = {(t,): float(p) for t, p in enumerate(PROBS[0]) if p > 0}
    stat, df = chi_square(first, p0)
    assert stat < critical_value(df), (stat, first)
    residual = (PROBS[0] - torch.nn.functional.one_hot(torch.tensor(DRAFTS[0]), 6)).clamp(min=0)
    residual /= residual.sum()
    replaced = Counter({(path[0],): n for path, n in counts.items() if path[0] != DRAFTS[0]})
    stat, df = chi_square(replaced, {(t,): float(p) for t, p in enumerate(residual) if p > 0})
    assert stat < critical_value(df), (stat, replaced)
    # accepted draft 0 about 0.45 of the time, both drafts about 0.135
    accepted = sum(n for path, n in counts.items() if path[0] == DRAFTS[0]) / DRAWS
    both = sum(n for path, n in counts.items() if len(path) == 3) / DRAWS
    assert abs(accepted - 0.45) < 0.02 and abs(both - 0.135) < 0.015, (accepted, both)


def test_biased_samplers_fail_the_same_statistic():
    """The statistic can fail: always accepting puts all mass on the full-draft paths, and
    resampling a rejection from p itself gives the first draft 0.45 + 0.55 * 0.45 = 0.70 of the
    first tokens instead of 0.45; with 12,000 draws either statistic is in the thousands."""
    law = _path_law(PROBS, DRAFTS)
    p0 = {(t,): float(p) for t, p in enumerate(PROBS[0]) if p > 0}
    for biased in (_always_accept, _resample_from_p):
        counts = _draw(biased)
        first = Counter({(t,): n for t, n in Counter(path[0] for path in counts.elements()).items()})
        stat, df = chi_square(first, p0)
        assert stat > 10 * critical_value(df), (biased.__name__, stat)
    # the path statistic rejects always-accepting outright (no path stops at a draft)
    stat, df = chi_square(_draw(_always_accept), law)
    assert stat > 10 * critical_value(df)


def test_certain_drafts_are_always_taken_and_impossible_ones_never():
    probs = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5], [0.25, 0.25, 0.25, 0.25]])
    g = torch.Generator().manual_seed(1)
    for _ in range(500):
        tokens = sample_after_drafts(probs, [1, 0], g)  # draft 1 certain, draft 0 impossible in row 1
        assert tokens[0] == 1 and len(tokens) == 2 and tokens[1] in (2, 3)


def test_a_seeded_draw_takes_the_uniforms_and_tokens_of_plain_sampling():
    """Row i's token is the one the Sampler draws for that row with the generator in the same
    state, and the generator advances by one draw per returned token: a seeded request yields
    the tokens of plain decoding, with speculation on or off."""
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(5)) * 3
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=12)
    probs = target_probs(logits, [DraftedSequence(params, None, [1, 2], [3], [0, 0])])
    lengths = Counter()
    for seed in range(60):
        ref_gen = torch.Generator().manual_seed(seed)
        plain = [Sampler(torch.Generator())(logits[i : i + 1], SamplingBatch([params], [ref_gen], [[1, 2]], [[3]]))
                 .token_ids[0] for i in range(3)]
        drafts = [plain[0], plain[1]] if seed % 3 else [plain[0], (plain[1] + 1) % 40]
        g = torch.Generator().manual_seed(seed)
        tokens = sample_after_drafts(probs, drafts, g)
        assert tokens == plain[: len(tokens)], (seed, tokens, plain)
        after = torch.Generator().manual_seed(seed)
        for _ in tokens:
            torch.empty(1, dtype=torch.float64).uniform_(generator=after)
        assert torch.equal(g.get_state(), after.get_state())
        lengths[len(tokens)] += 1
    assert set(lengths) == {2, 3}  # the rejecting and the all-accepted chunks both ran


def test_target_rows_see_the_earlier_drafts_as_generated_tokens():
    """Row i is the Sampler's distribution after the first i drafts: temperature, top_k, and what
    reads the generated tokens (a presence penalty here, which the proposer does not draft, but
    the rows are right for it) counts the drafts before the row."""
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=0.5, top_k=6, presence_penalty=1.5)
    drafts = [int(logits[1].argmax()), int(logits[2].argmax())]
    got = target_probs(logits, [DraftedSequence(params, None, [9], [7], drafts)])
    for i in range(3):
        oracle = logits[i].double().clone()
        for t in set([7] + drafts[:i]):
            oracle[t] -= 1.5
        oracle /= 0.5
        oracle[oracle < oracle.topk(6).values[-1]] = float("-inf")
        assert torch.allclose(got[i].double(), oracle.softmax(-1), atol=1e-6), i


def test_sample_drafted_splits_rows_per_sequence_and_uses_each_generator():
    logits = torch.randn(5, 20, generator=torch.Generator().manual_seed(4))
    params = SamplingParams(temperature=0.8)
    seqs = [DraftedSequence(params, torch.Generator().manual_seed(11), [1], [2], [5, 6]),
            DraftedSequence(params, None, [1], [2], [7])]
    first = sample_drafted(logits, seqs, torch.Generator().manual_seed(0))
    seqs[0].generator.manual_seed(11)
    again = sample_drafted(logits, seqs, torch.Generator().manual_seed(0))
    assert first == again and 1 <= len(first[0]) <= 3 and 1 <= len(first[1]) <= 2
    probs = target_probs(logits, seqs)
    assert sample_after_drafts(probs[:3], [5, 6], torch.Generator().manual_seed(11)) == first[0]


def test_which_requests_are_drafted():
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=3)
    assert drafts_verifiable(sampled, 0) and drafts_verifiable(SamplingParams(temperature=0), 0)
    not_drafted = [
        SamplingParams(temperature=0.8, presence_penalty=0.5),
        SamplingParams(temperature=0.8, frequency_penalty=0.5),
        SamplingParams(temperature=0.8, repetition_penalty=1.1),
        SamplingParams(temperature=0.8, logprobs=2),
        SamplingParams(temperature=0.8, prompt_logprobs=1),
        SamplingParams(temperature=0.8, structured_outputs=StructuredOutputsParams(regex="a+")),
    ]
    for p in not_drafted:
        assert not drafts_verifiable(p, 5), p
    min_tokens = SamplingParams(temperature=0.8, min_tokens=4, stop_token_ids=[2])
    assert not drafts_verifiable(min_tokens, 3) and drafts_verifiable(min_tokens, 4)

"""Sampler invariants: greedy/argmax, seeded reproducibility, filter exclusion, empirical
frequencies, penalty formulas, min_tokens, and raw-distribution logprobs with ranks."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hybridkv.model_executor.sampler as sampler_mod
from hybridkv.engine.sampling_params import SamplingParams
from hybridkv.model_executor.sampler import (
    Sampler,
    SamplingBatch,
    compute_prompt_logprobs,
    process_logits,
)

VOCAB = 32

# Hand-built distribution over 7 tokens, distinct probabilities so no filter hits a tie.
HAND_PROBS = [0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.02]
HAND_LOGITS = torch.tensor(HAND_PROBS).log()


def make_batch(
    params: list[SamplingParams],
    generators: list[torch.Generator | None] | None = None,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch(
        params=params,
        generators=generators if generators is not None else [None] * n,
        prompt_token_ids=prompts if prompts is not None else [[] for _ in range(n)],
        output_token_ids=outputs if outputs is not None else [[] for _ in range(n)],
    )


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def new_sampler(seed: int = 1234) -> Sampler:
    return Sampler(seeded(seed))


def draw_many(params: SamplingParams, logits: torch.Tensor, num_draws: int, seed: int = 0) -> list[int]:
    """num_draws independent samples from one distribution, as one batch of identical rows."""
    batch = make_batch([params] * num_draws)
    return new_sampler(seed)(logits.expand(num_draws, -1), batch).token_ids


def chi_square(counts: Counter, expected_probs: dict[int, float], num_draws: int) -> float:
    return sum((counts.get(t, 0) - num_draws * p) ** 2 / (num_draws * p) for t, p in expected_probs.items())


# Upper 0.9999 quantiles of chi-square for df = 1..6; the draws use fixed seeds, so this is a
# loose bound that still catches any real bias (a wrong distribution gives values in the 100s).
CHI2_LIMIT = {1: 15.2, 2: 18.5, 3: 21.1, 4: 23.5, 5: 25.7, 6: 27.9}


def describe(value) -> str:
    """Short pytest ids: only the SamplingParams fields that differ from the defaults."""
    if isinstance(value, SamplingParams):
        default = SamplingParams()
        changed = [f"{name}={getattr(value, name)}" for name in ("temperature", "top_k", "top_p", "min_p", "seed")
                   if getattr(value, name) != getattr(default, name)]
        return ",".join(changed) or "defaults"
    if isinstance(value, set):
        return "keep" + "".join(map(str, sorted(value)))
    return repr(value)


# --------------------------------------------------------------------------------------------
# Greedy
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_equals_argmax(dtype):
    logits = torch.randn(6, VOCAB, generator=seeded(0)).to(dtype)
    batch = make_batch([SamplingParams(temperature=0.0)] * 6)
    out = new_sampler()(logits, batch)
    assert out.token_ids == logits.float().argmax(-1).tolist()


def test_greedy_rows_in_a_mixed_batch_equal_argmax():
    logits = torch.randn(4, VOCAB, generator=seeded(1))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=5),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=3)]
    gens = [None, None, None, seeded(3)]
    out = new_sampler()(logits, make_batch(params, gens))
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.token_ids[2] == int(logits[2].argmax())


def test_sampler_never_modifies_the_input_logits():
    logits = torch.randn(3, VOCAB, generator=seeded(2))
    before = logits.clone()
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5, min_tokens=2),
              SamplingParams(top_p=0.5, frequency_penalty=1.0),
              SamplingParams(min_p=0.2)]
    for p in params:
        p.all_stop_token_ids = {0, 1}
    new_sampler()(logits, make_batch(params, outputs=[[2], [3, 3], [4]]))
    assert torch.equal(logits, before)


# --------------------------------------------------------------------------------------------
# Seeded sampling
# --------------------------------------------------------------------------------------------


def _decode_seeded(seed: int, steps: int, logits_per_step: list[torch.Tensor], *, neighbours: int, row: int) -> list[int]:
    """Sample `steps` tokens for one seeded request placed at `row` among `neighbours` others."""
    target = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=seed)
    target_gen = seeded(seed)
    other_gens = [seeded(1000 + j) if j % 2 else None for j in range(neighbours)]
    sampler = new_sampler(seed=999 + neighbours)  # default generator differs between runs
    tokens: list[int] = []
    for step in range(steps):
        params = [SamplingParams(temperature=1.0, seed=1000 + j if j % 2 else None) for j in range(neighbours)]
        gens = list(other_gens)
        params.insert(row, target)
        gens.insert(row, target_gen)
        # Neighbours see different logits; the target row sees its own fixed ones.
        logits = torch.randn(neighbours + 1, VOCAB, generator=seeded(step + 77 * neighbours))
        logits[row] = logits_per_step[step]
        out = sampler(logits, make_batch(params, gens))
        tokens.append(out.token_ids[row])
    return tokens


def test_seeded_sampling_is_reproducible_across_runs():
    steps = 30
    logits = [torch.randn(VOCAB, generator=seeded(s)) for s in range(steps)]
    first = _decode_seeded(42, steps, logits, neighbours=0, row=0)
    second = _decode_seeded(42, steps, logits, neighbours=0, row=0)
    assert first == second
    # ...and the seed matters: another seed gives another sequence.
    assert _decode_seeded(43, steps, logits, neighbours=0, row=0) != first


@pytest.mark.parametrize(("neighbours", "row"), [(1, 0), (3, 2), (7, 5), (7, 7)])
def test_seeded_sampling_is_independent_of_batch_composition(neighbours, row):
    steps = 30
    logits = [torch.randn(VOCAB, generator=seeded(s)) for s in range(steps)]
    alone = _decode_seeded(7, steps, logits, neighbours=0, row=0)
    among_others = _decode_seeded(7, steps, logits, neighbours=neighbours, row=row)
    assert alone == among_others


def test_greedy_neighbours_do_not_shift_seeded_rows():
    logits = torch.randn(VOCAB, generator=seeded(5))
    p = SamplingParams(temperature=1.0, seed=11)
    alone = new_sampler()(logits.unsqueeze(0), make_batch([p], [seeded(11)])).token_ids[0]
    mixed_logits = torch.stack([torch.randn(VOCAB), logits, torch.randn(VOCAB)])
    mixed = make_batch([SamplingParams(temperature=0.0), p, SamplingParams(temperature=0.0)],
                       [None, seeded(11), None])
    assert new_sampler(seed=3)(mixed_logits, mixed).token_ids[1] == alone


# --------------------------------------------------------------------------------------------
# Filters: excluded tokens never appear, allowed ones all do, frequencies match
# --------------------------------------------------------------------------------------------

FILTER_CASES = [
    # (params, allowed token set) on HAND_PROBS = .40 .25 .15 .10 .05 .03 .02
    (SamplingParams(top_k=3), {0, 1, 2}),
    (SamplingParams(top_k=1), {0}),
    # cumulative .40 .65 .80: mass before token 2 is .65 < .75 (kept), before token 3 is .80.
    (SamplingParams(top_p=0.75), {0, 1, 2}),
    (SamplingParams(top_p=0.3), {0}),  # the top token is always kept
    # min_p 0.2 -> threshold 0.08: keeps .10 and above.
    (SamplingParams(min_p=0.2), {0, 1, 2, 3}),
    (SamplingParams(min_p=0.7), {0}),
    # top_p applies to what top_k left: top-4 renormalised is .444 .278 .167 .111, so the mass
    # before token 2 is .722 >= .7 and it is dropped (on the raw distribution it would be kept).
    (SamplingParams(top_k=4, top_p=0.7), {0, 1}),
    # min_p then top_k then top_p.
    (SamplingParams(min_p=0.1, top_k=5, top_p=0.9), {0, 1, 2, 3}),
]


@pytest.mark.parametrize(("params", "allowed"), FILTER_CASES, ids=describe)
def test_filters_never_emit_excluded_tokens_and_every_allowed_token_shows_up(params, allowed):
    draws = draw_many(params, HAND_LOGITS, num_draws=4000)
    seen = set(draws)
    assert seen <= allowed, f"excluded tokens sampled: {seen - allowed}"
    assert seen == allowed, f"allowed tokens never sampled: {allowed - seen}"


def test_filters_hold_per_row_in_a_batch_with_mixed_settings():
    """Rows with different filters share one call; each row obeys only its own filter."""
    cases = FILTER_CASES + [(SamplingParams(), set(range(len(HAND_PROBS))))]
    reps = 300
    params = [p for p, _ in cases for _ in range(reps)]
    out = new_sampler(5)(HAND_LOGITS.expand(len(params), -1), make_batch(params))
    for c, (_, allowed) in enumerate(cases):
        seen = set(out.token_ids[c * reps:(c + 1) * reps])
        assert seen <= allowed
        assert seen == allowed


def _renormalised(probs: list[float], keep: set[int], temperature: float = 1.0) -> dict[int, float]:
    scaled = {t: probs[t] ** (1.0 / temperature) for t in keep}
    total = sum(scaled.values())
    return {t: v / total for t, v in scaled.items()}


@pytest.mark.parametrize(
    ("params", "keep", "temperature"),
    [
        (SamplingParams(), set(range(7)), 1.0),
        (SamplingParams(top_k=3), {0, 1, 2}, 1.0),
        (SamplingParams(top_p=0.75), {0, 1, 2}, 1.0),
        (SamplingParams(min_p=0.2), {0, 1, 2, 3}, 1.0),
        (SamplingParams(temperature=2.0), set(range(7)), 2.0),
        (SamplingParams(temperature=0.5, top_k=4), {0, 1, 2, 3}, 0.5),
    ],
    ids=describe,
)
def test_empirical_frequencies_match_the_renormalised_distribution(params, keep, temperature):
    num_draws = 20000
    counts = Counter(draw_many(params, HAND_LOGITS, num_draws, seed=17))
    expected = _renormalised(HAND_PROBS, keep, temperature)
    assert set(counts) <= keep
    assert chi_square(counts, expected, num_draws) < CHI2_LIMIT[len(keep) - 1]


def test_seeded_rows_follow_the_distribution_too():
    """Per-row generators draw from the same distribution as the shared default generator."""
    num_draws = 6000
    params = [SamplingParams(seed=s) for s in range(num_draws)]
    gens = [seeded(s) for s in range(num_draws)]
    out = new_sampler()(HAND_LOGITS.expand(num_draws, -1), make_batch(params, gens))
    expected = _renormalised(HAND_PROBS, set(range(7)))
    assert chi_square(Counter(out.token_ids), expected, num_draws) < CHI2_LIMIT[6]


# --------------------------------------------------------------------------------------------
# Penalties and min_tokens
# --------------------------------------------------------------------------------------------


def test_repetition_penalty_matches_the_formula_on_prompt_and_output_tokens():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 4.0, 0.0]])
    p = SamplingParams(repetition_penalty=2.0)
    # token 0 (>0) in prompt, 1 (<0) in prompt, 3 (<0) in output, 5 (=0) in output; 2, 4 unseen.
    batch = make_batch([p], prompts=[[0, 1, 1]], outputs=[[3, 5]])
    got = process_logits(logits, batch)
    expected = torch.tensor([[2.0 / 2, -1.0 * 2, 0.5, -3.0 * 2, 4.0, 0.0 * 2]])
    assert torch.equal(got, expected)


def test_frequency_and_presence_penalties_match_the_formula_on_output_tokens_only():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0]])
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    # prompt token 4 must not be penalised; output counts: 0 -> 3, 1 -> 1, 2 -> 0, 3 -> 2.
    batch = make_batch([p], prompts=[[4, 4]], outputs=[[0, 0, 3, 1, 0, 3]])
    got = process_logits(logits, batch)
    expected = torch.tensor([[
        1.0 - 0.5 * 3 - 0.25,
        1.0 - 0.5 * 1 - 0.25,
        1.0,
        1.0 - 0.5 * 2 - 0.25,
        1.0,
    ]])
    assert torch.allclose(got, expected, atol=0, rtol=1e-6)


def test_all_three_penalties_combine_per_row_with_row_specific_values():
    logits = torch.tensor([[3.0, -2.0, 1.0, 0.5], [3.0, -2.0, 1.0, 0.5], [3.0, -2.0, 1.0, 0.5]])
    params = [
        SamplingParams(repetition_penalty=1.5, frequency_penalty=0.2, presence_penalty=0.1),
        SamplingParams(),  # untouched
        SamplingParams(repetition_penalty=0.5, frequency_penalty=-0.4),
    ]
    prompts = [[2], [0, 1], [3]]
    outputs = [[0, 0, 1], [0], [1, 1]]
    got = process_logits(logits, make_batch(params, prompts=prompts, outputs=outputs))
    expected = torch.tensor([
        [3.0 / 1.5 - 0.2 * 2 - 0.1, -2.0 * 1.5 - 0.2 * 1 - 0.1, 1.0 / 1.5, 0.5],
        [3.0, -2.0, 1.0, 0.5],
        [3.0, -2.0 * 0.5 + 0.4 * 2, 1.0, 0.5 / 0.5],
    ])
    assert torch.allclose(got, expected, atol=1e-6, rtol=0)


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    num_rows=st.integers(1, 4),
    vocab=st.integers(2, 12),
)
def test_penalties_match_a_reference_implementation(data, num_rows, vocab):
    token = st.integers(0, vocab - 1)
    prompts = [data.draw(st.lists(token, max_size=8)) for _ in range(num_rows)]
    outputs = [data.draw(st.lists(token, max_size=8)) for _ in range(num_rows)]
    params = [
        SamplingParams(
            repetition_penalty=data.draw(st.sampled_from([1.0, 0.5, 1.3, 2.0])),
            frequency_penalty=data.draw(st.sampled_from([0.0, -1.0, 0.5, 2.0])),
            presence_penalty=data.draw(st.sampled_from([0.0, -0.5, 1.0])),
        )
        for _ in range(num_rows)
    ]
    logits = torch.randn(num_rows, vocab, generator=seeded(num_rows * 100 + vocab))
    got = process_logits(logits, make_batch(params, prompts=prompts, outputs=outputs))

    expected = logits.clone()
    for r, p in enumerate(params):
        counts = Counter(outputs[r])
        for t in range(vocab):
            x = expected[r, t].item()
            if t in counts or t in prompts[r]:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            x -= p.frequency_penalty * counts.get(t, 0)
            x -= p.presence_penalty * (1 if counts.get(t, 0) > 0 else 0)
            expected[r, t] = x
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)


def test_greedy_with_penalties_picks_the_argmax_of_the_penalised_logits():
    logits = torch.tensor([[5.0, 4.0, 1.0]])
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    out = new_sampler()(logits, make_batch([p], outputs=[[0]]))
    assert out.token_ids == [1]  # 5/2 = 2.5 < 4


def test_min_tokens_masks_all_stop_ids_until_reached():
    eos, stop = 3, 5
    logits = torch.zeros(1, VOCAB)
    logits[0, eos] = 50.0
    logits[0, stop] = 49.0
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop])
    p.all_stop_token_ids = {eos, stop}  # the engine adds EOS
    sampler = new_sampler()

    masked = process_logits(logits, make_batch([p], outputs=[[1, 2]]))
    assert masked[0, eos] == float("-inf") and masked[0, stop] == float("-inf")
    assert torch.isfinite(masked[0, [t for t in range(VOCAB) if t not in (eos, stop)]]).all()
    assert sampler(logits, make_batch([p], outputs=[[1, 2]])).token_ids != [eos]
    assert sampler(logits, make_batch([p], outputs=[[1, 2]])).token_ids != [stop]
    # Once min_tokens tokens exist, stop ids are allowed again.
    assert sampler(logits, make_batch([p], outputs=[[1, 2, 4]])).token_ids == [eos]


def test_min_tokens_masks_stop_ids_for_random_rows_over_many_draws():
    eos = 0  # HAND_LOGITS' most likely token
    p = SamplingParams(min_tokens=1)
    p.all_stop_token_ids = {eos, 1}
    num = 2000
    out = new_sampler()(HAND_LOGITS.expand(num, -1), make_batch([p] * num))
    assert not {0, 1} & set(out.token_ids)
    assert set(out.token_ids) == {2, 3, 4, 5, 6}


def test_min_tokens_only_affects_rows_that_need_it():
    logits = torch.zeros(2, VOCAB)
    logits[:, 7] = 10.0
    short = SamplingParams(temperature=0.0, min_tokens=2)
    done = SamplingParams(temperature=0.0, min_tokens=2)
    short.all_stop_token_ids = {7}
    done.all_stop_token_ids = {7}
    out = new_sampler()(logits, make_batch([short, done], outputs=[[1], [1, 2]]))
    assert out.token_ids[0] != 7 and out.token_ids[1] == 7


# --------------------------------------------------------------------------------------------
# Logprobs
# --------------------------------------------------------------------------------------------


def _check_entries(entries, logprobs_row: torch.Tensor, k: int, sampled: int) -> None:
    """entries = top-k by logprob, then the sampled token if missing; values and ranks exact."""
    ids = [t for t, _, _ in entries]
    assert len(set(ids)) == len(ids)
    expected_top = logprobs_row.topk(k).indices.tolist()
    assert ids[:k] == expected_top
    assert sampled in ids
    assert len(entries) == (k if sampled in expected_top else k + 1)
    for tok, lp, rank in entries:
        assert lp == pytest.approx(logprobs_row[tok].item(), abs=1e-5)
        assert rank == 1 + int((logprobs_row > logprobs_row[tok]).sum())


def test_logprobs_are_of_the_raw_distribution_with_ranks():
    logits = torch.randn(5, VOCAB, generator=seeded(8))
    params = [SamplingParams(temperature=0.8, top_k=5, logprobs=3, repetition_penalty=1.2),
              SamplingParams(temperature=0.0, logprobs=1),
              SamplingParams(logprobs=None),
              SamplingParams(temperature=2.0, min_p=0.05, logprobs=5),
              SamplingParams(top_p=0.5, logprobs=0)]
    out = new_sampler()(logits, make_batch(params, outputs=[[1, 2], [], [], [3], []]))
    ref = torch.log_softmax(logits, dim=-1)
    assert out.sampled_logprobs is not None
    for r, p in enumerate(params):
        tok = out.token_ids[r]
        assert out.sampled_logprobs[r] == pytest.approx(ref[r, tok].item(), abs=1e-5)
        if p.logprobs is None:
            assert out.top_logprobs[r] is None
        else:
            _check_entries(out.top_logprobs[r], ref[r], p.logprobs, tok)


def test_sampled_token_outside_top_k_is_appended_with_its_raw_logprob_and_rank():
    # Raw order: 0 > 1 > 2 > ...; the repetition penalty on 0 and 1 makes greedy pick token 2,
    # which must appear after the top-1 with raw rank 3 and the raw (unpenalised) logprob.
    logits = torch.tensor([[4.0, 3.0, 2.5, 0.0, -1.0]])
    p = SamplingParams(temperature=0.0, repetition_penalty=4.0, logprobs=1)
    out = new_sampler()(logits, make_batch([p], outputs=[[0, 1]]))
    ref = torch.log_softmax(logits, dim=-1)[0]
    assert out.token_ids == [2]
    (t0, lp0, r0), (t2, lp2, r2) = out.top_logprobs[0]
    assert (t0, r0, t2, r2) == (0, 1, 2, 3)
    assert lp0 == pytest.approx(ref[0].item(), abs=1e-6)
    assert lp2 == pytest.approx(ref[2].item(), abs=1e-6)
    assert out.sampled_logprobs[0] == pytest.approx(ref[2].item(), abs=1e-6)


def test_logprobs_zero_returns_only_the_sampled_token():
    logits = torch.randn(1, VOCAB, generator=seeded(9))
    out = new_sampler()(logits, make_batch([SamplingParams(temperature=0.0, logprobs=0)]))
    ref = torch.log_softmax(logits, dim=-1)[0]
    tok = int(logits.argmax())
    assert out.top_logprobs[0] == [(tok, pytest.approx(ref[tok].item(), abs=1e-6), 1)]


def test_tied_logprobs_share_a_rank():
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    out = new_sampler()(logits, make_batch([SamplingParams(temperature=0.0, logprobs=3)]))
    ranks = {t: r for t, _, r in out.top_logprobs[0]}
    assert ranks == {1: 1, 2: 1, 0: 3}


def test_logprobs_k_larger_than_vocab_is_clamped():
    logits = torch.randn(1, 4, generator=seeded(10))
    out = new_sampler()(logits, make_batch([SamplingParams(logprobs=20)]))
    assert sorted(t for t, _, _ in out.top_logprobs[0]) == [0, 1, 2, 3]
    assert sorted(r for _, _, r in out.top_logprobs[0]) == [1, 2, 3, 4]


def test_logprobs_of_half_precision_logits_are_computed_in_float32():
    logits = (torch.randn(2, VOCAB, generator=seeded(11)) * 4).to(torch.bfloat16)
    out = new_sampler()(logits, make_batch([SamplingParams(temperature=0.0, logprobs=2)] * 2))
    ref = torch.log_softmax(logits.float(), dim=-1)
    for r in range(2):
        _check_entries(out.top_logprobs[r], ref[r], 2, out.token_ids[r])


# --------------------------------------------------------------------------------------------
# Prompt logprobs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1, 4])
def test_prompt_logprobs_shape_and_values(k):
    num_positions = 9
    logits = torch.randn(num_positions, VOCAB, generator=seeded(12))
    next_ids = torch.randint(0, VOCAB, (num_positions,), generator=seeded(13))
    result = compute_prompt_logprobs(logits, next_ids, k)
    ref = torch.log_softmax(logits, dim=-1)
    assert len(result) == num_positions
    for pos, entries in enumerate(result):
        _check_entries(entries, ref[pos], k, int(next_ids[pos]))


def test_prompt_logprobs_are_the_same_when_computed_in_chunks(monkeypatch):
    logits = torch.randn(11, VOCAB, generator=seeded(14)).to(torch.bfloat16)
    next_ids = torch.randint(0, VOCAB, (11,), generator=seeded(15))
    whole = compute_prompt_logprobs(logits, next_ids, 3)
    monkeypatch.setattr(sampler_mod, "PROMPT_LOGPROBS_CHUNK", 4)
    assert compute_prompt_logprobs(logits, next_ids, 3) == whole


def test_prompt_logprobs_rejects_mismatched_shapes():
    with pytest.raises(ValueError):
        compute_prompt_logprobs(torch.randn(3, VOCAB), torch.tensor([1, 2]), 1)


def test_prompt_logprobs_for_an_empty_prompt_tail_is_empty():
    assert compute_prompt_logprobs(torch.randn(0, VOCAB), torch.zeros(0, dtype=torch.long), 2) == []


def test_sampled_logprob_sum_is_the_sequence_log_likelihood():
    """cumulative_logprob = sum of sampled_logprobs equals the log-likelihood under the raw model."""
    logits = torch.randn(6, VOCAB, generator=seeded(16))
    out = new_sampler()(logits, make_batch([SamplingParams(seed=1, logprobs=0)] * 6, [seeded(1)] * 6))
    ref = torch.log_softmax(logits, dim=-1)
    expected = sum(ref[r, t].item() for r, t in enumerate(out.token_ids))
    assert math.isclose(sum(out.sampled_logprobs), expected, abs_tol=1e-4)


def test_no_logprobs_work_when_no_row_asks_for_them():
    """Without logprobs requested the sampler skips the logsumexp pass entirely."""
    logits = torch.randn(3, VOCAB, generator=seeded(17))
    out = new_sampler()(logits, make_batch([SamplingParams(temperature=0)] * 3))
    assert out.sampled_logprobs is None and out.top_logprobs == [None] * 3
    assert out.token_ids == logits.argmax(-1).tolist()


def test_batch_with_mismatched_lengths_is_rejected():
    with pytest.raises(ValueError):
        SamplingBatch(params=[SamplingParams()], generators=[], prompt_token_ids=[[]], output_token_ids=[[]])
    with pytest.raises(ValueError):
        new_sampler()(torch.randn(2, VOCAB), make_batch([SamplingParams()]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_picks_argmax_first_on_ties_in_the_logits_own_dtype(dtype):
    """Greedy without logprobs reads the logits in their own dtype (no float32 copy) through
    max(dim).indices: the same token as argmax of the float32 logits, the first one on ties and
    on NaN rows."""
    g = seeded(3)
    logits = torch.randint(0, 4, (64, 1000), generator=g).to(dtype)  # many ties per row
    logits[5] = float("nan")
    logits[6, 17] = float("nan")
    expected = logits.float().argmax(dim=-1)
    assert torch.equal(sampler_mod.greedy_tokens(logits), expected)
    params = [SamplingParams(temperature=0.0, max_tokens=1)] * len(logits)
    out = new_sampler()(logits, make_batch(params))
    assert out.token_ids == expected.tolist() and out.sampled_logprobs is None
    with_logprobs = new_sampler()(logits, make_batch([SamplingParams(temperature=0.0, max_tokens=1, logprobs=1)] * len(logits)))
    assert with_logprobs.token_ids == expected.tolist(), "the logprobs path must pick the same tokens"


# -- the inverse-CDF draw behind random rows --------------------------------------------------------
def test_inverse_cdf_picks_the_token_whose_probability_interval_holds_u():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.25, 0.25, 0.0]])
    expected = {0.0: 1, 0.49: 1, 0.5: 3, 0.74: 3, 0.75: 4, 0.999: 4}
    for u, token in expected.items():
        got = sampler_mod._inverse_cdf(probs, torch.tensor([u], dtype=torch.float64)).item()
        assert got == token, f"u={u}: token {got}, expected {token} (zero-probability tokens never win)"


def test_inverse_cdf_never_returns_index_vocab_even_when_u_times_sum_rounds_up():
    # u = 1 stands in for u * sum rounding up to sum; trailing zero-probability tokens must be skipped.
    probs = torch.tensor([[0.3, 0.7, 0.0, 0.0], [float("nan")] * 4])
    got = sampler_mod._inverse_cdf(probs, torch.tensor([1.0, 0.5], dtype=torch.float64)).tolist()
    assert got[0] == 1, "past the end: the last token with probability > 0"
    assert 0 <= got[1] < 4, "a NaN row still yields an index inside the vocabulary"


def test_inverse_cdf_keeps_a_tiny_token_at_the_end_of_a_large_vocabulary():
    # Near 1 a float32 running sum moves in steps of 6e-8: it would round a 1e-8 token away
    # (never drawn); the float64 sum keeps its interval.
    vocab = 150_000
    probs = torch.full((1, vocab), (1 - 1e-8) / (vocab - 1))
    probs[0, -1] = 1e-8
    total = probs.double().sum().item()
    u = torch.tensor([1 - 0.5e-8 / total], dtype=torch.float64)
    assert sampler_mod._inverse_cdf(probs, u).item() == vocab - 1


@pytest.mark.parametrize("block", [1, 7, 16, 50, 64])
def test_the_two_level_draw_picks_what_one_running_sum_picks(monkeypatch, block):
    """Block sums then the sum inside the block give the token a float64 running sum over the
    whole row gives: blocks that divide the vocabulary and blocks that leave a padded tail, rows
    with zero-probability stretches (never drawn), a one-hot row."""
    torch.manual_seed(3)
    probs = torch.randn(9, 50).softmax(-1)
    probs[1, 10:40] = 0.0
    probs[2] = 0.0
    probs[2, 37] = 1.0
    u = torch.rand(9, dtype=torch.float64)
    u[0] = 0.0
    cdf = probs.double().cumsum(-1)
    want = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    monkeypatch.setattr(sampler_mod, "INVERSE_CDF_BLOCK", block)
    got = sampler_mod._inverse_cdf(probs, u)
    assert torch.equal(got, want) and got[2] == 37
    assert (probs.gather(1, got.unsqueeze(1)) > 0).all(), "a zero-probability token was drawn"


def test_a_rows_logprobs_do_not_depend_on_the_rows_beside_it():
    """Invariant: a request's reported logprobs are the same bits alone and in a batch. At a real
    vocabulary's width (the demo model's 49,152) torch's logsumexp split one row's sum across the
    threads when the batch had fewer rows than threads: 68 of 1,200 bf16-valued rows differed
    between a batch of six and the row alone (2 threads)."""
    g = torch.Generator().manual_seed(7)
    vocab, rows = 49_152, 6
    logits = (torch.randn(rows, vocab, generator=g) * 3 + torch.randn(rows, 1, generator=g) * 10).bfloat16()
    params = [SamplingParams(temperature=0, logprobs=4) if i % 2 else
              SamplingParams(temperature=0.8, seed=i, logprobs=4) for i in range(rows)]
    sampler = Sampler(torch.Generator().manual_seed(0))

    def batch(index):
        return make_batch([params[i] for i in index], [torch.Generator().manual_seed(i) for i in index])

    together = sampler(logits, batch(range(rows)))
    for i in range(rows):
        alone = sampler(logits[i : i + 1], batch([i]))
        assert alone.token_ids[0] == together.token_ids[i], f"row {i}'s token depends on its batch"
        assert alone.sampled_logprobs[0] == together.sampled_logprobs[i], f"row {i}'s logprob depends on its batch"
        assert alone.top_logprobs[0] == together.top_logprobs[i], f"row {i}'s top logprobs depend on its batch"
    prompt = compute_prompt_logprobs(logits, torch.arange(rows), 2)
    for i in range(rows):
        assert compute_prompt_logprobs(logits[i : i + 1], torch.tensor([i]), 2)[0] == prompt[i], (
            f"prompt row {i}'s logprobs depend on the rows computed with it")

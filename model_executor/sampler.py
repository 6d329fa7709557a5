"""Turns one step's logits into next tokens plus logprobs, following vLLM v1's semantics.

Pipeline per step (all on float32 logits, on the logits' device):

1. min_tokens: stop ids get -inf while a sequence is shorter than ``min_tokens``.
2. penalties: repetition (prompt + output), frequency and presence (output only).
3. greedy rows (temperature < 1e-5): argmax of the penalised logits.
4. random rows: temperature, then min_p, top_k, top_p, then one inverse-CDF draw per row
   (the first token whose running probability exceeds ``u ~ U[0, 1)``), with u drawn from the
   row's own generator when the request is seeded, so its tokens do not depend on which other
   requests share the batch.

Logprobs always describe the *raw* model distribution (log_softmax of the input logits),
never the penalised / tempered / filtered one, as in vLLM v1.

Constrained rows (structured outputs): the batch's token bitmask is applied first (forbidden
tokens -inf, model_executor/token_bitmask.py), so every mode samples from the allowed tokens only
and logprobs describe the masked distribution, as in vLLM v1, where the grammar bitmask is
applied to the logits before the sampler sees them.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hybridkv.model_executor.cpu_kernels import fused_ops
from hybridkv.model_executor.sampling_params import SamplingParams
from hybridkv.model_executor.token_bitmask import apply_token_bitmask

# (token_id, logprob, rank); rank = 1 + number of tokens with a strictly greater logprob.
TokenLogprob = tuple[int, float, int]

# compute_prompt_logprobs turns at most this many [V]-rows into float32 logprobs at once, so a
# long prompt with a 150k vocabulary does not allocate a multi-GB temporary.
PROMPT_LOGPROBS_CHUNK = 256

# The inverse-CDF draw of a random row first finds the block of this many tokens its draw lands
# in (float64 block sums), then runs the float64 sum inside that block only.
INVERSE_CDF_BLOCK = 1024


@dataclass
class SamplingBatch:
    """Built by the model runner every step; one row per sequence that samples now."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]  # per-request generator when params.seed is set
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]  # tokens generated so far (before this step)
    # Structured outputs: token_bitmask[i] ([R, ceil(V / 32)] int32) allows the next tokens of
    # row bitmask_rows[i]; None when no row of the step is constrained.
    token_bitmask: torch.Tensor | None = None
    bitmask_rows: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.params)
        lengths = (len(self.generators), len(self.prompt_token_ids), len(self.output_token_ids))
        if any(length != n for length in lengths):
            raise ValueError(
                f"SamplingBatch: params/generators/prompt_token_ids/output_token_ids must all "
                f"have one entry per row, got {n} and {lengths}"
            )

    def __len__(self) -> int:
        return len(self.params)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest logit, the first one on ties, as argmax gives it.
    max(dim).indices picks the same index (first on ties, also for NaN) and on the CPU is 2.7-4x
    faster than argmax (32 x 49,152: 0.52 vs 1.43 ms in float32, 0.77 vs 3.38 ms in bfloat16,
    Intel VM), but still a scalar loop: the fused CPU ops' argmax_rows gives its answer in one
    vectorised pass (2-core Zen 4, 49,152-entry rows: 1 row 47 -> 4.5-4.9 us, 32 rows ~1.1 ms ->
    48 us float32 / 80 us bfloat16)."""
    if (logits.is_cpu and logits.dim() == 2 and logits.shape[1] > 0
            and logits.dtype in (torch.float32, torch.bfloat16) and (ops := fused_ops())):
        return ops.argmax_rows(logits)
    return logits.max(dim=-1).indices


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one sampled token per row
    # Logprob of the sampled token under the raw model distribution, per row (for
    # cumulative_logprob). The Sampler always fills it; None is reserved for callers that skip it.
    sampled_logprobs: list[float] | None
    # Per row: top-k (k = params.logprobs) in rank order, then the sampled token if it is not
    # among them. None for rows whose params.logprobs is None.
    top_logprobs: list[list[TokenLogprob] | None]


# --------------------------------------------------------------------------------------------
# Logprob helpers (shared by the sampler and prompt logprobs)
# --------------------------------------------------------------------------------------------


def row_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """float32 log_softmax of each row of `logits` [N, V], the same bits whatever rows share the
    call. torch's CPU log_softmax reduces each row within one thread; its logsumexp, a generic
    reduction, splits one row's sum across the threads when there are fewer rows than threads,
    so `x - x.logsumexp(-1)` gave a request a logprob that depended on its batch (68 of 1,200
    bf16-valued rows of 49,152 differed between a batch of six and the row alone, 2 threads)."""
    return logits.float().log_softmax(dim=-1)


def _top_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> list[list[TokenLogprob]]:
    """Top-k entries plus ``token_ids[i]`` (if not already in the top-k) for every row.

    ``logprobs`` is [N, V] float32 (already normalised), ``token_ids`` is [N].
    """
    num_rows, vocab = logprobs.shape
    if num_rows == 0:
        return []
    k = max(0, min(k, vocab))
    top_vals, top_ids = logprobs.topk(k, dim=-1)  # sorted, highest first
    # Any token strictly above a top-k value is itself in the top-k, so ranks of the top-k only
    # need a [k, k] comparison instead of a pass over the vocabulary.
    top_ranks = 1 + (top_vals.unsqueeze(1) > top_vals.unsqueeze(2)).sum(-1)
    tok_vals = logprobs.gather(1, token_ids.view(-1, 1)).squeeze(1)
    tok_ranks = 1 + (logprobs > tok_vals.unsqueeze(1)).sum(-1)

    # One device->host transfer per tensor, then plain Python to build the nested lists.
    rows = zip(
        top_ids.tolist(), top_vals.tolist(), top_ranks.tolist(),
        token_ids.tolist(), tok_vals.tolist(), tok_ranks.tolist(),
    )
    result: list[list[TokenLogprob]] = []
    for ids, vals, ranks, tok, tok_val, tok_rank in rows:
        entries = list(zip(ids, vals, ranks))
        if tok not in ids:
            entries.append((tok, tok_val, tok_rank))
        result.append(entries)
    return result


def compute_prompt_logprobs(
    logits: torch.Tensor, next_token_ids: torch.Tensor, k: int
) -> list[list[TokenLogprob]]:
    """Prompt logprobs: per prompt position, the top-k plus the actual next prompt token.

    ``logits`` is [T, V] at prompt positions (any float dtype), ``next_token_ids`` is [T] and
    holds the prompt token that actually follows each position. The first prompt token has no
    logprob (vLLM reports None for it): for a prompt of length P the caller passes the logits
    of positions 0..P-2 with next_token_ids = prompt[1:], and result[j] belongs to prompt[j + 1].
    """
    if logits.dim() != 2 or next_token_ids.shape != logits.shape[:1]:
        raise ValueError(
            f"compute_prompt_logprobs: expected logits [T, V] and next_token_ids [T], "
            f"got {tuple(logits.shape)} and {tuple(next_token_ids.shape)}"
        )
    next_token_ids = next_token_ids.to(device=logits.device, dtype=torch.long)
    result: list[list[TokenLogprob]] = []
    for start in range(0, logits.shape[0], PROMPT_LOGPROBS_CHUNK):
        logprobs = row_log_softmax(logits[start:start + PROMPT_LOGPROBS_CHUNK])
        result.extend(_top_logprobs(logprobs, next_token_ids[start:start + PROMPT_LOGPROBS_CHUNK], k))
    return result


# --------------------------------------------------------------------------------------------
# Logits processing: min_tokens and penalties (applied in place on a float32 copy)
# --------------------------------------------------------------------------------------------


def _has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _min_tokens_active(p: SamplingParams, num_output: int) -> bool:
    return num_output < p.min_tokens and bool(p.all_stop_token_ids)


def plain_greedy(p: SamplingParams, num_output: int) -> bool:
    """Whether a row with num_output tokens so far gets the plain argmax of its logits, and
    nothing else the sampler computes is read (no logprobs), now and at every later step
    (min_tokens, once reached, stays reached). The engine's decode bursts ask: a constrained row
    (structured outputs) is not one, its argmax is over the tokens its grammar allows."""
    return (p.greedy and p.logprobs is None and p.structured_outputs is None and not _has_penalties(p)
            and not _min_tokens_active(p, num_output))


def drafts_verifiable(p: SamplingParams, num_output: int) -> bool:
    """Whether n-gram drafts for a row with num_output tokens so far can be verified exactly:
    plain greedy rows by their argmax, random rows by speculative sampling (rejection_sampler.py),
    whose row i reads the distribution after the first i drafts. Left out: rows whose
    distribution or reported values depend on more than the logits and the filters (penalties,
    min_tokens still active, logprobs, prompt logprobs, a grammar); they decode one token a step."""
    if plain_greedy(p, num_output):
        return True
    return (not p.greedy and p.logprobs is None and p.prompt_logprobs is None and p.structured_outputs is None
            and not _has_penalties(p) and not _min_tokens_active(p, num_output))


def _apply_min_tokens(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Forbid every stop token (EOS included) until the row has generated min_tokens tokens."""
    vocab = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for i, (p, out) in enumerate(zip(batch.params, batch.output_token_ids)):
        if _min_tokens_active(p, len(out)):
            # Stop ids outside this model's vocabulary can never be sampled anyway.
            stop_ids = [t for t in p.all_stop_token_ids if t < vocab]
            rows.extend([i] * len(stop_ids))
            cols.extend(stop_ids)
    if rows:
        device = logits.device
        logits[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = float("-inf")


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), V] int64 count of every token id per row, built with one bincount."""
    num_rows = len(token_lists)
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.long)
    flat = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long)
    row_ids = torch.repeat_interleave(torch.arange(num_rows), lengths)
    flat_index = (row_ids * vocab + flat).to(device)
    return torch.bincount(flat_index, minlength=num_rows * vocab).view(num_rows, vocab)


def _apply_penalties(logits: torch.Tensor, batch: SamplingBatch, rows: list[int]) -> None:
    """Repetition, frequency and presence penalties for ``rows``, vectorised over those rows."""
    device, vocab = logits.device, logits.shape[1]
    params = [batch.params[i] for i in rows]
    row_index = torch.tensor(rows, device=device)
    sub = logits[row_index]

    output_counts = _token_counts([batch.output_token_ids[i] for i in rows], vocab, device)
    in_output = output_counts > 0

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

    if any(p.repetition_penalty != 1.0 for p in params):
        # Repetition penalty (CTRL paper / HF) looks at prompt tokens too, unlike the others.
        in_prompt = _token_counts([batch.prompt_token_ids[i] for i in rows], vocab, device) > 0
        rep = column([p.repetition_penalty for p in params])
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(in_prompt | in_output, penalised, sub)
    if any(p.frequency_penalty != 0.0 for p in params):
        sub = sub - column([p.frequency_penalty for p in params]) * output_counts
    if any(p.presence_penalty != 0.0 for p in params):
        sub = sub - column([p.presence_penalty for p in params]) * in_output

    logits[row_index] = sub


def _needs_processing(batch: SamplingBatch) -> bool:
    return any(
        _has_penalties(p) or _min_tokens_active(p, len(out))
        for p, out in zip(batch.params, batch.output_token_ids)
    )


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """min_tokens masking then penalties, as float32; what greedy argmax and sampling start from.

    Never modifies ``logits``; returns it (as float32, possibly the same tensor) when no row
    needs either step.
    """
    logits = logits.float()
    if not _needs_processing(batch):
        return logits
    logits = logits.clone()
    _apply_min_tokens(logits, batch)
    penalty_rows = [i for i, p in enumerate(batch.params) if _has_penalties(p)]
    if penalty_rows:
        _apply_penalties(logits, batch, penalty_rows)
    return logits


# --------------------------------------------------------------------------------------------
# Random sampling: temperature, filters, inverse-CDF draw
# --------------------------------------------------------------------------------------------


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose prob < min_p * max_prob. ``min_p`` is [N] (CPU)."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.to(logits.device).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep tokens whose logit is >= the k-th largest logit (ties at the boundary are kept).

    ``top_k`` is [N] long (CPU, so reading the largest k does not sync the device), each in
    [1, V]; one topk call with the largest k serves every row.
    """
    top_vals = logits.topk(int(top_k.max()), dim=-1).values
    kth = top_vals.gather(1, (top_k - 1).to(logits.device).unsqueeze(1))
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose total prob reaches top_p. ``top_p`` is [N] (CPU).

    A sorted token is kept iff the probability mass strictly before it is < top_p, so the top
    token (mass 0 before it) always survives. The cut is turned into a probability threshold
    rather than scattered back by index, so tokens tied with the last kept token are kept too.
    """
    probs = logits.softmax(dim=-1)
    sorted_probs = probs.sort(dim=-1, descending=True).values
    # Shift the inclusive cumsum rather than computing cumsum - probs: the latter is not exactly
    # monotone in float32, the shifted one is.
    inclusive = sorted_probs.cumsum(dim=-1)
    mass_before = torch.cat([torch.zeros_like(inclusive[:, :1]), inclusive[:, :-1]], dim=-1)
    num_kept = (mass_before < top_p.to(logits.device).unsqueeze(1)).sum(dim=-1, keepdim=True).clamp_(min=1)
    threshold = sorted_probs.gather(1, num_kept - 1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _filter_rows(
    logits: torch.Tensor,
    values: list[float | int | None],
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Apply ``fn(rows, per_row_values)`` in one batched call to the rows whose value is not None.

    Rows with the filter off are left untouched (and cost nothing when no row has it on).
    The values are handed over as a CPU tensor; each filter moves what it needs to the device.
    """
    rows = [i for i, v in enumerate(values) if v is not None]
    if not rows:
        return logits
    row_values = torch.tensor([values[i] for i in rows])
    if len(rows) == len(values):
        return fn(logits, row_values)
    index = torch.tensor(rows, device=logits.device)
    out = logits.clone()
    out[index] = fn(logits[index], row_values)
    return out


def random_row_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each non-greedy row of ``logits`` [N, V] (already penalised) samples from:
    temperature, then min_p, top_k and top_p, then softmax. Speculative sampling
    (rejection_sampler.py) verifies drafts against these same probabilities."""
    device, vocab = logits.device, logits.shape[1]
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    logits = logits / temps.unsqueeze(1)

    # Order as in vLLM: min_p, then top_k, then top_p (on what the earlier filters left).
    logits = _filter_rows(logits, [p.min_p if p.min_p > 0.0 else None for p in params], _apply_min_p)
    logits = _filter_rows(logits, [p.top_k if 0 < p.top_k < vocab else None for p in params], _apply_top_k)
    logits = _filter_rows(logits, [p.top_p if p.top_p < 1.0 else None for p in params], _apply_top_p)
    return logits.softmax(dim=-1)


def _sample_random_rows(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
) -> torch.Tensor:
    """Sample one token per row of ``logits`` [N, V] (already penalised) for non-greedy rows."""
    probs = random_row_probs(logits, params)
    return _inverse_cdf(probs, _uniform_per_row(generators, default_generator, logits.device))


def _uniform_per_row(
    generators: list[torch.Generator | None], default_generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """One float64 draw from U[0, 1) per row. A seeded row draws from its own generator, so its
    token does not depend on which other requests share the batch; unseeded rows share one draw."""
    u = torch.empty(len(generators), dtype=torch.float64, device=device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        return u.uniform_(generator=default_generator)
    if unseeded:
        draw = torch.empty(len(unseeded), dtype=torch.float64, device=device).uniform_(generator=default_generator)
        u[torch.tensor(unseeded, device=device)] = draw
    for i, g in enumerate(generators):
        if g is not None:
            u[i : i + 1].uniform_(generator=g)
    return u


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row r's token: the first index whose running sum of probs[r] exceeds u[r] * sum(probs[r]),
    i.e. token i with probability probs[r, i] / sum(probs[r]); a zero-probability token is never
    picked (its running sum equals its predecessor's).

    Why not the exponential race argmax(probs / q), q ~ Exp(1): it draws V random numbers per
    row, and torch's CPU exponential_ costs ~18 ns each -- 20 ms a step for 16 rows of a
    49,152-token vocabulary, a tenth of a decode step under load; this draws one per row. The
    running sum is float64, so its rounding (~V * 1e-16) biases no token measurably. It runs in
    two levels: float64 sums of blocks of INVERSE_CDF_BLOCK tokens and their running sum pick the
    block, then the running sum inside that block picks the token. The float64 cumsum over whole
    rows (and the float64 copy it needs) was most of the sampling time: on the Intel AMX VM,
    16 rows of 49,152 tokens at temperature 1 took 4.6 ms a step before, 1.7 ms now.
    """
    num_rows, vocab = probs.shape
    block = INVERSE_CDF_BLOCK
    blocks = -(-vocab // block)
    padded = probs if blocks * block == vocab else F.pad(probs, (0, blocks * block - vocab))  # zeros: never drawn
    by_block = padded.view(num_rows, blocks, block)
    block_cdf = by_block.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)  # [N, blocks]
    target = (u * block_cdf[:, -1]).unsqueeze(1)
    b = torch.searchsorted(block_cdf, target, right=True).clamp_(max=blocks - 1)  # [N, 1]
    before = torch.where(b > 0, block_cdf.gather(1, (b - 1).clamp(min=0)), 0.0)
    inner = by_block[torch.arange(num_rows, device=probs.device), b.squeeze(1)].double().cumsum(dim=-1) + before
    index = torch.searchsorted(inner, target, right=True).squeeze(1)
    tokens = b.squeeze(1) * block + index
    # u * sum can round up to sum itself (about once in 2^53 draws), the in-block sum can end a
    # rounding short of the block's, and a NaN row compares false everywhere: each leaves the index
    # past its block or the vocabulary; take the row's last token that has any probability instead.
    over = (index >= block) | (tokens >= vocab)
    if bool(over.any()):
        has_mass = (probs[over] > 0).flip(dims=(-1,)).to(torch.uint8)
        tokens[over] = vocab - 1 - has_mass.argmax(dim=-1)
    return tokens


# --------------------------------------------------------------------------------------------
# Sampler
# --------------------------------------------------------------------------------------------


class Sampler:
    def __init__(self, default_generator: torch.Generator) -> None:
        # Used by unseeded random rows; must live on the same device as the logits.
        self.default_generator = default_generator

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row of ``logits`` [B, V]. The input tensor is never modified."""
        if logits.dim() != 2 or logits.shape[0] != len(batch):
            raise ValueError(
                f"Sampler: expected logits [B, V] with B = {len(batch)} rows, got {tuple(logits.shape)}"
            )
        if batch.token_bitmask is not None:  # a new float32 tensor: the input stays untouched
            logits = apply_token_bitmask(logits, batch.token_bitmask, batch.bitmask_rows)
        no_logprobs = all(p.logprobs is None for p in batch.params)
        if all(plain_greedy(p, len(out)) for p, out in zip(batch.params, batch.output_token_ids)):
            # Plain greedy: the argmax of the logits in their own dtype (widening bf16 to float32
            # is exact and keeps the order, so it picks the same token) without a float32 copy.
            return SamplerOutput(token_ids=greedy_tokens(logits).tolist(), sampled_logprobs=None,
                                 top_logprobs=[None] * len(batch))
        raw = logits.float()  # aliases `logits` when it already is float32: do not write to it
        token_ids = self._sample(raw, batch)

        if no_logprobs:
            # Nobody reports logprobs (cumulative_logprob is only reported alongside them).
            return SamplerOutput(token_ids=token_ids.tolist(), sampled_logprobs=None, top_logprobs=[None] * len(batch))
        logprobs = row_log_softmax(raw)  # of the raw distribution
        sampled_logprobs = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        top_logprobs = self._top_logprobs(logprobs, token_ids, batch)
        return SamplerOutput(
            token_ids=token_ids.tolist(),
            sampled_logprobs=sampled_logprobs.tolist(),
            top_logprobs=top_logprobs,
        )

    def _sample(self, raw: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        params = batch.params
        greedy = [p.greedy for p in params]
        # Fast path: plain greedy decoding is a single argmax over the batch.
        if all(greedy) and not _needs_processing(batch):
            return greedy_tokens(raw)

        logits = process_logits(raw, batch)
        if all(greedy):
            return greedy_tokens(logits)

        random_rows = [i for i, g in enumerate(greedy) if not g]
        if len(random_rows) == len(params):
            return _sample_random_rows(logits, params, batch.generators, self.default_generator)

        token_ids = greedy_tokens(logits)  # right for the greedy rows; random rows overwritten
        index = torch.tensor(random_rows, device=logits.device)
        token_ids[index] = _sample_random_rows(
            logits[index],
            [params[i] for i in random_rows],
            [batch.generators[i] for i in random_rows],
            self.default_generator,
        )
        return token_ids

    @staticmethod
    def _top_logprobs(
        logprobs: torch.Tensor, token_ids: torch.Tensor, batch: SamplingBatch
    ) -> list[list[TokenLogprob] | None]:
        result: list[list[TokenLogprob] | None] = [None] * len(batch)
        # Rows are grouped by k so each group is one batched topk.
        rows_by_k: dict[int, list[int]] = {}
        for i, p in enumerate(batch.params):
            if p.logprobs is not None:
                rows_by_k.setdefault(p.logprobs, []).append(i)
        for k, rows in rows_by_k.items():
            index = torch.tensor(rows, device=logprobs.device)
            # The tensor sampled_logprobs gathers from, so the two agree bit for bit.
            for i, entries in zip(rows, _top_logprobs(logprobs[index], token_ids[index], k)):
                result[i] = entries
        return result

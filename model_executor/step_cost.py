"""What a forward pass costs, in FLOPs, as a function of the tokens it computes and their positions.

The scheduler uses it to size prefill chunks so that a step stays under a latency target while
other requests are decoding (engine/step_timer.py turns FLOPs into seconds). Only the shape
matters for that: whether 128 new tokens at position 7,000 cost more than 512 at position 0. So
the model is the textbook one, not a profile:

  per token     2 x the parameters every token multiplies (projections, MLP; embeddings are a lookup)
  per sample    2 x the logits matrix, for each position a token is sampled at (a chunk that ends
                its prompt, every decode)
  per key       4 x heads x head_dim per attention layer (q.k and p.v), for every key a query
                attends to: all earlier tokens, at most `window` of them (sliding window), or one
                per `stride` tokens (compressed KV, e.g. DeepSeek-V4's 4:1 and 128:1 entries)

Besides FLOPs, a chunk *reads* the K/V of every key it attends to once per step, however few
its queries: `chunk_reads` counts that (in the same per-key units as the attention FLOPs of one
query), so a timer can charge the memory traffic of a short chunk late in a long context, which
its FLOPs alone under-price.

A chunk's cost sums over its positions in closed form, so pricing a chunk is O(attention groups),
never O(tokens).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionCost:
    """One group of attention reads, per query token."""

    flops_per_key: float
    window: int | None = None  # at most this many keys (the newest); None = the whole history
    stride: int = 1  # one key per `stride` tokens of history (compressed spaces)

    def keys_at(self, position: int) -> float:
        """Keys the query at `position` reads."""
        keys = position + 1
        return min(keys, self.window) if self.window is not None else keys / self.stride

    def keys_summed(self, start: int, end: int) -> float:
        """Sum over query positions p in [start, end) of the keys position p reads."""
        if end <= start:
            return 0.0
        if self.window is not None:
            # keys(p) = min(p + 1, window): a triangle up to the window, then flat.
            w = self.window
            lo, hi = start + 1, end  # keys(p) = p + 1 runs over [lo, hi]
            tri_hi = min(hi, w)
            tri = (tri_hi * (tri_hi + 1) - (lo - 1) * lo) / 2 if tri_hi >= lo else 0.0
            flat = max(0, hi - max(lo - 1, w)) * w
            return tri + flat
        # keys(p) = (p + 1) / stride: an arithmetic series (fractions of an entry are fine here).
        return (end * (end + 1) - start * (start + 1)) / (2 * self.stride)


@dataclass(frozen=True)
class StepCost:
    flops_per_token: float
    attention: tuple[AttentionCost, ...] = ()
    flops_per_sample: float = 0.0

    def chunk_flops(self, start: int, n: int, samples: bool = False) -> float:
        """FLOPs of computing tokens [start, start + n) of one sequence (its earlier tokens cached);
        samples: the chunk ends the sequence's known tokens, so a token is sampled after it."""
        return n * self.flops_per_token + sum(a.flops_per_key * a.keys_summed(start, start + n)
                                              for a in self.attention) + (self.flops_per_sample if samples else 0.0)

    def chunk_reads(self, start: int, n: int) -> float:
        """The K/V a chunk reads once (its last query's keys), per-key weighted like its FLOPs."""
        return sum(a.flops_per_key * a.keys_at(start + n - 1) for a in self.attention) if n > 0 else 0.0

    def decode_flops(self, n: int, total_context: int) -> float:
        """FLOPs of n decoding tokens over total_context cached tokens between them: O(1), for
        the scheduler's hot path (a window is applied to the total, which only over-estimates)."""
        per_key = sum(a.flops_per_key * (min(total_context, n * a.window) if a.window is not None
                                         else total_context / a.stride) for a in self.attention)
        return n * (self.flops_per_token + self.flops_per_sample) + per_key

    def max_chunk(self, start: int, limit: int, budget: float, per_flop: float = 1.0, per_read: float = 0.0) -> int:
        """The most tokens (<= limit) from `start` whose price per_flop x FLOPs + per_read x reads
        fits `budget` (default: a FLOP budget); 0 when not even one does. The price grows with n,
        so a binary search: O(log limit) prices. (The caller sets aside the sample's price when
        the chunk may end the sequence.)"""
        def price(n: int) -> float:
            return per_flop * self.chunk_flops(start, n) + (per_read * self.chunk_reads(start, n) if per_read else 0.0)

        if limit <= 0 or price(1) > budget:
            return 0
        lo, hi = 1, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if price(mid) <= budget else (lo, mid - 1)
        return lo


def dense_step_cost(num_token_params: int, attention_layers: list, logits_params: int = 0) -> StepCost:
    """The cost of a decoder whose attention layers (with .num_heads, .head_dim, .window) each
    read one K/V per earlier token; num_token_params: parameters every token multiplies;
    logits_params: the size of the logits matrix (vocab x hidden)."""
    groups: dict[int | None, float] = {}
    for a in attention_layers:
        groups[a.window] = groups.get(a.window, 0.0) + 4.0 * a.num_heads * a.head_dim
    return StepCost(2.0 * num_token_params, tuple(AttentionCost(f, w) for w, f in groups.items()),
                    2.0 * logits_params)

"""Which slice of a dense decoder's weights each rank holds (the Megatron-LM / vLLM layout).

- attention: query heads split evenly; key/value heads split too, or, when there are fewer KV
  heads than ranks, each KV head replicated on the ranks whose query heads read it;
- q/k/v and MLP gate/up projections are column-parallel (output rows split), o_proj and
  down_proj row-parallel (input columns split; their partial outputs are all-reduced, and only
  rank 0 adds their bias so that it counts once);
- the embedding and the LM head are vocab-parallel: each rank holds ceil(vocab / size) rows,
  the last rank's tail padded with zeros.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadShard:
    """One rank's attention heads: [q_start, q_start + num_heads) of the query heads and
    [kv_start, kv_start + num_kv_heads) of the key/value heads."""

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, rank: int, size: int) -> "HeadShard":
        if num_heads % size:
            raise ValueError(f"tensor_parallel_size={size} must divide the model's {num_heads} attention heads")
        q = num_heads // size
        if num_kv_heads >= size:
            if num_kv_heads % size:
                raise ValueError(f"tensor_parallel_size={size} must divide the model's {num_kv_heads} key/value "
                                 "heads (or be a multiple of it)")
            kv = num_kv_heads // size
            return cls(q, kv, rank * q, rank * kv)
        if size % num_kv_heads:
            raise ValueError(f"tensor_parallel_size={size} must be a multiple of the model's {num_kv_heads} "
                             "key/value heads (or divide it)")
        # Fewer KV heads than ranks: the rank's query heads all read one KV head, held whole.
        return cls(q, 1, rank * q, rank // (size // num_kv_heads))


@dataclass(frozen=True)
class VocabShard:
    """One rank's rows [start, stop) of the vocabulary, held in `padded` rows (the last rank's
    tail beyond `stop - start` is zeros)."""

    start: int
    stop: int
    padded: int

    @classmethod
    def of(cls, vocab_size: int, rank: int, size: int) -> "VocabShard":
        per_rank = -(-vocab_size // size)
        start = min(vocab_size, rank * per_rank)
        return cls(start, min(vocab_size, start + per_rank), per_rank)


def split_evenly(total: int, rank: int, size: int, what: str) -> tuple[int, int]:
    """[start, stop) of rank's equal part of `total` (an MLP's intermediate size)."""
    if total % size:
        raise ValueError(f"tensor_parallel_size={size} must divide the model's {what} ({total})")
    part = total // size
    return rank * part, (rank + 1) * part


@dataclass(frozen=True)
class Slice:
    """A rank's part of one checkpoint tensor: rows/columns [start, stop) along `dim`, padded with
    zeros to `length` along it (None: no padding); `zeros`: the rank holds zeros of the whole
    tensor's shape (a row-parallel bias, added by rank 0 only); `skip`: the rank holds none of
    it and never reads it (another rank's routed expert under expert parallelism)."""

    dim: int = 0
    start: int = 0
    stop: int = 0
    length: int | None = None
    zeros: bool = False
    skip: bool = False


@dataclass(frozen=True)
class DenseDecoderShard:
    """One rank's slices of a Llama-family (or Gemma-3) checkpoint, by Hugging Face tensor name."""

    rank: int
    heads: HeadShard
    head_dim: int
    mlp: tuple[int, int]  # [start, stop) of the intermediate size
    vocab: VocabShard

    def slice_of(self, name: str) -> Slice | None:
        """The rank's slice of tensor `name`, or None: the rank holds it whole (norms)."""
        parts = name.split(".")
        module, leaf = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", name)
        D, h = self.head_dim, self.heads
        if module == "q_proj":
            return Slice(0, h.q_start * D, (h.q_start + h.num_heads) * D)
        if module in ("k_proj", "v_proj"):
            return Slice(0, h.kv_start * D, (h.kv_start + h.num_kv_heads) * D)
        if module in ("gate_proj", "up_proj"):
            return Slice(0, *self.mlp)
        if module in ("o_proj", "down_proj"):
            if leaf == "bias":
                return None if self.rank == 0 else Slice(zeros=True)
            cols = (h.q_start * D, (h.q_start + h.num_heads) * D) if module == "o_proj" else self.mlp
            return Slice(1, *cols)
        if module in ("embed_tokens", "lm_head") and leaf == "weight":
            return Slice(0, self.vocab.start, self.vocab.stop, self.vocab.padded)
        return None

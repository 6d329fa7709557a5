"""Read one rank's slices of a safetensors checkpoint: each tensor through safe_open's get_slice,
so a rank reads (and holds) its own part of every weight, never the whole tensor."""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from hybridkv.model_executor.checkpoint import weight_files
from hybridkv.model_executor.parallel.layout import Slice


def iter_weight_shards(model_dir: str, slice_of: Callable[[str], Slice | None]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, this rank's part) for every tensor of the checkpoint; `slice_of(name)` says
    which part (None: the whole tensor; a `skip` slice: not read, not yielded). Only safetensors
    files can be read in slices."""
    from safetensors import safe_open

    files = weight_files(model_dir)
    pickled = [f for f in files if not f.endswith(".safetensors")]
    if pickled:
        raise ValueError(f"tensor_parallel_size > 1 reads weights in slices, which needs safetensors files; "
                         f"{model_dir} has {pickled[0]}")
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as handle:
            for name in handle.keys():
                part = slice_of(name)
                if part is None or not part.skip:
                    yield name, read_slice(handle.get_slice(name), part)


def read_slice(tensor_slice, part: Slice | None) -> torch.Tensor:
    """`part` of one stored tensor (safetensors' lazy slice object)."""
    shape = list(tensor_slice.get_shape())
    if part is None:
        return tensor_slice[tuple(slice(None) for _ in shape)] if shape else tensor_slice[()]
    if part.zeros:
        empty = tensor_slice[tuple(slice(0, 0) for _ in shape)]  # the stored dtype, no bytes read
        return torch.zeros(shape, dtype=empty.dtype)
    index = tuple(slice(part.start, part.stop) if d == part.dim else slice(None) for d in range(len(shape)))
    out = tensor_slice[index]
    if part.length is not None and out.shape[part.dim] < part.length:
        pad = list(out.shape)
        pad[part.dim] = part.length - out.shape[part.dim]
        out = torch.cat([out, torch.zeros(pad, dtype=out.dtype)], dim=part.dim)
    return out

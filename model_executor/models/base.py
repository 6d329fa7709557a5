"""The contract every model in the registry fulfils, and the shared weight loader."""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from block_manager.space_spec import SpaceSpec


class CausalLM(nn.Module):
    """A decoder the model runner can drive.

    forward(input_ids [T], positions [T], meta) -> hidden [T, H] for a flat batch of tokens
    compute_logits(hidden [N, H]) -> [N, vocab]
    space_specs(dtype) -> the block spaces this model's layers read and write
    attention_layers() -> modules with .space, .num_kv_heads, .head_dim and k_cache/v_cache/backend slots
    load_weights(iterable of (HF name, tensor))
    """

    def space_specs(self, dtype: torch.dtype) -> list[SpaceSpec]:  # pragma: no cover - interface
        raise NotImplementedError

    def attention_layers(self) -> list[nn.Module]:  # pragma: no cover - interface
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:  # pragma: no cover
        raise NotImplementedError


def load_stacked_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    rename: Callable[[str], str | None],
    stacked: dict[str, tuple[str, object]],
) -> None:
    """Copy checkpoint tensors into the model, fusing q/k/v and gate/up shards.

    Raises ValueError naming every parameter the checkpoint did not provide and every
    checkpoint tensor whose shape does not fit.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    shard_offsets = _shard_offsets(model)
    for hf_name, tensor in weights:
        name = rename(hf_name)
        if name is None:
            continue
        parts = name.split(".")
        target, shard = name, None
        if len(parts) >= 2 and parts[-2] in stacked:
            fused, shard = stacked[parts[-2]]
            target = ".".join(parts[:-2] + [fused, parts[-1]])
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {hf_name!r} does not belong to this model (no parameter {target!r})")
        with torch.no_grad():
            if shard is None:
                _check_shape(hf_name, param.shape, tensor.shape)
                param.copy_(tensor)
                loaded.add(target)
            else:
                start, size = shard_offsets[target.rsplit(".", 1)[0]][shard]
                dst = param.narrow(0, start, size)
                _check_shape(hf_name, dst.shape, tensor.shape)
                dst.copy_(tensor)
                loaded.add(f"{target}#{shard}")
    missing = []
    for name in params:
        module = name.rsplit(".", 1)[0]
        if module in shard_offsets:
            missing += [f"{name}#{s}" for s in shard_offsets[module] if f"{name}#{s}" not in loaded]
        elif name not in loaded:
            missing.append(name)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint is missing weights for: {shown}")


def _check_shape(name: str, want: torch.Size, got: torch.Size) -> None:
    if tuple(want) != tuple(got):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(got)}, the model expects {tuple(want)}")


def _shard_offsets(model: nn.Module) -> dict[str, dict[object, tuple[int, int]]]:
    """Row ranges of each shard inside the fused qkv_proj / gate_up_proj modules."""
    out: dict[str, dict[object, tuple[int, int]]] = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "qkv_proj":
            attn = model.get_submodule(name.rsplit(".", 1)[0])
            q, kv = attn.q_size, attn.kv_size
            out[name] = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}
        elif leaf == "gate_up_proj":
            i = module.out_features // 2
            out[name] = {0: (0, i), 1: (i, i)}
    return out

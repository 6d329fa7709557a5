"""The KV fingerprint: everything that makes two processes' KV bytes for the same tokens differ.

A storage tier shared by processes (files, Redis) names pages by a hash chain seeded with it
(block_manager/page_keys.py) and checks it in every stored value's header, so a process never
reads pages another configuration wrote: model identity (config.json and the weight files'
contents), dtype, the KV cache's element type (an FP8 cache's pages are other bytes than a
bfloat16 cache's for the same tokens), page size, each block space (name, compression, bytes per slot, window) and
its byte layout, and the tensor-parallel size (under tensor parallelism one stored value holds
a page of every rank's KV shard, so a page's identity is the group's, not one rank's).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

from hybridkv.block_manager.space_spec import SpaceSpec

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass(frozen=True)
class KVFingerprint:
    seed: bytes  # seeds the page key chains
    spaces: dict[str, str]  # space -> hex fingerprint carried in each stored value's header


def model_digest(model_dir: str) -> bytes:
    """SHA-256 over config.json and every weight file (name and contents), in name order."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(model_dir)):
        if name != "config.json" and not name.endswith(_WEIGHT_SUFFIXES):
            continue
        h.update(name.encode() + b"\0")
        with open(os.path.join(model_dir, name), "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.digest()


def kv_fingerprint(
    model_dir: str, dtype: str, page_size: int, specs: list[SpaceSpec], page_layout: dict[str, list],
    tp_size: int = 1, kv_dtype: str | None = None,
) -> KVFingerprint:
    """page_layout: space -> [(dtype, page slice shape)] of its tensors (HostKVCache.page_layout),
    one rank's; tp_size: the ranks whose shards a stored page holds, in rank order; kv_dtype: the
    KV pools' dtype (None: the model's, `dtype`)."""
    base = {
        "model": model_digest(model_dir).hex(), "dtype": dtype, "kv_dtype": kv_dtype or dtype,
        "page_size": page_size, "tp_size": tp_size,
        "spaces": [[s.name, s.tokens_per_slot, s.bytes_per_slot, s.window, s.ring, s.align, page_layout[s.name]] for s in specs],
    }
    seed = hashlib.sha256(json.dumps(base, sort_keys=True).encode()).digest()
    spaces = {s.name: hashlib.sha256(seed + s.name.encode()).hexdigest() for s in specs}
    return KVFingerprint(seed, spaces)

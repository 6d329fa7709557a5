"""Content keys of prefix pages, for a store shared across processes (HiCache L3).

A page's key is a SHA-256 chain: the root of a namespace is seeded with the KV fingerprint
(everything that makes KV bytes differ: model identity, dtype, page size, block spaces and
their layout, tensor-parallel size) and the namespace (cache salt); each page hashes its
parent's chain with its own token ids. So a key names one exact token prefix under one exact
configuration: a process with another dtype or page size computes other keys and never reads
this one's pages (SGLang #33268, #10969 served another configuration's KV for lack of this).
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Hashable, Sequence


def root_chain(seed: bytes, namespace: Hashable) -> bytes:
    return hashlib.sha256(b"hybridkv-prefix-root\0" + seed + b"\0" + repr(namespace).encode()).digest()


def next_chain(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def storage_key(chain: bytes, space: str) -> str:
    """The store key of one page of one block space (hex first: backends shard on it)."""
    return f"{chain.hex()}-{space}"

"""C++ attention kernels for the CPU, compiled on this machine on first use (build.py says how).

`indexer_topk` (indexer_topk.cpp) is DeepSeek-V4's lightning indexer fused: scoring, ReLU, head
sum and a running top-k in one pass over the keys read in place (hybrid_v4.cpu_indexer_topk
routes to it, with hybrid_v4.indexer_topk as its fallback and reference).

`joint_attention` (joint_attention.cpp) is DeepSeek-V4's joint softmax over [sliding-window keys |
compressed entries | sink] fused, keys read in place through their slots (hybrid_v4.cpu_joint_attention
routes to it, with the torch joint_softmax_attention / online_joint_attention as its fallback and
reference).

`paged_attention` (paged_attention.cpp) attends short query groups -- decodes, and short prefill
chunks after a prefix -- by reading K/V in place through the block table: no gather of every key
slot into a temporary, and no per-key slot list built on the host each step. The torch-only
path (attention_backends/torch_native.py's decode tiles) stays as the fallback and as the
reference the tests hold this kernel to. When there is no compiler, the build fails, or
HYBRIDKV_CPU_KERNELS=0 is set, `load_paged_attention()` returns None (logged once) and the
backend keeps the torch path. The same module has `write_kv`, the step's K/V rows into their
slots (`load_write_kv()`; index_copy_ is its fallback and reference).
"""
from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch

from hybridkv.attention_backends.cpu_kernels.build import ENV_SWITCH, build_cpu_extension, kernels_enabled

__all__ = ["AMX_TILES_HEADER", "ENV_SWITCH", "build_cpu_extension", "kernels_enabled", "load_indexer_topk", "load_joint_attention",
           "load_paged_attention", "load_paged_attention_module", "load_prefill_attention",
           "load_prefill_attention_bf16", "load_write_kv", "BF16_PREFILL_PRODUCTS"]


# The call both paged kernels take (checks and raw view), put in front of them by the loader.
_PAGED_GROUPS = Path(__file__).with_name("paged_groups.h")
# Tile configuration and the AMX permission check, for every kernel on the tile unit.
AMX_TILES_HEADER = Path(__file__).with_name("amx_tiles.h")


@functools.lru_cache(maxsize=1)
def load_paged_attention_module() -> ModuleType | None:
    """paged_attention.cpp compiled (`paged_attention`, `write_kv`, and `kernel_addresses` for
    model_executor's fused decode), or None when it cannot be built here; built once per process."""
    return build_cpu_extension("hybridkv_paged_attention", Path(__file__).with_name("paged_attention.cpp"),
                               ["paged_attention", "write_kv", "kernel_addresses"], "CPU paged-attention kernel",
                               headers=(_PAGED_GROUPS,))


def load_paged_attention() -> Callable[..., torch.Tensor] | None:
    """The compiled `paged_attention(q, k_cache, v_cache, block_table, group_start, group_row,
    positions, page_size, window, scale) -> out`, or None when it cannot be built here."""
    module = load_paged_attention_module()
    return None if module is None else module.paged_attention


def load_write_kv() -> Callable[..., None] | None:
    """The compiled `write_kv(k_cache, v_cache, slots, k, v)`: k_cache[h, slots[t]] = k[t, h] (and
    v), what two index_copy_ calls do, or None when it cannot be built here."""
    module = load_paged_attention_module()
    return None if module is None else module.write_kv


@functools.lru_cache(maxsize=1)
def load_indexer_topk() -> Callable[..., torch.Tensor] | None:
    """The compiled `indexer_topk(q, w, key_cache, slots, pages, slots_per_page, visible, length, k,
    scale) -> idx`, or None when it cannot be built here."""
    module = build_cpu_extension("hybridkv_indexer_topk", Path(__file__).with_name("indexer_topk.cpp"),
                                 ["indexer_topk"], "CPU lightning-indexer kernel")
    return None if module is None else module.indexer_topk


@functools.lru_cache(maxsize=1)
def load_joint_attention() -> Callable[..., torch.Tensor] | None:
    """The compiled `joint_attention(q, sinks, scale, caches, slots, masks, visibles) -> out`, or
    None when it cannot be built here."""
    module = build_cpu_extension("hybridkv_joint_attention", Path(__file__).with_name("joint_attention.cpp"),
                                 ["joint_attention"], "CPU joint-attention kernel")
    return None if module is None else module.joint_attention


@functools.lru_cache(maxsize=1)
def load_prefill_attention() -> Callable[..., torch.Tensor] | None:
    """The compiled `prefill_attention(q, k_cache, v_cache, block_table, group_start, group_row,
    positions, page_size, window, scale) -> out` (paged_attention's call, for long query groups;
    float32 / bfloat16, head size a multiple of the vector width), or None when it cannot be built
    here."""
    module = build_cpu_extension("hybridkv_prefill_attention", Path(__file__).with_name("prefill_attention.cpp"),
                                 ["prefill_attention"], "CPU prefill-attention kernel", headers=(_PAGED_GROUPS,))
    return None if module is None else module.prefill_attention


# The bf16 prefill kernel's two builds: the products' header, what the CPU needs (torch's probe),
# and the extra compiler flags. The first this CPU can run is the one the backend takes.
BF16_PREFILL_PRODUCTS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "amx": ("bf16_products_amx.h", "_is_amx_tile_supported", ("-mamx-tile", "-mamx-bf16", "-mavx512bf16")),
    "avx512_bf16": ("bf16_products_avx512.h", "_is_avx512_bf16_supported", ("-mavx512bf16",)),
}


@functools.lru_cache(maxsize=None)
def load_prefill_attention_bf16(products: str | None = None) -> Callable[..., torch.Tensor] | None:
    """The compiled `prefill_attention_bf16(...)` (load_prefill_attention's call, bfloat16 with
    both products on bf16 dot products, head size a multiple of 64 up to 256), or None where the
    CPU has no bf16 dot products, the process may not use them, or it cannot be built here.
    `products` picks a build ("amx": AMX tiles; "avx512_bf16": AVX512-BF16 vectors); None takes
    the first of BF16_PREFILL_PRODUCTS this CPU runs."""
    if products is None:
        return next(filter(None, map(load_prefill_attention_bf16, BF16_PREFILL_PRODUCTS)), None)
    header, probe_name, flags = BF16_PREFILL_PRODUCTS[products]
    probe = getattr(torch.cpu, probe_name, None)
    if probe is None or not probe():
        return None
    headers = (AMX_TILES_HEADER,) if products == "amx" else ()
    module = build_cpu_extension(f"hybridkv_prefill_attention_bf16_{products}",
                                 Path(__file__).with_name("prefill_attention_bf16.cpp"),
                                 ["prefill_attention_bf16", "products_available"],
                                 f"CPU bf16 prefill-attention kernel ({products})", extra_cflags=flags,
                                 headers=(*headers, Path(__file__).with_name(header), _PAGED_GROUPS))
    if module is None or not module.products_available():
        return None
    return module.prefill_attention_bf16

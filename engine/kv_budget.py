"""How much memory the KV cache may take by default, and the check that one sequence fits.

Both run from config.json and the flags alone, before the weights load: a budget that cannot
hold one max_model_len sequence is an error within a second of start, naming the flags to change,
not after a model load of minutes.

The default budget (kv_cache_memory_bytes=None) is what max_num_seqs full-length sequences need,
capped at a fraction of the memory the machine has available at start (HYBRIDKV_KV_CACHE_FRACTION,
default 0.25), and never below what one max_model_len sequence needs: a constant would be too much
for a laptop and too little for a server. Unless kv_cache_prefault is on, the pools behind it are
taken lazily on the CPU (model_executor/huge_pages.py kv_pool_on): the budget is a ceiling, and the
process holds the pages its requests write.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

from hybridkv.block_manager.kv_cache_manager import request_pages_needed
from hybridkv.block_manager.space_spec import SpaceSpec

FRACTION_VARIABLE = "HYBRIDKV_KV_CACHE_FRACTION"
DEFAULT_FRACTION = 0.25
# Where /proc/meminfo cannot be read (not Linux): a fixed cap.
FALLBACK_CAP_BYTES = 2 << 30


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (what the kernel can hand out without swapping), or None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def kv_cache_fraction() -> float:
    """HYBRIDKV_KV_CACHE_FRACTION (0 < f <= 1), default 0.25; anything else is an error naming it."""
    raw = os.environ.get(FRACTION_VARIABLE, "").strip()
    if not raw:
        return DEFAULT_FRACTION
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{FRACTION_VARIABLE}={raw!r} must be a number in (0, 1]")
    return value


def default_kv_cache_cap_bytes() -> int:
    """The most the default KV budget takes: a fraction of the memory available now."""
    available = available_memory_bytes()
    return FALLBACK_CAP_BYTES if available is None else int(kv_cache_fraction() * available)


def one_sequence_bytes(specs: Sequence[SpaceSpec], num_tokens: int, page_size: int, chunk_tokens: int,
                       prefix_caching: bool) -> int:
    """Bytes of KV one request of num_tokens holds at once, over every space."""
    need = request_pages_needed(specs, num_tokens, page_size, chunk_tokens, prefix_caching)
    return sum(need[s.name] * s.bytes_per_page(page_size) for s in specs)


def check_one_sequence_fits(specs: Sequence[SpaceSpec], pages: dict[str, int], page_size: int, max_model_len: int,
                            chunk_tokens: int, prefix_caching: bool, kv_cache_memory_bytes: int | None) -> None:
    """Raise ValueError, naming the flags, when the pages per space cannot hold one max_model_len
    sequence computed in chunks of chunk_tokens."""
    need = request_pages_needed(specs, max_model_len, page_size, chunk_tokens, prefix_caching)
    short = [f"{name} (needs {n} pages, has {pages[name]})" for name, n in need.items() if n > pages.get(name, 0)]
    if not short:
        return
    mib = one_sequence_bytes(specs, max_model_len, page_size, chunk_tokens, prefix_caching) / 2**20
    # Windowed spaces are sized for max_num_seqs decoding sequences first: fewer leaves more of
    # the budget to the whole-history spaces.
    seqs = ", --max-num-seqs" if any(s.windowed for s in specs) else ""
    raise ValueError(
        f"kv_cache_memory_bytes={kv_cache_memory_bytes} (--kv-cache-memory-bytes) holds fewer pages than one "
        f"max_model_len={max_model_len} sequence needs in block space(s) {', '.join(short)}; one such sequence "
        f"takes ~{mib:.0f} MiB of KV: raise --kv-cache-memory-bytes, or lower --max-model-len{seqs} "
        f"(or --max-num-batched-tokens)"
    )

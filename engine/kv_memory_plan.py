"""How the engine splits its KV memory: the page size, pages per block space on the device, the
host tier's pages, and HiSparse's share, all from the model's block spaces and the config.

Planned before the weights load (the model's skeleton: config.json on the meta device), so a
budget that cannot hold one sequence fails in a second (engine/kv_budget.py).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from hybridkv.block_manager.kv_cache_manager import windowed_live_pages
from hybridkv.block_manager.space_spec import SpaceSpec
from hybridkv.engine.config import DEFAULT_BLOCK_SIZE, EngineConfig, HiSparseConfig
from hybridkv.engine.hisparse_plan import HiSparsePlan
from hybridkv.engine.kv_budget import (
    FRACTION_VARIABLE, check_one_sequence_fits, default_kv_cache_cap_bytes, kv_cache_fraction, one_sequence_bytes,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVMemoryPlan:
    block_size: int
    max_num_batched_tokens: int
    device_pages: dict[str, int]  # pages per space the device budget pays for (HiSparse's mirror: its own)
    host_pages: dict[str, int] | None  # the host tier's pages per space (None: no host tier)
    hisparse: HiSparsePlan | None


def plan_kv_memory(config: EngineConfig, specs: list[SpaceSpec], model, max_model_len: int) -> KVMemoryPlan:
    """The whole plan, checked: one full-length sequence fits, or a ValueError names the flags."""
    block_size = choose_block_size(config.block_size, specs, model)
    budget_tokens = config.max_num_batched_tokens or max(2048, max_model_len)
    hisparse = None
    if config.enable_hisparse:
        layers = getattr(model, "hisparse_layers", lambda: None)()
        hisparse = HiSparsePlan.make(HiSparseConfig.parse(config.hisparse_config), layers, specs, block_size,
                                     config.max_num_seqs)
    device_pages = pages_per_space(config, specs, block_size, max_model_len, budget_tokens, hisparse)
    check_one_sequence_fits(specs, device_pages, block_size, max_model_len, budget_tokens,
                            config.enable_prefix_caching, config.kv_cache_memory_bytes)
    host_pages = (host_pages_per_space(config, specs, block_size, device_pages)
                  if config.enable_hierarchical_cache else None)
    plan = KVMemoryPlan(block_size, budget_tokens, device_pages, host_pages, hisparse)
    _log_budget(config, specs, plan, max_model_len)
    return plan


def _log_budget(config: EngineConfig, specs: list[SpaceSpec], plan: KVMemoryPlan, max_model_len: int) -> None:
    """The KV budget in the startup log: bytes, and tokens of context it holds."""
    P, pages = plan.block_size, plan.device_pages
    mirrored = plan.hisparse.space if plan.hisparse is not None else None
    total = sum(pages[s.name] * s.bytes_per_page(P) for s in specs if s.name != mirrored)
    total += plan.hisparse.device_bytes if plan.hisparse is not None else 0
    whole = [pages[s.name] for s in specs if not s.windowed] or list(pages.values())
    how = ("kv_cache_memory_bytes" if config.kv_cache_memory_bytes is not None else
           f"default: max_num_seqs={config.max_num_seqs} x max_model_len={max_model_len}, capped at "
           f"{kv_cache_fraction():g} of available memory ({FRACTION_VARIABLE})")
    taken = ("on huge pages, touched at start (kv_cache_prefault)" if config.kv_cache_prefault
             else "pages taken as they are written")
    logger.info("KV cache budget: %.0f MiB, %d tokens of context (%s); %s", total / 2**20, min(whole) * P, how, taken)


def log_kv_cache_bytes(allocated: dict[str, dict[str, int]]) -> None:
    """What was allocated for the KV cache, per tier and space (ModelRunner.kv_cache_bytes: the
    tensors' own sizes): the device line is what kv_cache_memory_bytes bounds; the host line
    holds HiSparse's c4 mirror and the host tier's (HiCache L2) pages."""
    logger.info("KV cache allocated: %s", describe_kv_cache_bytes(allocated))


def describe_kv_cache_bytes(allocated: dict[str, dict[str, int]]) -> str:
    """One line, MiB per tier and space, e.g. 'device 127.98 MiB (swa 36.75, ..., hot_buffer 1.05);
    host 535.00 MiB (c4 535.00)'."""
    parts = []
    for tier, spaces in allocated.items():
        each = ", ".join(f"{name} {n / 2**20:.2f}" for name, n in spaces.items())
        parts.append(f"{tier} {sum(spaces.values()) / 2**20:.2f} MiB" + (f" ({each})" if each else ""))
    return "; ".join(parts)


def choose_block_size(explicit: int | None, specs: list[SpaceSpec], model) -> int:
    """The page size: the user's explicit block_size, or the model's default when it is None.

    Page boundaries must be compression boundaries, so a page size must be a multiple of
    every space's tokens_per_slot (their lcm). An explicit size that is not is an error
    naming the sizes that work; it is never silently replaced (16 may be a deliberate choice).
    """
    ratios = sorted({s.tokens_per_slot for s in specs})
    step = math.lcm(*ratios)
    # A model may declare its page size (DeepSeek-V4: 128). Otherwise 16, rounded up to a
    # multiple of the ratios (dense models: ratio 1, so 16).
    default = getattr(model, "default_block_size", None) or -(-DEFAULT_BLOCK_SIZE // step) * step
    if default % step:  # a model bug: its declared page size contradicts its own spaces
        raise RuntimeError(f"the model's default page size {default} is not a multiple of {ratios}")
    if explicit is None:
        return default
    if explicit % step:
        valid = ", ".join(str(step * k) for k in range(1, 4))
        raise ValueError(
            f"block_size {explicit} is not a multiple of this model's compression ratios {ratios}: page "
            f"boundaries must be compression boundaries; use a multiple of {step} ({valid}, ...; "
            f"this model's default is {default}) or leave block_size unset for the default"
        )
    return explicit


def windowed_space_caps(specs: list[SpaceSpec], page_size: int, max_num_seqs: int, max_chunk_tokens: int,
                        prefix_caching: bool) -> dict[str, int]:
    """Most pages each windowed space needs (pages_per_space): one sequence computing a prefill
    chunk of max_chunk_tokens with its window, every other one its decode window."""
    decode = windowed_live_pages(specs, 1, page_size, prefix_caching)
    chunk = windowed_live_pages(specs, max_chunk_tokens, page_size, prefix_caching)
    return {name: (max_num_seqs - 1) * decode[name] + chunk[name] for name in decode}


def pages_per_space(config: EngineConfig, specs: list[SpaceSpec], page_size: int, max_model_len: int,
                    max_chunk_tokens: int, hisparse: HiSparsePlan | None = None) -> dict[str, int]:
    """Split the KV memory between spaces by bytes per token of context.

    Whole-history spaces (full, c4, c128, indexer) all get n pages (n pages cover n*P
    tokens of history in each). A windowed space (swa, state_*) gets room for one sequence
    computing a prefill chunk of max_chunk_tokens (with its window) while every other one
    decodes (kv_cache_manager.windowed_live_pages: the window, plus a page where its start
    can fall inside one; with prefix caching, the widest window's), and never more than
    n + max_num_seqs pages; n is the largest count for which everything fits in the budget.
    Sized for decode, not for every sequence prefilling at once: a step whose several
    prefill chunks need more takes the scheduler's usual shortage path (preempt the
    newest); short prompts fit in their decode window, so only several long chunks in one
    step can get there.

    HiSparse (engine/hisparse_plan.py): the c4 space is the host mirror, outside the device
    budget, which pays the hot buffers instead. The budget then bounds every byte the device
    holds for KV: the hot buffers with their slot tables and each device space's null page come
    out of it before the pages are split.
    """
    P = page_size
    seqs = config.max_num_seqs
    mirror = [s for s in specs if hisparse is not None and s.name == hisparse.space]
    specs = [s for s in specs if s not in mirror]
    whole = [s for s in specs if not s.windowed]
    windowed = [s for s in specs if s.windowed]
    cap = windowed_space_caps(windowed, P, seqs, max_chunk_tokens, config.enable_prefix_caching)
    whole_bpp = sum(s.bytes_per_page(P) for s in whole)

    def cost(n: int) -> int:
        return n * whole_bpp + sum(min(n + seqs, cap[s.name]) * s.bytes_per_page(P) for s in windowed)

    budget = config.kv_cache_memory_bytes
    n_default = -(-seqs * (max_model_len + P) // P)
    nulls = sum(s.bytes_per_page(P) for s in specs)
    reserved = hisparse.device_bytes + nulls if hisparse is not None else 0
    if budget is None:  # engine/kv_budget.py: never below one full-length sequence
        one = one_sequence_bytes(specs, max_model_len, P, max_chunk_tokens, config.enable_prefix_caching)
        budget = min(cost(n_default) + reserved, max(default_kv_cache_cap_bytes(), one + reserved))
    if hisparse is not None:
        budget -= reserved
        if budget <= 0:
            raise ValueError(
                f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} does not hold the HiSparse hot "
                f"buffers ({hisparse.device_bytes} bytes: max_num_seqs={seqs} x hot_buffer_size="
                f"{hisparse.hot_buffer_size} entries, with their slot tables) and the device spaces' "
                f"null pages ({nulls} bytes); raise it or lower max_num_seqs")
    if not whole:  # every space is windowed (e.g. Mistral): they share the whole budget
        n = max(1, budget // sum(s.bytes_per_page(P) for s in specs))
        if config.kv_cache_memory_bytes is None:
            n = min(n, max(cap.values()))
        return {s.name: n for s in specs}
    lo, hi = 1, max(1, budget // whole_bpp)
    while lo < hi:  # largest n with cost(n) <= budget (cost is monotone in n)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cost(mid) <= budget else (lo, mid - 1)
    pages = {s.name: lo for s in whole}
    pages.update({s.name: max(1, min(lo + seqs, cap[s.name])) for s in windowed})
    for s in mirror:
        limit = hisparse.mirror_pages(s.bytes_per_page(P))
        pages[s.name] = lo if limit is None else min(lo, limit)
    return pages


def host_pages_per_space(config: EngineConfig, specs: list[SpaceSpec], page_size: int,
                         device_pages: dict[str, int]) -> dict[str, int]:
    """Host pages: the same count in every space (a node keeps at most one page per space, so
    windowed spaces need as many host pages as whole-history ones for every cached node to
    keep its window), hicache_ratio x the whole-history device pages, or what hicache_size
    bytes hold."""
    P = page_size
    if config.hicache_size is not None:
        per_page = sum(s.bytes_per_page(P) for s in specs)
        n = config.hicache_size // per_page
        if n < 1:
            raise ValueError(f"hicache_size={config.hicache_size} bytes holds no page "
                             f"(one page of every space takes {per_page} bytes)")
        return {s.name: n for s in specs}
    whole = [device_pages[s.name] for s in specs if not s.windowed] or list(device_pages.values())
    n = max(1, int(config.hicache_ratio * max(whole)))
    return {s.name: n for s in specs}

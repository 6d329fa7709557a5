"""HiSparse's hot-buffer swap-in as one Triton kernel: one program per buffer row.

Same decision as hisparse_buffers.py's HotBuffers.assign (which is the reference), done where
the buffers live instead of as a dozen torch ops per layer (SGLang fuses the same steps):

  1. hits     each requested entry is compared with the row's `size` held entries;
  2. victims  every slot's rank in (LRU key, slot index) order, where the key is -1 for an
              empty slot, the slot's last use otherwise, and +inf for a slot holding a hit;
              the j-th miss (in column order) takes the slot of rank j;
  3. slot map the placed entries and the step's clock are written into the row's entry /
              last-use tables (in place: HotBuffers' own tensors);
  4. copy     each miss's vector is copied from the source (the mirror, or the step's new
              entries) into its buffer slot -- when the source is on the buffers' device. The
              mirror lives in host memory on CUDA: then the kernel skips the copy and the misses
              are gathered on the host and moved in one transfer (host_mirror.gather_rows).

The copy stores the torch swap-in's bytes. A source in the buffer's dtype (the mirror: a pool of
the cache's dtype) is copied as it is, FP8 as raw bytes; a source in another dtype (the
compressor's new entries, in the model dtype, into FP8 buffers) is converted by torch first, as
the torch path converts it (kv_cache_dtype.quantize_kv), since a cast inside the kernel rounds
and saturates differently. Such a source holds only one step's new entries, so converting all
of it costs little.

Rows are distinct within a call, so the programs never write the same table row or slot. The
rank step compares every pair of a row's slots, SLOT_BLOCK x SLOT_BLOCK at a time: O(size^2)
comparisons per row instead of the reference's O(size log size) sort, but all of them in one
program with no host round trip (size is 2-4x top-k: ~1-2k slots for V4). Checked against the
reference on CPU tensors under TRITON_INTERPRET=1 (tests/attention_backends/
test_triton_hisparse_swap_in.py) and on CUDA by benchmarks/gpu_check.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.attention_backends.hisparse_buffers import NO_ENTRY, HotBuffers
from hybridkv.attention_backends.host_mirror import crosses, gather_rows
from hybridkv.attention_backends.kv_cache_dtype import byte_view, quantize_kv, store_rows

# Sort key of a slot holding a hit (never a victim), and of the block's padding beyond `size`.
_PROTECTED = tl.constexpr(1 << 62)
_PADDING = tl.constexpr((1 << 62) + 1)
SLOT_BLOCK = 128  # buffer slots per block of the kernel's loops (the rank step is blocks x blocks)


@triton.jit
def _slot_keys(entry_ptr, used_ptr, base, ss, S, req, valid):
    """Victim-order keys of slots ss: -1 empty, else the last use; a slot holding a requested
    entry is protected; padding past S sorts last."""
    s_in = ss < S
    held = tl.load(entry_ptr + base + ss, mask=s_in, other=-1)
    used = tl.load(used_ptr + base + ss, mask=s_in, other=0)
    hit = tl.max(((req[:, None] == held[None, :]) & valid[:, None]).to(tl.int32), axis=0) > 0
    key = tl.where(held == -1, -1, used)
    key = tl.where(hit, _PROTECTED, key)
    return tl.where(s_in, key, _PADDING)


@triton.jit
def _swap_in_kernel(
    entry_ptr, used_ptr,  # [max_requests, S] this layer's tables (int64), updated in place
    rows_ptr, req_ptr, mslot_ptr,  # [n], [n, K], [n, K]
    hot_ptr, mirror_ptr, hot_stride, mirror_stride,
    slots_out_ptr, found_out_ptr,  # [n, K] global buffer slots, [n, K] hit flags
    clock, K, S, D,
    BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, COPY: tl.constexpr,
):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i)
    base = row * S
    ks = tl.arange(0, BLOCK_K)
    k_in = ks < K
    req = tl.load(req_ptr + i * K + ks, mask=k_in, other=-1)
    valid = req != -1
    # 1. hits: a valid request equals at most one held entry (a row holds each entry once).
    found = tl.zeros([BLOCK_K], dtype=tl.int32)
    hit_slot = tl.zeros([BLOCK_K], dtype=tl.int64)
    for s0 in range(0, S, BLOCK_S):
        ss = s0 + tl.arange(0, BLOCK_S)
        held = tl.load(entry_ptr + base + ss, mask=ss < S, other=-1)
        eq = (req[:, None] == held[None, :]) & valid[:, None] & (ss < S)[None, :]
        found = tl.maximum(found, tl.max(eq.to(tl.int32), axis=1))
        hit_slot += tl.sum(tl.where(eq, ss[None, :], 0), axis=1)
    missed = valid & (found == 0)
    miss_rank = tl.cumsum(missed.to(tl.int32), axis=0) - 1
    # 2. victims: every slot's rank in (key, index) order -- a stable argsort, as the reference --
    # block against block; the j-th miss takes the slot of rank j.
    victim = tl.zeros([BLOCK_K], dtype=tl.int64)
    for a0 in range(0, S, BLOCK_S):
        sa = a0 + tl.arange(0, BLOCK_S)
        key_a = _slot_keys(entry_ptr, used_ptr, base, sa, S, req, valid)
        rank = tl.zeros([BLOCK_S], dtype=tl.int32)
        for b0 in range(0, S, BLOCK_S):
            sb = b0 + tl.arange(0, BLOCK_S)
            key_b = _slot_keys(entry_ptr, used_ptr, base, sb, S, req, valid)
            ahead = (key_b[None, :] < key_a[:, None]) | ((key_b[None, :] == key_a[:, None]) & (sb[None, :] < sa[:, None]))
            rank += tl.sum(ahead.to(tl.int32), axis=1)
        pick = (rank[None, :] == miss_rank[:, None]) & missed[:, None]
        victim += tl.sum(tl.where(pick, sa[None, :], 0), axis=1)
    slot = tl.where(found > 0, hit_slot, victim)
    # 3. slot map: every placed slot holds its entry and becomes the most recently used.
    tl.store(entry_ptr + base + slot, req, mask=valid)
    tl.store(used_ptr + base + slot, tl.zeros_like(req) + clock, mask=valid)
    glob = tl.where(valid, 1 + base + slot, 0)
    tl.store(slots_out_ptr + i * K + ks, glob, mask=k_in)
    tl.store(found_out_ptr + i * K + ks, found.to(tl.int8), mask=k_in)
    # 4. copy the misses in from the source (when it is on this device): same dtype, a plain copy.
    if COPY:
        msl = tl.load(mslot_ptr + i * K + ks, mask=k_in, other=0)
        for d0 in range(0, D, BLOCK_D):
            ds = d0 + tl.arange(0, BLOCK_D)
            m2 = missed[:, None] & (ds < D)[None, :]
            v = tl.load(mirror_ptr + msl[:, None] * mirror_stride + ds[None, :], mask=m2)
            tl.store(hot_ptr + glob[:, None] * hot_stride + ds[None, :], v, mask=m2)


def triton_swap_in(buffers: HotBuffers, layer: int, rows: torch.Tensor, entries: torch.Tensor, hot: torch.Tensor,
                   source: torch.Tensor, source_slots: torch.Tensor, insert: bool = False) -> torch.Tensor:
    """hisparse_reads.swap_in with the decision, the slot-map update and (from a source on the
    buffers' device) the copy in one kernel; the lookups and hits are then counted by
    HotBuffers.account as for the torch path. A source on another device (the host mirror) is
    read by one host gather of the misses after the kernel."""
    n, k = entries.shape
    S = buffers.size
    if k > S:
        raise ValueError(f"{k} entries at once do not fit a hot buffer of {S}")
    if n == 0 or k == 0:
        return torch.zeros(n, k, dtype=torch.long, device=entries.device)
    if len({buffers.entry.device, hot.device, entries.device}) > 1:
        raise ValueError("HiSparse's slot tables, the hot buffer and the selection must be on one device "
                         f"(got tables on {buffers.entry.device}, hot buffer on {hot.device}, selection on "
                         f"{entries.device})")
    copy_here = not crosses(source, hot)
    if hot.stride(1) != 1 or (copy_here and source.stride(1) != 1):
        raise ValueError("the hot buffer and the source must have unit stride along the entry vector")
    entries = entries.to(torch.long).contiguous()
    source_slots = source_slots.to(torch.long).contiguous()
    kernel_slots = source_slots.to(hot.device) if copy_here else source_slots.new_zeros(0).to(hot.device)
    rows = rows.to(device=entries.device, dtype=torch.long).contiguous()
    table, last_use = buffers.entry[layer], buffers.last_use[layer]  # views: the kernel updates them in place
    slots = torch.empty(n, k, dtype=torch.long, device=entries.device)
    found = torch.empty(n, k, dtype=torch.int8, device=entries.device)
    D = hot.shape[1]
    if copy_here:  # the step's new entries (model dtype), as the buffer stores them; the mirror as it is
        source = quantize_kv(source, hot.dtype)
    dst = byte_view(hot)  # FP8 moves as bytes (the kernel copies, it never converts)
    src = byte_view(source) if copy_here else dst  # not read without COPY
    _swap_in_kernel[(n,)](
        table, last_use, rows, entries, kernel_slots, dst, src, dst.stride(0), src.stride(0), slots, found,
        buffers.tick(), k, S, D,
        BLOCK_K=triton.next_power_of_2(k), BLOCK_S=min(SLOT_BLOCK, triton.next_power_of_2(S)),
        BLOCK_D=min(64, triton.next_power_of_2(D)), COPY=copy_here,
    )
    valid, hit = entries != NO_ENTRY, found.bool()
    if not copy_here:
        missed = valid & ~hit
        if bool(missed.any()):
            store_rows(hot, slots[missed], gather_rows(source, source_slots[missed.to(source_slots.device)], hot))
    buffers.account(rows, valid, hit, insert)
    return slots

"""HostKVCache: the host (CPU RAM) pages of the HiCache tier and the batched page copies
between them and the device KV tensors.

The block manager decides which pages move (a TierTransfers); this class owns the host tensors
and executes the copies. A space's device tensors are whatever the model's allocate_kv_cache
returned for it; in each, the slot dimension is dim -2 and slot s belongs to page
s // slots_per_page, so `t.unflatten(-2, (num_pages, slots_per_page))` is a view whose dim -3
is the page: one index_select gathers any set of pages and one index_copy_ scatters them.

Layouts of the host buffer:
  page_first (default): per space one uint8 tensor [host_pages, bytes_per_page]; a page's bytes
    for every tensor of the space (all layers) are one contiguous row, tensor after tensor in
    list order, each tensor's page slice in C order. A page moves as one contiguous host row
    (one large DMA, one row gather/scatter on the CPU) instead of one small strided piece per
    layer: the layout that doubled SGLang's host I/O.
  layer_first: per device tensor a host tensor of the same dtype and shape, with
    host_pages * slots_per_page slots on dim -2 (mirrors the device; simple, but a page is
    scattered over every layer's tensor).

Ordering contract (block_manager/kv_plan.py): apply() runs every device->host copy of
every space before any host->device copy, so a device page queued for the host and then reused
by a load-back in the same pass is read before it is overwritten. The host->device copies are
handed to a PendingKVLoads (kv_loads.py) one layer unit at a time -- a unit is index j along dim
0 of a device tensor (a layer of a dense model's [layers, 2, Hkv, slots, D] pool; a whole tensor
when it has no such dim) -- so the forward waits for each layer's pages only when that layer
reads: issued at once on a CUDA side stream, deferred until the first reader on the CPU.
take_loads() hands them to the runner; anything else that touches device KV first calls
finish_loads() (apply does). Host page ids are
0..host_pages-1, all usable (the host has no null page); device page 0 is the device null page
and is never a copy source or target.

An FP8 KV cache (kv_cache_dtype) moves as the bytes it stores: FP8 tensors are scattered as
uint8 views (torch has no index_copy_ for FP8), so a page loaded back is bit for bit the page
written out.
"""
from __future__ import annotations

import torch

from hybridkv.attention_backends.kv_cache_dtype import byte_view
from hybridkv.block_manager.space_spec import NULL_PAGE
from hybridkv.block_manager.kv_plan import TierTransfers
from hybridkv.model_executor.kv_loads import PendingKVLoads

LAYOUTS = ("page_first", "layer_first")


class HostKVCache:
    """Host pages for the spaces named in host_pages, and apply() to execute a TierTransfers."""

    def __init__(
        self,
        device_caches: dict[str, list[torch.Tensor]],
        slots_per_page: dict[str, int],
        host_pages: dict[str, int],
        layout: str = "page_first",
        pin_memory: bool = False,
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"unknown host KV layout {layout!r}; use one of {', '.join(map(repr, LAYOUTS))}")
        self.layout = layout
        # Pinning needs a CUDA driver (torch raises without one); on CPU-only builds there is no
        # DMA to speed up, so the request is moot.
        self.pinned = pin_memory and torch.cuda.is_available()
        self.device_caches = {name: list(ts) for name, ts in device_caches.items()}
        self.slots_per_page: dict[str, int] = {}
        self.host_pages: dict[str, int] = {}
        self.num_pages: dict[str, int] = {}  # device pages per space, the null page included
        self.bytes_per_page: dict[str, int] = {}
        self._tensor_bytes: dict[str, list[int]] = {}  # one page's bytes in each device tensor
        # page_first: [one uint8 tensor]; layer_first: one tensor per device tensor.
        self.host: dict[str, list[torch.Tensor]] = {}
        self.page_layout: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
        for name, n in host_pages.items():
            self._add_space(name, self.device_caches.get(name), slots_per_page.get(name), n)
        self.nbytes = sum(h.numel() * h.element_size() for hs in self.host.values() for h in hs)
        first = next((ts[0] for ts in self.device_caches.values() if ts), None)
        self.device = first.device if first is not None else torch.device("cpu")
        # The side stream load-backs are copied on (CUDA): the forward overlaps with them.
        self.load_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._pending: PendingKVLoads | None = None
        self.load_seconds = 0.0  # host seconds in load-back copies (deferred ones included)

    def _add_space(self, name: str, tensors: list[torch.Tensor] | None, spp: int | None, n: int) -> None:
        if not tensors:
            raise ValueError(f"space {name!r} has host pages but no device tensors")
        if not spp or spp < 1:
            raise ValueError(f"space {name!r} needs a positive slots_per_page, got {spp!r}")
        if n < 0:
            raise ValueError(f"space {name!r}: host_pages must be >= 0, got {n}")
        pages = set()
        for t in tensors:
            if t.dim() < 2 or t.shape[-2] % spp:
                raise ValueError(
                    f"space {name!r}: tensor of shape {tuple(t.shape)} has no slot dim -2 divisible by {spp}"
                )
            pages.add(t.shape[-2] // spp)
        if len(pages) != 1:
            raise ValueError(f"space {name!r}: its tensors disagree on the number of pages {sorted(pages)}")
        num_pages = pages.pop()
        tensor_bytes = [t.numel() // num_pages * t.element_size() for t in tensors]
        if self.layout == "page_first":
            host = [torch.empty(n, sum(tensor_bytes), dtype=torch.uint8, pin_memory=self.pinned)]
        else:
            host = [
                torch.empty(*t.shape[:-2], n * spp, t.shape[-1], dtype=t.dtype, pin_memory=self.pinned)
                for t in tensors
            ]
        self.slots_per_page[name], self.host_pages[name], self.num_pages[name] = spp, n, num_pages
        self._tensor_bytes[name], self.bytes_per_page[name] = tensor_bytes, sum(tensor_bytes)
        # What one page's bytes are, tensor after tensor: (dtype, shape of its page slice). The
        # same for both layouts (read_pages/write_pages speak page_first order).
        self.page_layout[name] = [
            (str(t.dtype), tuple(t.shape[:-2]) + (spp, t.shape[-1])) for t in tensors
        ]
        self.host[name] = host

    # -- copies ------------------------------------------------------------------------------
    def apply(self, transfers: TierTransfers, defer_loads: bool = False) -> tuple[int, int]:
        """Execute every to_host copy, then every to_device copy (the TierTransfers contract).
        defer_loads=True hands the to_device copies to the next forward instead (take_loads():
        it waits for them layer by layer; finish_loads() completes them otherwise). Returns
        (bytes copied to the host, bytes loaded to the device). Everything is validated first,
        so a bad page id raises before any page moves."""
        self._validate(transfers)
        self.finish_loads()  # earlier loads land before these pages are read or reused
        to_host = to_device = 0
        for name, pairs in transfers.to_host.items():
            if pairs:
                self._to_host(name, list(pairs), list(pairs.values()))
                to_host += len(pairs) * self.bytes_per_page[name]
        for name, pairs in transfers.to_device.items():
            if pairs:
                if self._pending is None:
                    self._pending = PendingKVLoads(self.device, self.load_stream)
                self._to_device(name, list(pairs.values()), list(pairs), self._pending)
                to_device += len(pairs) * self.bytes_per_page[name]
        if not defer_loads:
            self.finish_loads()
        return to_host, to_device

    @property
    def has_pending_loads(self) -> bool:
        """Load-backs issued that no forward has taken yet."""
        return self._pending is not None

    def take_loads(self) -> PendingKVLoads | None:
        """The load-backs the next forward must wait for, layer by layer (None: none). The
        caller completes them after the forward with loads_done()."""
        loads, self._pending = self._pending, None
        return loads

    def loads_done(self, loads: PendingKVLoads) -> None:
        loads.finish()
        self.load_seconds += loads.copy_seconds

    def finish_loads(self) -> None:
        """Complete load-backs no forward took (before anything else reads device KV)."""
        if self._pending is not None:
            loads, self._pending = self._pending, None
            self.loads_done(loads)

    def _validate(self, transfers: TierTransfers) -> None:
        checks = [(name, list(pairs), list(pairs.values())) for name, pairs in transfers.to_host.items()]
        checks += [(name, list(pairs.values()), list(pairs)) for name, pairs in transfers.to_device.items()]
        for name, host_ids, dev_ids in checks:
            if not host_ids:
                continue
            if name not in self.host:
                raise ValueError(f"space {name!r} has no host pages (host spaces: {sorted(self.host)})")
            n_host, n_dev = self.host_pages[name], self.num_pages[name]
            for h in host_ids:
                if not 0 <= h < n_host:
                    raise ValueError(f"space {name!r}: host page {h} outside [0, {n_host})")
            for d in dev_ids:
                if not NULL_PAGE < d < n_dev:
                    raise ValueError(
                        f"space {name!r}: device page {d} outside [{NULL_PAGE + 1}, {n_dev})"
                        " (page 0 is the device null page)"
                    )

    def _index(self, ids: list[int], device: torch.device) -> torch.Tensor:
        idx = torch.tensor(ids, dtype=torch.long)
        if device.type == "cpu":
            return idx
        return (idx.pin_memory() if self.pinned else idx).to(device, non_blocking=self.pinned)

    def _paged(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """[..., pages, slots_per_page, last] view of a slot-on-dim--2 tensor (a split is a view)."""
        spp = self.slots_per_page[name]
        return t.unflatten(-2, (t.shape[-2] // spp, spp))

    def _to_host(self, name: str, host_ids: list[int], dev_ids: list[int]) -> None:
        """One gather per device tensor; the page rows are read back synchronously, since the
        CPU-side scatter that follows needs them (and the device may reuse the pages next)."""
        host_idx = torch.tensor(host_ids, dtype=torch.long)
        k = len(host_ids)
        tensors = self.device_caches[name]
        dev_idx = self._index(dev_ids, tensors[0].device)  # once per space, not per tensor
        if self.layout == "page_first":
            rows = []
            for t in tensors:
                pd = t.dim() - 2
                g = self._paged(t, name).index_select(pd, dev_idx.to(t.device))
                rows.append(g.movedim(pd, 0).contiguous().view(torch.uint8).reshape(k, -1))
            # One device->host transfer for the whole space, one scatter of contiguous rows.
            data = (rows[0] if len(rows) == 1 else torch.cat(rows, dim=1)).to("cpu")
            self.host[name][0].index_copy_(0, host_idx, data)
        else:
            for t, h in zip(tensors, self.host[name]):
                pd = t.dim() - 2
                g = self._paged(t, name).index_select(pd, dev_idx.to(t.device))
                byte_view(self._paged(h, name)).index_copy_(pd, host_idx, byte_view(g.to("cpu")))

    def _to_device(self, name: str, host_ids: list[int], dev_ids: list[int], loads: PendingKVLoads) -> None:
        """One load unit per layer slice of each device tensor (see the module docstring): a
        host gather of the pages' bytes for that slice (into pinned staging when pinned, so the
        upload is asynchronous on the load stream) and one scatter into the device pages."""
        host_idx = torch.tensor(host_ids, dtype=torch.long)
        dev_idx_cpu = torch.tensor(dev_ids, dtype=torch.long)
        on_device: dict[torch.device, torch.Tensor] = {}

        def dev_idx(device: torch.device) -> torch.Tensor:  # moved once per space and device, in-stream
            if device not in on_device:
                on_device[device] = self._index(dev_ids, device) if device.type != "cpu" else dev_idx_cpu
            return on_device[device]

        if self.layout == "page_first":
            off = 0
            for t, nbytes in zip(self.device_caches[name], self._tensor_bytes[name]):
                units = _layer_units(t)
                ub = nbytes // len(units)  # a unit's bytes of one page: contiguous in the page row
                for j, unit in enumerate(units):
                    rows = self.host[name][0][:, off + j * ub : off + (j + 1) * ub]
                    loads.add(unit, lambda unit=unit, rows=rows: self._load_rows(name, unit, rows, host_idx, dev_idx))
                off += nbytes
        else:
            for t, h in zip(self.device_caches[name], self.host[name]):
                for unit, hu in zip(_layer_units(t), _layer_units(h)):
                    loads.add(unit, lambda unit=unit, hu=hu: self._load_layer_first(name, unit, hu, host_idx, dev_idx))

    def _load_rows(self, name: str, unit: torch.Tensor, rows: torch.Tensor, host_idx: torch.Tensor, dev_idx) -> None:
        """page_first: the unit's bytes of the pages host_idx ([k, unit bytes] once gathered),
        scattered into its device pages."""
        data = self._host_gather(rows, 0, host_idx, unit.device)
        pd = unit.dim() - 2
        paged = self._paged(unit, name)
        page_shape = paged.shape[:pd] + paged.shape[pd + 1 :]
        src = data.contiguous().view(unit.dtype).view(len(host_idx), *page_shape).movedim(0, pd)
        byte_view(paged).index_copy_(pd, dev_idx(unit.device), byte_view(src))

    def _load_layer_first(self, name: str, unit: torch.Tensor, hu: torch.Tensor, host_idx: torch.Tensor,
                          dev_idx) -> None:
        pd = unit.dim() - 2
        src = self._host_gather(self._paged(hu, name), pd, host_idx, unit.device)
        byte_view(self._paged(unit, name)).index_copy_(pd, dev_idx(unit.device), byte_view(src))

    def _host_gather(self, h: torch.Tensor, dim: int, idx: torch.Tensor, device: torch.device) -> torch.Tensor:
        """index_select of host pages, moved to `device` (asynchronously from pinned staging)."""
        if device.type == "cpu":
            return h.index_select(dim, idx)
        shape = list(h.shape)
        shape[dim] = len(idx)
        staging = torch.empty(shape, dtype=h.dtype, pin_memory=self.pinned)
        torch.index_select(h, dim, idx, out=staging)
        # The caching host allocator keeps pinned staging alive until the copy's stream is done.
        return staging.to(device, non_blocking=self.pinned)

    # -- whole pages as bytes (the storage tier's values) ---------------------------------------------
    def read_pages(self, name: str, host_ids: list[int]) -> list[bytes]:
        """The bytes of host pages (every tensor of the space, in page_first order whatever the
        layout), one bytes object per page: what a storage tier stores."""
        if not host_ids:
            return []
        idx = torch.tensor(host_ids, dtype=torch.long)
        if self.layout == "page_first":
            rows = self.host[name][0].index_select(0, idx)
        else:
            parts = []
            for h in self.host[name]:
                pd = h.dim() - 2
                g = self._paged(h, name).index_select(pd, idx)
                parts.append(g.movedim(pd, 0).contiguous().view(torch.uint8).reshape(len(host_ids), -1))
            rows = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return [bytes(r.numpy().data) for r in rows]

    def write_pages(self, name: str, host_ids: list[int], pages: list[bytes]) -> None:
        """Fill host pages from bytes read_pages produced (a storage tier's read lands here)."""
        if not host_ids:
            return
        nbytes = self.bytes_per_page[name]
        if any(len(p) != nbytes for p in pages):
            raise ValueError(f"space {name!r}: a page must be {nbytes} bytes")
        idx = torch.tensor(host_ids, dtype=torch.long)
        data = torch.frombuffer(bytearray(b"".join(pages)), dtype=torch.uint8).view(len(pages), nbytes)
        if self.layout == "page_first":
            self.host[name][0].index_copy_(0, idx, data)
            return
        off = 0
        for h, tb in zip(self.host[name], self._tensor_bytes[name]):
            pd = h.dim() - 2
            paged = self._paged(h, name)
            page_shape = paged.shape[:pd] + paged.shape[pd + 1 :]
            src = data[:, off : off + tb].contiguous().view(h.dtype).view(len(pages), *page_shape).movedim(0, pd)
            byte_view(paged).index_copy_(pd, idx, byte_view(src))
            off += tb


def _layer_units(t: torch.Tensor) -> list[torch.Tensor]:
    """The slices one load unit covers: index j along dim 0 when the tensor has a dim before
    [..., slots, last] (a dense pool's layer), else the whole tensor."""
    return list(t.unbind(0)) if t.dim() >= 3 else [t]

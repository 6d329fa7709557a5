"""PendingKVLoads: a step's host -> device page copies (HiCache load-back), waited for layer by layer.

A load-back copies a prefix's pages from the host tier into device pages before the forward
reads them. Copying everything first and only then starting the forward serialises the two;
SGLang overlaps them: the copies run layer by layer on a side stream and layer i's attention
waits only for its own pages (its layer-done counter). Here the host tier (host_kv_cache.py)
hands each copy to this object as a *unit* -- one layer's slice of one space tensor -- and every
reader of the KV cache calls `wait(tensors)` before it reads: the attention backends on the
cache tensors they are given, DeepSeek-V4's layers on their layer's caches.

  CUDA: each unit's copy is issued on a side stream at once, followed by an event; wait() makes
        the current stream wait on the events of the units the tensors overlap, so layer i's
        kernels start as soon as layer i's pages are in, while later layers still copy.
  CPU:  each unit's copy is deferred until the first wait() on memory it writes. Nothing runs
        concurrently on the CPU, so there is no overlap to win, but the mechanism is the same:
        a reader that forgot to wait reads stale pages and the outputs differ, which the exactness
        tests of the host tier catch -- the CPU twin that checks the waits a GPU relies on.

finish() completes whatever no reader waited for (after the forward, and before anything else
reads or copies device KV: the next tier copies). Units are matched to tensors by the device
bytes they write, so any view of a space tensor (a layer's K or V slice) finds its units.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import Callable

import torch


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) device bytes a tensor view covers (its strides' extent)."""
    start = t.data_ptr()
    if t.numel() == 0:
        return start, start
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0) + 1
    return start, start + extent * t.element_size()


@dataclass
class _Unit:
    start: int
    end: int
    copy: Callable[[], None] | None  # CPU: the deferred copy (None once it ran)
    event: object | None  # CUDA: recorded on the load stream after the copy
    waited: bool = False


class PendingKVLoads:
    def __init__(self, device: torch.device, stream: object | None = None) -> None:
        """stream: the CUDA side stream the copies run on (CUDA devices only)."""
        self.device = torch.device(device)
        self.stream = stream
        # Host seconds spent in the copies: the deferred CPU copies themselves; on CUDA, issuing
        # them (the transfers run asynchronously).
        self.copy_seconds = 0.0
        self._units: list[_Unit] = []
        self._starts: list[int] = []  # sorted unit starts (units never overlap)
        self.num_waits = 0  # units a reader waited for (the rest complete in finish)
        if self.device.type == "cuda" and stream is not None:
            # The pages being filled were freed by earlier work on the compute stream.
            stream.wait_stream(torch.cuda.current_stream(self.device))

    @property
    def empty(self) -> bool:
        return not self._units

    @property
    def num_units(self) -> int:
        return len(self._units)

    @property
    def num_done(self) -> int:
        """Units whose copies have run (waited for by a reader, or completed by finish)."""
        return sum(u.waited for u in self._units)

    def add(self, target: torch.Tensor, copy: Callable[[], None]) -> None:
        """A copy that writes (only) into `target`'s memory: issued now on CUDA, deferred on CPU."""
        start, end = byte_span(target)
        i = bisect.bisect_left(self._starts, start)
        if (i < len(self._units) and self._units[i].start < end) or (i > 0 and self._units[i - 1].end > start):
            raise AssertionError("two load units write overlapping device memory")
        if self.device.type == "cuda" and self.stream is not None:
            t0 = time.perf_counter()
            with torch.cuda.stream(self.stream):
                copy()
                event = torch.cuda.Event()
                event.record(self.stream)
            self.copy_seconds += time.perf_counter() - t0
            unit = _Unit(start, end, None, event)
        else:
            unit = _Unit(start, end, copy, None)
        self._units.insert(i, unit)
        self._starts.insert(i, start)

    def _overlapping(self, t: torch.Tensor) -> list[_Unit]:
        start, end = byte_span(t)
        i = bisect.bisect_left(self._starts, end)  # units starting before `end`
        out = []
        while i > 0 and self._units[i - 1].end > start:
            i -= 1
            out.append(self._units[i])
        # Units are disjoint and sorted, so only a run ending at i can overlap; earlier ones
        # end before this one starts.
        return out

    def _complete(self, unit: _Unit) -> None:
        if unit.waited:
            return
        unit.waited = True
        if unit.copy is not None:
            t0 = time.perf_counter()
            unit.copy()
            self.copy_seconds += time.perf_counter() - t0
            unit.copy = None
        elif unit.event is not None:
            torch.cuda.current_stream(self.device).wait_event(unit.event)

    def wait(self, *tensors: torch.Tensor | None) -> None:
        """Before reading these tensors (any views of the KV cache): their pages are in."""
        for t in tensors:
            if t is None:
                continue
            for unit in self._overlapping(t):
                if not unit.waited:
                    self.num_waits += 1
                self._complete(unit)

    def finish(self) -> None:
        """Complete every unit (after the forward; before any other read or copy of device KV)."""
        for unit in self._units:
            self._complete(unit)

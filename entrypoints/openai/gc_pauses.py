"""Garbage-collector pauses of a server process: kept short, and visible.

Why it matters: CPython's cyclic collector stops every thread while it walks the objects of the
generations it collects. A full (generation 2) collection walks everything alive, and a loaded
server holds ~300,000 objects before its first request (torch, transformers, tokenizers, the
model's modules): 270-320 ms per full collection on a 2-core AMD Zen 3 -- one such pause
alone is most of a streaming client's 0.5 s gap budget, at a moment nobody chose.

So `serve` freezes the heap it starts with (`freeze_startup_heap`: those objects live as long as
the process and never need walking; vLLM does the same after its engine starts), and
`GcPauses` times every collection from then on, so /metrics shows what pauses are left and a
long one is logged with its generation.
"""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect once, then move every surviving object to the permanent generation, which
    collections skip. Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@dataclass
class GcPauses:
    """Times collections through gc.callbacks while installed (process-wide: one per server)."""

    warn_seconds: float = 0.1  # a collection at least this long is logged
    collections: list[int] = field(default_factory=lambda: [0, 0, 0])  # per generation
    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    longest_seconds: float = 0.0
    _started: float | None = field(default=None, repr=False)

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        # Runs inside the collection, on whichever thread triggered it: keep it tiny.
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:  # installed mid-collection
            return
        took = time.perf_counter() - self._started
        self._started = None
        gen = info.get("generation", 2)
        self.collections[gen] += 1
        self.seconds[gen] += took
        self.longest_seconds = max(self.longest_seconds, took)
        if took >= self.warn_seconds:
            logger.warning("garbage collection of generation %d paused every thread for %.0f ms "
                           "(%d objects collected)", gen, took * 1e3, info.get("collected", 0))

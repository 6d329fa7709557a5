"""The worker processes of one node: started, watched and stopped the same way on the driver's
node (engine/tp_executor.py) and on a node that runs workers only (engine/tp_node.py).

Each rank is a 'spawn'ed process (a fork would copy the parent's threads and state) named
hybridkv-tp-rank<N>, running tp_worker.worker_main. Garbage collection and interpreter exit of
the parent kill and reap whatever still runs (weakref.finalize runs at exit).
"""
from __future__ import annotations

import multiprocessing
import time
import weakref
from typing import Callable

from hybridkv.engine.tp_worker import WorkerSpec, worker_main


class WorkerProcesses:
    """One process per WorkerSpec, started at construction."""

    def __init__(self, specs: list[WorkerSpec], on_close: Callable[[], None] | None = None) -> None:
        """on_close: run once after the processes are gone (close, garbage collection or exit);
        it must not hold a reference to the owner of this object."""
        context = multiprocessing.get_context("spawn")
        self.ranks = [spec.rank for spec in specs]
        self.processes: list[multiprocessing.process.BaseProcess] = []
        for spec in specs:
            proc = context.Process(target=worker_main, args=(spec,), name=f"hybridkv-tp-rank{spec.rank}", daemon=True)
            proc.start()
            self.processes.append(proc)
        # The callback holds the process list, not this object, so it can still be collected.
        self._finalizer = weakref.finalize(self, _kill, self.processes, on_close)

    def exited(self, wait_s: float = 0.0) -> list[tuple[int, int | None]]:
        """(rank, exit code) of every process that exited, waiting up to wait_s for one to show:
        a killed process is reaped a moment after its sockets close."""
        deadline = time.monotonic() + (wait_s if self.processes else 0.0)
        while True:
            dead = [(r, p.exitcode) for r, p in zip(self.ranks, self.processes) if p.exitcode is not None]
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.05)

    def failed(self) -> list[tuple[int, int | None]]:
        """(rank, exit code) of every process that exited with an error."""
        return [(r, code) for r, code in self.exited() if code != 0]

    def all_exited(self) -> bool:
        return all(p.exitcode is not None for p in self.processes)

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for proc in self.processes:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Kill and reap every process still running (idempotent)."""
        self._finalizer()


def _kill(processes: list[multiprocessing.process.BaseProcess], on_close: Callable[[], None] | None) -> None:
    for proc in processes:
        if proc.is_alive():
            proc.kill()
    for proc in processes:
        proc.join(timeout=10)
    if on_close is not None:
        on_close()

"""A node that runs tensor-parallel workers only: node_rank > 0 of a multi-node engine.

Node 0 runs the engine (the driver, rank 0: scheduler, KV manager, and the API server under
`hybridkv serve`) and hosts the rendezvous store at dist_init_addr. Every other node runs no
engine and no server: it starts its share of the ranks (engine/node_layout.py) with the same
launcher and worker code as the driver's node (engine/tp_processes.py, engine/tp_worker.py),
and they connect to node 0's store, which may come up before or after them.

This process then only supervises. It exits 0 once its workers have exited 0 (the driver told
them to stop), and non-zero with a message naming the rank when one of them fails, or naming
the driver when node 0's store stops answering (a driver that vanished leaves its workers with
nobody to follow: they are stopped).
"""
from __future__ import annotations

import logging
import signal
import time
from datetime import timedelta
from types import FrameType

import torch.distributed as dist

from hybridkv.engine.config import EngineConfig, resolve_device
from hybridkv.engine.node_layout import NodeLayout
from hybridkv.engine.tp_executor import collective_timeout_s, worker_specs
from hybridkv.engine.tp_processes import WorkerProcesses
from hybridkv.engine.tp_worker import started_key

logger = logging.getLogger(__name__)

POLL_S = 0.5
# After node 0's store stops answering: how long the workers get to exit on their own. A driver
# that shuts down cleanly sends them Stop and then closes its store, so the two can race.
STOP_GRACE_S = 10.0
PING_TIMEOUT_S = 5.0


class DriverLink:
    """A store client of node 0's TCPStore: whether the driver is still there. It connects
    once the store is up (the driver may start after this node)."""

    def __init__(self, layout: NodeLayout) -> None:
        self.layout = layout
        self.store: dist.TCPStore | None = None

    def connected(self) -> bool:
        if self.store is None:
            try:
                self.store = dist.TCPStore(self.layout.host, self.layout.port, None, is_master=False,
                                           timeout=timedelta(seconds=PING_TIMEOUT_S))
            except Exception:  # noqa: BLE001 - not up yet
                return False
        return True

    def alive(self) -> bool:
        """False once a connected store stops answering (not before it was ever reached)."""
        if self.store is None:
            return True
        try:
            self.store.check([started_key(self.layout.local_ranks[0])])
            return True
        except Exception:  # noqa: BLE001 - connection reset, refused or timed out: the driver is gone
            return False


def run_node(config: EngineConfig) -> int:
    """Start this node's workers and supervise them until they stop; the exit status."""
    if not config.node_rank:
        raise ValueError("run_node is for nodes with node_rank > 0; node 0 runs the engine")
    layout = NodeLayout.of(config.tensor_parallel_size, config.nnodes, config.node_rank, config.dist_init_addr)
    device = resolve_device(config.device)
    model_dir = config.model
    if model_dir is None:
        from hybridkv.model_executor.demo_model import ensure_demo_model

        model_dir = ensure_demo_model()
    backend = "nccl" if device.type == "cuda" else "gloo"
    specs = worker_specs(config, model_dir, device, layout, layout.port, backend, collective_timeout_s())
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so the workers are stopped, not orphaned
    workers = WorkerProcesses(specs)
    try:
        pids = ", ".join(f"rank {r} (pid {p.pid})" for r, p in zip(workers.ranks, workers.processes))
        logger.info("node %d of %d: %s on %s, %d torch thread(s) each; joining the driver at %s (node 0)",
                    layout.node_rank, layout.nnodes, pids, backend, specs[0].threads, layout.address)
        return supervise(workers, DriverLink(layout))
    finally:
        workers.close()
        signal.signal(signal.SIGTERM, previous)


def supervise(workers: WorkerProcesses, driver: DriverLink) -> int:
    address = driver.layout.address
    joined = False
    while True:
        failed = workers.failed()
        if failed:
            what = "; ".join(f"rank {r} exited with code {code}" for r, code in failed)
            if driver.store is not None and not driver.alive():
                logger.error("the driver (node 0 at %s) is gone: %s; stopping this node's ranks", address, what)
            else:
                logger.error("tensor-parallel worker %s (its error is above): stopping this node's ranks", what)
            return 1
        if workers.all_exited():
            logger.info("the driver stopped this node's ranks; node %d exits", driver.layout.node_rank)
            return 0
        if not joined and driver.connected():
            joined = True
            logger.info("reached the driver's store at %s", address)
        if joined and not driver.alive():
            workers.join(STOP_GRACE_S)
            if workers.all_exited() and not workers.failed():
                logger.info("the driver stopped this node's ranks; node %d exits", driver.layout.node_rank)
                return 0
            running = [r for r, p in zip(workers.ranks, workers.processes) if p.exitcode is None]
            logger.error("the driver (node 0 at %s) is gone: its store stopped answering; stopping rank(s) %s",
                         address, ", ".join(map(str, running)))
            return 1
        time.sleep(POLL_S)


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)

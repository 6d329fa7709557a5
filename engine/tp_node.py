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
import select
import signal
import socket
import time
from types import FrameType

from hybridkv.engine.config import EngineConfig, resolve_device
from hybridkv.engine.node_layout import NodeLayout
from hybridkv.engine.tp_executor import collective_timeout_s, worker_specs
from hybridkv.engine.tp_processes import WorkerProcesses

logger = logging.getLogger(__name__)

POLL_S = 0.5
# After node 0's store stops answering: how long the workers get to exit on their own. A driver
# that shuts down cleanly sends them Stop and then closes its store, so the two can race.
STOP_GRACE_S = 10.0
CONNECT_TIMEOUT_S = 2.0


class DriverLink:
    """One idle TCP connection to node 0's store: whether the driver is still there. It connects
    once the store listens (the driver may start after this node) and is never written to; the
    driver's process ending closes it (EOF), and TCP keepalive notices a machine that vanished."""

    def __init__(self, layout: NodeLayout) -> None:
        self.layout = layout
        self.sock: socket.socket | None = None

    def connected(self) -> bool:
        if self.sock is None:
            try:
                self.sock = socket.create_connection((self.layout.host, self.layout.port), timeout=CONNECT_TIMEOUT_S)
            except OSError:  # not up yet
                return False
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for option, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
                if hasattr(socket, option):  # Linux
                    self.sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
        return True

    def alive(self) -> bool:
        """False once a connection made stops (not before the store was ever reached)."""
        if self.sock is None:
            return True
        readable, _, _ = select.select([self.sock], [], [], 0)
        if not readable:
            return True
        try:
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True
        except OSError:  # reset, or keepalive gave up
            return False

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()


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
        driver = DriverLink(layout)
        try:
            return supervise(workers, driver)
        finally:
            driver.close()
    finally:
        workers.close()
        signal.signal(signal.SIGTERM, previous)


def supervise(workers: WorkerProcesses, driver: DriverLink) -> int:
    """Poll the workers and the driver until the workers are done; the exit status."""
    node, address = driver.layout.node_rank, driver.layout.address
    joined = False
    while True:
        if not joined and driver.connected():
            joined = True
            logger.info("reached the driver's store at %s", address)
        driver_gone = joined and not driver.alive()
        if driver_gone:
            workers.join(STOP_GRACE_S)  # a clean shutdown's Stop may still be on its way to them
        failed = workers.failed()
        if not failed and workers.all_exited():
            logger.info("the driver stopped this node's ranks; node %d exits", node)
            return 0
        if driver_gone or failed:
            outcome = "; ".join([f"rank {r} exited with code {code}" for r, code in failed] +
                                [f"rank {r} still ran, stopped now" for r, p in zip(workers.ranks, workers.processes)
                                 if p.exitcode is None])
            if driver_gone or not driver.alive():
                logger.error("the driver (node 0 at %s) is gone: its store closed the connection; %s", address,
                             outcome)
            else:
                logger.error("a tensor-parallel worker of node %d failed (its error is above): %s", node, outcome)
            return 1
        time.sleep(POLL_S)


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)

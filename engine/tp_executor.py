"""Tensor parallelism on the driver's side: the worker processes and the runner that leads them.

`tensor_parallel_size=N` runs the model as N shards (model_executor/parallel/). The engine's own
process is the driver and rank 0: it keeps the scheduler and the KV cache manager and runs rank
0's shard; N-1 spawned worker processes (engine/tp_worker.py) run the others, on this machine
or, with nnodes > 1, split evenly over several (engine/node_layout.py: the other nodes start
their own, engine/tp_node.py, and they join the store this process hosts). Before each forward
the driver broadcasts the step (its sequences and KVPlan) with torch.distributed; every rank runs
its shard and rank 0 samples from the gathered logits. Nothing but torch.distributed carries data
between the processes.

A worker that dies breaks the next collective on the driver (gloo sees the connection close; a
rank that hangs hits the process group's timeout): the driver then raises naming the rank and
tears the group down. Shutdown, garbage collection and interpreter exit stop every worker.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.node_layout import NodeLayout
from hybridkv.engine.tp_host_pages import GroupHostPages
from hybridkv.engine.tp_processes import WorkerProcesses
from hybridkv.engine.tp_worker import (
    SETTINGS_KEY, BindHostCache, BindKVCache, Message, Release, ReportState, RunCopies, RunStep, Stop, WorkerSpec,
    message_group, rank_state, refused_key, shared_settings, started_key,
)
from hybridkv.block_manager.kv_plan import KVCacheLayout, KVPlan, TierTransfers
from hybridkv.model_executor.batch import ModelInput, ScheduledSequence
from hybridkv.model_executor.model_runner import ModelRunner, ModelSkeleton, RunnerOutput
from hybridkv.model_executor.parallel.state import TensorParallel

logger = logging.getLogger(__name__)

# Seconds any collective may wait (HYBRIDKV_TP_TIMEOUT_S): the longest forward of one rank, and
# the longest startup gap between ranks (the driver builds its KV manager after loading).
DEFAULT_TIMEOUT_S = 600.0


def collective_timeout_s() -> float:
    value = os.environ.get("HYBRIDKV_TP_TIMEOUT_S", "").strip()
    return float(value) if value else DEFAULT_TIMEOUT_S


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_rank(config: EngineConfig) -> int:
    """config.num_threads (per rank) or this machine's cores shared evenly among its ranks."""
    if config.num_threads is not None:
        return config.num_threads
    return max(1, available_cores() // (config.tensor_parallel_size // config.nnodes))


def check_supported(config: EngineConfig, skeleton: ModelSkeleton) -> None:
    """ValueError naming what tensor_parallel_size > 1 does not support yet (model classes
    without a sharded form are refused by the skeleton's build: model_runner.build_model). Block-quantized checkpoints are sliced codes and scales
    together by DeepSeek-V4's layout only; the dense models' layout has no such rule yet."""
    quantized = getattr(skeleton.config, "quantization_config", None) is not None
    if quantized and not skeleton.model.supports_quantized_shards:
        raise ValueError(f"quantized (FP8/FP4) {type(skeleton.model).__name__} checkpoints are not supported yet with "
                         "tensor_parallel_size > 1 (quantized DeepSeek-V4 checkpoints are)")
    if config.allow_pickle_weights:
        raise ValueError("allow_pickle_weights is not supported with tensor_parallel_size > 1 (each rank reads "
                         "its slices from safetensors files)")
    if dist.is_initialized():
        raise ValueError("a torch.distributed process group already exists in this process (another "
                         "tensor-parallel engine?): shut it down first")


class WorkerGroup:
    """The process group of one engine and the worker processes of the driver's node; the ranks
    of other nodes (engine/tp_node.py) join through the store this group hosts."""

    def __init__(self, config: EngineConfig, model_dir: str, device: torch.device) -> None:
        self.layout = NodeLayout.of(config.tensor_parallel_size, config.nnodes, 0, config.dist_init_addr)
        self.size = config.tensor_parallel_size
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.timeout_s = collective_timeout_s()
        self.threads = threads_per_rank(config)
        timeout = timedelta(seconds=self.timeout_s)
        store = open_store(self.layout, timeout)
        specs = worker_specs(config, model_dir, device, self.layout, store.port, self.backend, self.timeout_s)
        store.set(SETTINGS_KEY, json.dumps(shared_settings(specs[0])))  # rank 0's: every worker checks its own
        self.workers = WorkerProcesses([s for s in specs if s.rank != 0], on_close=_leave_group)
        self.processes = self.workers.processes
        self.remote_pids: dict[int, int] = {}  # rank -> pid, as the ranks of other nodes reported it
        self.failure: RuntimeError | None = None
        self.messages: dist.ProcessGroup | None = None  # the driver's messages (tp_worker.message_group)
        self.broadcast_seconds = 0.0  # rank 0 in the per-step broadcasts of the batch and plan
        try:
            self._wait_for_workers(store)
        except RuntimeError:
            self.close()
            raise
        try:
            if self.backend == "nccl":
                torch.cuda.set_device(0)
            dist.init_process_group(self.backend, store=store, rank=0, world_size=self.size, timeout=timeout)
            self.messages = message_group()
        except Exception as e:
            raise self._failed(e) from e

    def _wait_for_workers(self, store: dist.TCPStore) -> None:
        """Wait until every rank runs (it set its key in the store), failing at once, naming the
        rank, when a local one exits first (an import error, say) instead of at the timeout; at
        the timeout, name the ranks that never came."""
        keys = [started_key(rank) for rank in range(1, self.size)]
        deadline = time.monotonic() + self.timeout_s
        if self.layout.remote_ranks:  # other machines may take a while: say what this one waits for
            logger.info("waiting up to %.0fs for tensor-parallel rank(s) %s to join at %s", self.timeout_s,
                        self._where(self.layout.remote_ranks), self.layout.address)
        while not store.check(keys):
            refused = [r for r in range(1, self.size) if store.check([refused_key(r)])]
            if refused:
                raise RuntimeError(f"tensor-parallel rank(s) {self._where(refused)} refused to join: "
                                   + "; ".join(store.get(refused_key(r)).decode() for r in refused))
            dead = self.workers.exited()
            if dead:
                raise RuntimeError(f"tensor-parallel worker rank {dead[0][0]} exited with code {dead[0][1]} "
                                   "while starting (its error is above, on stderr)")
            if time.monotonic() > deadline:
                missing = [r for r in range(1, self.size) if not store.check([started_key(r)])]
                raise RuntimeError(f"tensor-parallel rank(s) {self._where(missing)} did not join within "
                                   f"{self.timeout_s:.0f}s (HYBRIDKV_TP_TIMEOUT_S){self._join_hint(missing)}")
            time.sleep(0.05)
        self.remote_pids = {r: int(store.get(started_key(r))) for r in self.layout.remote_ranks}

    def _where(self, ranks: list[int]) -> str:
        if self.layout.nnodes == 1:
            return ", ".join(map(str, ranks))
        return ", ".join(f"{r} (node {self.layout.node_of(r)})" for r in ranks)

    def _join_hint(self, missing: list[int]) -> str:
        nodes = sorted({self.layout.node_of(r) for r in missing} - {0})
        if not nodes:
            return ""
        return (f": start node(s) {', '.join(map(str, nodes))} with --nnodes {self.layout.nnodes} --node-rank <k> "
                f"--dist-init-addr {self.layout.address}, and check that they can reach this address")

    def describe(self) -> str:
        local = ", ".join([f"rank 0 (driver, pid {os.getpid()})"] +
                          [f"rank {r} (pid {p.pid})" for r, p in zip(self.workers.ranks, self.processes)])
        nodes = f"node 0: {local}" if self.layout.nnodes > 1 else local
        for node in range(1, self.layout.nnodes):
            ranks = ", ".join(f"rank {r} (pid {self.remote_pids.get(r, '?')})" for r in self.layout.node_ranks(node))
            nodes += f"; node {node}: {ranks}"
        where = f"{self.layout.nnodes} node(s) x {self.layout.per_node} rank(s)"
        if self.layout.nnodes > 1:
            where += f", rendezvous at {self.layout.address}"
        return (f"tensor parallel: size {self.size} on {self.backend}, {where}; {nodes}; {self.threads} torch "
                f"thread(s) per rank of {available_cores()} core(s) on this node")

    def check(self) -> None:
        """Raise the group's failure, or a new one naming the rank when a worker of this node has
        exited since the last step (between steps nothing else notices; a rank of another node
        shows at the next step, or its node's log)."""
        if self.failure is not None:
            raise self.failure
        dead = self.workers.exited()
        if dead:
            raise self._failed(RuntimeError("it exited while the engine was idle"), dead)

    def broadcast(self, message: Message) -> None:
        """Send a message to every worker (tp_worker.receive on their side)."""
        t0 = time.perf_counter()
        with self.watch():
            dist.broadcast_object_list([message], src=0, group=self.messages)
        self.broadcast_seconds += time.perf_counter() - t0

    @contextmanager
    def watch(self) -> Iterator[None]:
        """Run collectives; a failure while a worker is gone raises naming the rank, and the
        group is torn down (the engine cannot continue without a rank)."""
        if self.failure is not None:
            raise self.failure
        try:
            yield
        except Exception as e:
            dead = self.workers.exited(wait_s=5.0)
            failure = self._failed(e, dead)  # the ranks are out of step now: the group is gone either way
            if not dead and not is_transport_error(e):
                raise  # the driver's own error, as it is
            raise failure from e

    def _failed(self, error: Exception, dead: list[tuple[int, int | None]] | None = None) -> RuntimeError:
        if dead is None:
            dead = self.workers.exited(wait_s=1.0)
        if dead:
            what = "; ".join(f"worker rank {r} exited with code {code}" for r, code in dead)
            self.failure = RuntimeError(f"tensor-parallel {what}: the engine cannot continue ({error})")
        elif self.layout.remote_ranks:  # a rank of another node, most likely: its node's log says which
            self.failure = RuntimeError(
                f"a tensor-parallel step failed, the workers were stopped (rank(s) "
                f"{self._where(self.layout.remote_ranks)} run on other nodes: a lost one ends the "
                f"engine; its node's log names it): {error}")
        else:  # the driver's own error, or a rank silent past the timeout
            self.failure = RuntimeError(f"a tensor-parallel step failed, the workers were stopped: {error}")
        self.close()
        return self.failure

    def close(self, graceful: bool = False) -> None:
        """Stop every worker and leave the process group. graceful: ask them to stop first (the
        ranks of other nodes stop on that message too; their nodes then exit)."""
        if graceful and self.failure is None and dist.is_initialized():
            try:
                dist.broadcast_object_list([Stop()], src=0, group=self.messages)
            except Exception:  # a worker already gone: it is killed below
                pass
            self.workers.join(timeout_s=10)
        if self.failure is None:
            self.failure = RuntimeError("the tensor-parallel workers were shut down: this engine runs no more steps")
        self.workers.close()


def is_transport_error(e: BaseException) -> bool:
    """Whether a collective failed for want of a peer: torch's DistError, or gloo's plain
    RuntimeError naming its transport (how a rank on another node that died shows here)."""
    return isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and "gloo/transport" in str(e))


def open_store(layout: NodeLayout, timeout: timedelta) -> dist.TCPStore:
    """The rendezvous store, hosted by the driver. One node: 127.0.0.1 and a port the store picks
    itself (two engines never race for one). Several: listening on dist_init_addr's address
    only (the store alone would listen on every interface), through a socket bound here."""
    if layout.nnodes == 1:
        return dist.TCPStore("127.0.0.1", 0, layout.size, is_master=True, wait_for_workers=False,
                             timeout=timeout)
    try:
        family, kind, proto, _, address = socket.getaddrinfo(layout.host, layout.port, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, kind, proto)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(max(128, layout.size))
    except OSError as e:
        raise RuntimeError(f"cannot listen on dist_init_addr {layout.address} for the other nodes: {e}") from e
    try:
        store = dist.TCPStore(layout.host, layout.port, layout.size, is_master=True, wait_for_workers=False,
                              timeout=timeout, master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the descriptor now, and closes it when it stops
    return store


def worker_specs(config: EngineConfig, model_dir: str, device: torch.device, layout: NodeLayout, store_port: int,
                 backend: str, timeout_s: float) -> list[WorkerSpec]:
    """The WorkerSpecs of the ranks of layout's node (rank 0's too, on node 0: callers drop it)."""
    threads = threads_per_rank(config)
    return [WorkerSpec(rank, layout.size, store_port, backend, timeout_s, threads, model_dir, config.dtype,
                       config.max_model_len, config.seed, config.attention_backend,
                       f"cuda:{layout.local_index(rank)}" if device.type == "cuda" else "cpu",
                       config.enable_expert_parallel, layout.host, config.kv_cache_dtype)
            for rank in layout.local_ranks]


def _leave_group() -> None:
    """After the workers are gone: leave the process group (the store goes with it)."""
    if dist.is_initialized():
        dist.destroy_process_group()


class TensorParallelRunner:
    """Rank 0's ModelRunner in front of the workers: the engine calls it as its runner. The KV
    layouts, steps and tier copies are broadcast before rank 0 runs them, so every rank executes
    the driver's one plan on its own KV shard and host buffers; everything else (introspection,
    the sampler, the step cost, the tiers' counters) is rank 0's runner's alone. Decode bursts do
    not run under tensor parallelism (the fused decode has no all-reduce)."""

    def __init__(self, driver: ModelRunner, workers: WorkerGroup) -> None:
        self.driver = driver
        self.workers = workers

    def __getattr__(self, name: str):
        return getattr(self.driver, name)

    def bind_kv_cache(self, layout: KVCacheLayout, prefault: bool = False) -> None:
        self.workers.broadcast(BindKVCache(layout, prefault))
        self.driver.bind_kv_cache(layout, prefault=prefault)

    def bind_host_cache(self, host_pages: dict[str, int], mem_layout: str) -> None:
        self.workers.broadcast(BindHostCache(host_pages, mem_layout))
        self.driver.bind_host_cache(host_pages, mem_layout)

    def release_requests(self, request_ids) -> None:
        ids = list(request_ids)
        if ids and self.driver.hot_buffers is not None:  # only HiSparse keeps per-request rows
            self.workers.broadcast(Release(ids))
        self.driver.release_requests(ids)

    def execute(self, batch: ModelInput, plan: KVPlan) -> RunnerOutput:
        self.workers.broadcast(RunStep([worker_view(s) for s in batch.sequences],
                                       step_plan(plan, batch, self.driver.layout.page_size), batch.verify))
        with self.workers.watch():
            return self.driver.execute(batch, plan)

    def rank_states(self) -> list[dict[str, int]]:
        """Every rank's state beyond its pages (tp_worker.rank_state), rank 0's first: what an
        idle group must hold none of."""
        self.workers.broadcast(ReportState())
        states: list = [None] * self.workers.size
        with self.workers.watch():
            dist.gather_object(rank_state(self.driver), states, dst=0)
        return states

    def burst_fits(self, num_decodes: int) -> bool:
        return False

    def execute_burst(self, batch: ModelInput, steps: int, plan: KVPlan) -> None:
        return None

    def stored_host_pages(self) -> GroupHostPages:
        """Every rank's host pages, as one stored value per page (engine/tp_host_pages.py)."""
        return GroupHostPages(self.workers, self.driver.host_cache)

    def run_copies(self, copies: TierTransfers, defer_loads: bool = False) -> None:
        if copies.empty:
            return
        self.workers.broadcast(RunCopies(copies))
        self.driver.run_copies(copies, defer_loads=defer_loads)

    def shutdown(self) -> None:
        self.workers.close(graceful=True)


def worker_view(s: ScheduledSequence) -> ScheduledSequence:
    """What a worker's forward reads of a scheduled sequence: no engine Request, no sampling state
    (rank 0 samples)."""
    return ScheduledSequence(s.request_id, s.token_ids, s.start, s.end, s.samples, s.params, None,
                             s.prompt_token_ids, [])


def step_plan(plan: KVPlan, batch: ModelInput, page_size: int) -> KVPlan:
    """The plan cut to what a worker's step reads: the block-table rows of the step's sequences
    only (the manager's tables hold a row for every running request, each as wide as
    max_model_len needs), as many pages wide as the runner reads (ModelRunner.step_sequences)."""
    ids = [s.request_id for s in batch.sequences]
    tables = plan.step_tables(ids, -(-max(s.end for s in batch.sequences) // page_size))
    return KVPlan({name: t.contiguous() for name, t in tables.items()}, {rid: i for i, rid in enumerate(ids)},
                  plan.copies)


def start_tensor_parallel(config: EngineConfig, model_dir: str, device: torch.device,
                          skeleton: ModelSkeleton) -> TensorParallelRunner:
    """Spawn the workers (they load their shards while the driver loads its own) and build rank
    0's runner; logs the layout."""
    check_supported(config, skeleton)
    workers = WorkerGroup(config, model_dir, device)
    logger.info("%s", workers.describe())
    try:
        with workers.watch():
            driver = ModelRunner(
                model_dir, config.dtype, config.max_model_len, config.seed, config.allow_pickle_weights,
                attention_backend=config.attention_backend, dequantize_weights=config.dequantize_weights,
                device=device, skeleton=skeleton,
                parallel=TensorParallel(0, config.tensor_parallel_size, config.enable_expert_parallel),
            )
    except BaseException:
        workers.close()
        raise
    return TensorParallelRunner(driver, workers)

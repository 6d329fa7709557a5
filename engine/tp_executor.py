"""Tensor parallelism on the driver's side: the worker processes and the runner that leads them.

`tensor_parallel_size=N` runs the model as N shards (model_executor/parallel/). The engine's own
process is the driver and rank 0: it keeps the scheduler and the KV cache manager and runs rank
0's shard; N-1 spawned worker processes (engine/tp_worker.py) run the others. Before each forward
the driver broadcasts the step (its sequences and KVPlan) with torch.distributed; every rank runs
its shard and rank 0 samples from the gathered logits. Nothing but torch.distributed carries data
between the processes.

A worker that dies breaks the next collective on the driver (gloo sees the connection close; a
rank that hangs hits the process group's timeout): the driver then raises naming the rank and
tears the group down. Shutdown, garbage collection and interpreter exit stop every worker.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import time
import weakref
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.tp_host_pages import GroupHostPages
from hybridkv.engine.tp_worker import (
    BindHostCache, BindKVCache, Message, Release, ReportState, RunCopies, RunStep, Stop, WorkerSpec, rank_state,
    started_key, worker_main,
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
    """config.num_threads (per rank) or this machine's cores shared evenly among the ranks."""
    if config.num_threads is not None:
        return config.num_threads
    return max(1, available_cores() // config.tensor_parallel_size)


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
    """The process group and the N-1 worker processes of one engine."""

    def __init__(self, config: EngineConfig, model_dir: str, device: torch.device) -> None:
        self.size = config.tensor_parallel_size
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.timeout_s = collective_timeout_s()
        self.threads = threads_per_rank(config)
        timeout = timedelta(seconds=self.timeout_s)
        # Port 0: the store picks a free port itself, so two engines never race for one.
        store = dist.TCPStore("127.0.0.1", 0, self.size, is_master=True, wait_for_workers=False, timeout=timeout)
        context = multiprocessing.get_context("spawn")  # a fork would copy the driver's threads and state
        self.processes: list[multiprocessing.process.BaseProcess] = []
        for rank in range(1, self.size):
            spec = WorkerSpec(rank, self.size, store.port, self.backend, self.timeout_s, self.threads, model_dir,
                              config.dtype, config.max_model_len, config.seed, config.attention_backend,
                              f"cuda:{rank}" if device.type == "cuda" else "cpu", config.enable_expert_parallel)
            proc = context.Process(target=worker_main, args=(spec,), name=f"hybridkv-tp-rank{rank}", daemon=True)
            proc.start()
            self.processes.append(proc)
        # Garbage collection and interpreter exit tear the workers down too (weakref.finalize
        # runs at exit); the callback holds the process list, not the group.
        self._finalizer = weakref.finalize(self, _kill_workers, self.processes)
        self.failure: RuntimeError | None = None
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
        except Exception as e:
            raise self._failed(e) from e

    def _wait_for_workers(self, store: dist.TCPStore) -> None:
        """Wait until every worker process runs (it set its key in the store), failing at once,
        naming the rank, when one exits first (an import error, say) instead of at the timeout."""
        keys = [started_key(rank) for rank in range(1, self.size)]
        deadline = time.monotonic() + self.timeout_s
        while not store.check(keys):
            dead = self._dead_workers(wait_s=0.0)
            if dead:
                raise RuntimeError(f"tensor-parallel worker rank {dead[0][0]} exited with code {dead[0][1]} "
                                   "while starting (its error is above, on stderr)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers did not start within {self.timeout_s:.0f}s")
            time.sleep(0.05)

    def describe(self) -> str:
        ranks = ", ".join([f"rank 0 (driver, pid {os.getpid()})"] +
                          [f"rank {r} (pid {p.pid})" for r, p in enumerate(self.processes, start=1)])
        return (f"tensor parallel: size {self.size} on {self.backend}; {ranks}; {self.threads} torch thread(s) "
                f"per rank of {available_cores()} core(s)")

    def broadcast(self, message: Message) -> None:
        """Send a message to every worker (tp_worker.receive on their side)."""
        t0 = time.perf_counter()
        with self.watch():
            dist.broadcast_object_list([message], src=0)
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
            dead = self._dead_workers(wait_s=5.0)
            failure = self._failed(e, dead)  # the ranks are out of step now: the group is gone either way
            if not dead and not isinstance(e, dist.DistError):
                raise  # the driver's own error, as it is
            raise failure from e

    def _dead_workers(self, wait_s: float) -> list[tuple[int, int | None]]:
        """(rank, exit code) of every worker that exited, waiting up to wait_s for one to show:
        a killed process is reaped a moment after its sockets close."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = [(r, p.exitcode) for r, p in enumerate(self.processes, start=1) if p.exitcode is not None]
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.05)

    def _failed(self, error: Exception, dead: list[tuple[int, int | None]] | None = None) -> RuntimeError:
        if dead is None:
            dead = self._dead_workers(wait_s=1.0)
        if dead:
            what = "; ".join(f"worker rank {r} exited with code {code}" for r, code in dead)
            self.failure = RuntimeError(f"tensor-parallel {what}: the engine cannot continue ({error})")
        else:  # the driver's own error, or a rank silent past the timeout
            self.failure = RuntimeError(f"a tensor-parallel step failed, the workers were stopped: {error}")
        self.close()
        return self.failure

    def close(self, graceful: bool = False) -> None:
        """Stop every worker and leave the process group. graceful: ask them to stop first."""
        if graceful and self.failure is None and dist.is_initialized():
            try:
                dist.broadcast_object_list([Stop()], src=0)
            except Exception:  # a worker already gone: it is killed below
                pass
            for proc in self.processes:
                proc.join(timeout=10)
        if self.failure is None:
            self.failure = RuntimeError("the tensor-parallel workers were shut down: this engine runs no more steps")
        self._finalizer()


def _kill_workers(processes: list[multiprocessing.process.BaseProcess]) -> None:
    """Kill and reap every worker still running, and leave the process group (the finalizer of
    a WorkerGroup: it runs once, at close, garbage collection or interpreter exit)."""
    for proc in processes:
        if proc.is_alive():
            proc.kill()
    for proc in processes:
        proc.join(timeout=10)
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
                                       step_plan(plan, batch, self.driver.layout.page_size)))
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

"""A tensor-parallel worker process (ranks 1..N-1) and the messages the driver sends it.

The driver (rank 0, the engine's process) owns the scheduler and the KV cache manager; a worker
owns only its model shard and its KV shard. It joins the process group (through the driver's
store, on this machine or on node 0: engine/node_layout.py, after checking that it was started
with the driver's settings), loads its slices of the checkpoint, then executes what the driver
broadcasts (torch.distributed.broadcast_object_list): the KV layout (and the host tier's, when
there is one) once, then every step's sequences and KV plan and the tier copies decided between steps, until it is told to stop. Every
rank thus runs the same copies on its own KV shard and host buffers, from the driver's one plan. Each forward's all-reduces and the logits
gather pair it with the other ranks step by step.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hybridkv.block_manager.kv_plan import KVCacheLayout, KVPlan, TierTransfers
from hybridkv.model_executor.batch import ModelInput, ScheduledSequence
from hybridkv.model_executor.model_runner import ModelRunner
from hybridkv.model_executor.parallel.state import TensorParallel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker is started with (pickled into the spawned process)."""

    rank: int
    size: int
    store_port: int  # the driver's TCPStore (at store_host): the process group's rendezvous
    backend: str  # "gloo" (CPU) or "nccl" (CUDA)
    timeout_s: float  # every collective's limit: a rank that stops answering fails the others
    threads: int  # torch threads of this rank (its share of the cores)
    model_dir: str
    dtype: str
    max_model_len: int | None
    seed: int
    attention_backend: str
    device: str  # "cpu" or "cuda:<the rank's index on its node>"
    expert_parallel: bool = False  # EngineConfig.enable_expert_parallel
    store_host: str = "127.0.0.1"  # node 0's address (dist_init_addr) when the ranks span nodes
    kv_cache_dtype: str = "auto"  # EngineConfig.kv_cache_dtype


@dataclass(frozen=True)
class BindKVCache:
    """Allocate the KV shard from the same layout as the driver's."""

    layout: KVCacheLayout
    prefault: bool


@dataclass(frozen=True)
class BindHostCache:
    """Allocate the host tier's page buffers (HiCache L2) for this rank's KV shard, the driver's
    page counts and layout: the driver's plan then names the same host pages on every rank."""

    host_pages: dict[str, int]
    mem_layout: str


@dataclass(frozen=True)
class RunStep:
    """One forward: the step's sequences (plain ScheduledSequences, no engine objects) and its plan
    (whose tier copies run first, as on the driver)."""

    sequences: list[ScheduledSequence]
    plan: KVPlan
    # speculative decoding's verified sequences: every rank splits them into the same decode rows
    # and joins the same logits gather for their rows
    verify: frozenset[str] = frozenset()


@dataclass(frozen=True)
class RunCopies:
    """Tier copies decided between steps (write-through, write-back of evicted pages, load-backs
    of a swap-in), run now on this rank's shard."""

    copies: TierTransfers


@dataclass(frozen=True)
class Release:
    """Requests that left the device (finished, preempted, aborted): their HiSparse hot-buffer
    rows are emptied on this rank as on the driver, when they leave, so an idle group holds none."""

    request_ids: list[str]


@dataclass(frozen=True)
class ReadHostPages:
    """Send the bytes of these host pages of one space to the driver (a gather follows): the
    storage tier stores every rank's shard of a page as one value (engine/tp_host_pages.py)."""

    space: str
    pages: list[int]


@dataclass(frozen=True)
class WriteHostPages:
    """Fill these host pages of one space with this rank's part of pages read from the storage
    tier (a scatter follows with the bytes)."""

    space: str
    pages: list[int]


@dataclass(frozen=True)
class ReportState:
    """Send the driver what this rank holds between steps (a gather follows): the invariant that
    an idle group holds nothing is checked on every rank, not only the driver's."""


@dataclass(frozen=True)
class Stop:
    """Leave the loop and the process group."""


# How long a worker waits for the driver's next message: as long as the engine is idle, which
# has no bound (a server with no traffic overnight). The model's own collectives keep the
# process group's timeout; a driver that dies closes its connections, which ends this wait at
# once, and a follower node watches the driver besides (engine/tp_node.py).
IDLE_TIMEOUT = timedelta(days=3650)


def message_group() -> dist.ProcessGroup:
    """The group the driver's messages go through, without the step timeout (IDLE_TIMEOUT).
    Every rank creates it right after joining, in the same order (new_group is collective)."""
    return dist.new_group(timeout=IDLE_TIMEOUT)


Message = (BindKVCache | BindHostCache | RunStep | RunCopies | Release | ReadHostPages | WriteHostPages
           | ReportState | Stop)


def receive(group: dist.ProcessGroup) -> Message:
    """The driver's next message (every rank calls this with the driver's send: one broadcast)."""
    box: list = [None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def started_key(rank: int) -> str:
    """The store key a worker sets once it runs (before it joins the process group)."""
    return f"hybridkv/tp/started/{rank}"


def refused_key(rank: int) -> str:
    """The store key a worker sets, to why, when its settings differ from the driver's."""
    return f"hybridkv/tp/refused/{rank}"


SETTINGS_KEY = "hybridkv/tp/settings"


class SettingsMismatch(ValueError):
    """This rank was started with other settings than the driver's (another node's flags)."""


def shared_settings(spec: WorkerSpec) -> dict[str, object]:
    """What every rank must agree on: a node started with another dtype, context length or
    checkpoint would compute garbage or hang in a collective. The driver publishes its own
    (the checkpoint by its config.json, as its folder may lie elsewhere on another machine)."""
    try:
        with open(os.path.join(spec.model_dir, "config.json"), "rb") as f:
            checkpoint = hashlib.sha256(f.read()).hexdigest()[:16]
    except OSError:
        checkpoint = "unreadable"
    return {"tensor_parallel_size": spec.size, "backend": spec.backend, "dtype": spec.dtype,
            "kv_cache_dtype": spec.kv_cache_dtype, "max_model_len": spec.max_model_len,
            "attention_backend": spec.attention_backend,
            "expert_parallel": spec.expert_parallel, "config.json sha256": checkpoint}


def join_group(spec: WorkerSpec) -> dist.ProcessGroup:
    """Join the driver's process group (the driver is rank 0 and holds the store; a worker on
    another node may start first: the client retries connecting until the timeout). Settings
    that differ from the driver's are refused before anything loads, on both sides."""
    timeout = timedelta(seconds=spec.timeout_s)
    store = dist.TCPStore(spec.store_host, spec.store_port, spec.size, is_master=False, timeout=timeout)
    driver, mine = json.loads(store.get(SETTINGS_KEY)), shared_settings(spec)
    differ = [f"{k} {mine.get(k)!r} (the driver's: {v!r})" for k, v in driver.items() if mine.get(k) != v]
    if differ:
        why = f"rank {spec.rank} was started with other settings than the driver's: {'; '.join(differ)}"
        store.set(refused_key(spec.rank), why)
        raise SettingsMismatch(why)
    store.set(started_key(spec.rank), str(os.getpid()))  # the driver waits for these, watching the processes
    if spec.backend == "nccl":
        torch.cuda.set_device(torch.device(spec.device))
    dist.init_process_group(spec.backend, store=store, rank=spec.rank, world_size=spec.size, timeout=timeout)
    return message_group()


def worker_main(spec: WorkerSpec) -> None:
    """The worker process's entry point (multiprocessing 'spawn' target)."""
    logging.basicConfig(level=logging.WARNING, format=f"[tp rank {spec.rank}] %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(spec.threads)
    try:
        messages = join_group(spec)
    except SettingsMismatch as e:
        logger.error("%s", e)
        sys.stderr.flush()
        os._exit(1)
    runner = ModelRunner(spec.model_dir, spec.dtype, spec.max_model_len, spec.seed,
                         attention_backend=spec.attention_backend, device=spec.device,
                         kv_cache_dtype=spec.kv_cache_dtype,
                         parallel=TensorParallel(spec.rank, spec.size, spec.expert_parallel))
    try:
        serve(runner, messages)
    except GroupLost as e:  # one line, not gloo's traceback: the driver's (or node's) log says why
        logger.error("%s", e)
        sys.stderr.flush()
        os._exit(1)
    # Told to stop: leave without tearing the process group down. Its gloo threads, destroyed
    # while the driver's side of the connections closes, aborted the process now and then
    # (exit code -6); nothing in this process outlives it. An error above exits the usual way,
    # with its traceback and a non-zero code, which the driver reports.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class GroupLost(RuntimeError):
    """The wait for the driver's next message broke: the driver or another rank is gone."""


def serve(runner: ModelRunner, messages: dist.ProcessGroup) -> None:
    """Execute the driver's messages until Stop."""
    while True:
        try:
            message = receive(messages)
        except RuntimeError as e:  # gloo: "Connection closed by peer ..."
            reason = str(e).split(". ")[0]
            raise GroupLost(f"tensor-parallel rank {dist.get_rank()} lost the process group while waiting for the "
                            f"driver's next step: {reason}") from e
        if isinstance(message, Stop):
            return
        if isinstance(message, BindKVCache):
            runner.bind_kv_cache(message.layout, prefault=message.prefault)
        elif isinstance(message, BindHostCache):
            runner.bind_host_cache(message.host_pages, message.mem_layout)
        elif isinstance(message, RunStep):
            runner.execute(ModelInput(message.sequences, verify=message.verify), message.plan)
        elif isinstance(message, RunCopies):
            runner.run_copies(message.copies)
        elif isinstance(message, Release):
            release(runner, message.request_ids)
        elif isinstance(message, ReportState):
            dist.gather_object(rank_state(runner), None, dst=0)
        elif isinstance(message, ReadHostPages):
            dist.gather_object(runner.host_cache.read_pages(message.space, message.pages), None, dst=0)
        elif isinstance(message, WriteHostPages):
            mine: list = [None]
            dist.scatter_object_list(mine, None, src=0)
            runner.host_cache.write_pages(message.space, message.pages, mine[0])
        else:
            raise TypeError(f"unknown message from the driver: {type(message).__name__}")


def release(runner: ModelRunner, request_ids: list[str]) -> None:
    """Empty the HiSparse hot-buffer rows of requests that left, and drop their hit counters:
    only the driver reports per-request counts, a worker's would only accumulate."""
    runner.release_requests(request_ids)
    buffers = runner.hot_buffers
    if buffers is not None:
        for rid in request_ids:
            buffers.forget(rid)


def rank_state(runner: ModelRunner) -> dict[str, int]:
    """What this rank holds beyond its pages: HiSparse hot-buffer rows (and requests still
    counted), and host-tier load-backs not yet completed. All zero on an idle rank."""
    buffers = runner.hot_buffers
    host = runner.host_cache
    return {
        "hot_buffer_rows": buffers.num_active if buffers is not None else 0,
        "hot_buffer_requests_counted": buffers.num_tracked if buffers is not None else 0,
        "pending_load_backs": int(host is not None and host.has_pending_loads),
    }

"""EngineConfig: everything an LLMEngine is built from (the LLM class and the CLI fill it)."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from hybridkv.attention_backends.kv_cache_dtype import validate_kv_cache_dtype_name
from hybridkv.attention_backends.registry import validate_attention_backend_name
from hybridkv.engine.gap_budget import check_step_seconds
from hybridkv.engine.json_config import json_object
from hybridkv.engine.kv_event_publisher import KVEventsConfig
from hybridkv.engine.node_layout import resolve_nodes
from hybridkv.engine.speculative.config import SpeculativeConfig, check_speculation


def resolve_device(name: str) -> torch.device:
    """The torch device EngineConfig.device names; ValueError naming the problem when it is not
    a CPU or CUDA device, or is a CUDA device this machine does not have."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {name!r}") from e
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {name!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={name!r} needs a CUDA build of torch and a visible GPU "
                             f"(torch {torch.__version__}: torch.cuda.is_available() is False)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device={name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


@dataclass
class EngineConfig:
    model: str | None = None  # HF checkpoint folder; None = the built-in demo model
    dtype: str = "auto"
    # The KV pools' element type (vLLM's names): "auto" = the model's dtype; "fp8" / "fp8_e4m3" /
    # "fp8_e5m2" = one byte an element, scale 1.0 (attention_backends/kv_cache_dtype.py): twice
    # the pages of a bfloat16 cache in the same budget. Dense models (Llama family, Gemma 3) only.
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    # Tokens per KV page. None = the model's default page size (16 for dense models, 128 for
    # DeepSeek-V4); an explicit value the model cannot use is an error, never silently changed.
    block_size: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    kv_cache_memory_bytes: int | None = None  # None = engine/kv_budget.py's default (sized from the machine)
    # CPU KV pools: False (offline default) takes their memory as pages are first written, on
    # 4 KiB pages; True puts them on huge pages and touches all of them at start, so no step pays
    # a first-touch fault (model_executor/huge_pages.py kv_pool_on). None = False for LLM and
    # `hybridkv generate`, True for `hybridkv serve`.
    kv_cache_prefault: bool | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None = max(2048, max_model_len)
    # While requests decode, size prefill chunks so a step's estimated time stays under this
    # (seconds): a long prompt cannot freeze running streams. None = the token budget alone
    # (offline default, for throughput); "auto" (`hybridkv serve`'s default) = the time of ~140
    # prompt tokens on this machine, at the rate the scheduler measures (engine/step_target.py).
    target_step_seconds: float | str | None = None
    # With a target: the longest a step may be planned while requests decode (and the bound on
    # steps while streamed prompts wait for first tokens with nothing decoding). Above the target,
    # cheap decode-only steps bank time for fewer, longer prefill steps and the mean gap stays at
    # the target (engine/gap_budget.py). None = the target itself: every step is held to it.
    max_step_seconds: float | None = None
    allow_pickle_weights: bool = False
    # "auto" | "torch_native" | "triton" | "xformers" (hybridkv.attention_backends.registry): auto
    # = triton on CUDA when the triton package imports, else torch_native. A backend that cannot
    # run on this machine is refused by the model runner before the model is loaded.
    attention_backend: str = "auto"
    # Where the model and its KV cache live: "cpu" (default), "cuda" / "cuda:N", or "auto" (the
    # first CUDA device when torch sees one, else the CPU). The CUDA path is checked on CPU only
    # (Triton under TRITON_INTERPRET=1, xformers' masks) until benchmarks/gpu_check.py has run
    # on a GPU, so it is opt-in.
    device: str = "cpu"
    # FP8/FP4 checkpoints: None keeps weights compressed (dequantized tile by tile in the matmul;
    # memory ~ file size), True dequantizes once at load (faster on CPU, 2-4x the memory).
    dequantize_weights: bool | None = None
    chat_template: str | None = None
    scheduling_policy: str = "fcfs"  # fcfs | lpm | dfs-weight (engine/scheduling_policy.py)
    eviction_policy: str = "lru"  # lru | lfu | slru | priority (block_manager/eviction_policy.py)
    # False: the baseline that drops a cached prefix once any windowed (SWA) page on it is gone.
    windowed_match: bool = True
    # HiCache L2: a host-memory tier under every block space (SGLang's flag names).
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0  # host pages per space = ratio x device pages (unless hicache_size)
    hicache_size: int | None = None  # host bytes over all spaces; overrides hicache_ratio
    hicache_write_policy: str = "write_through"  # write_through | write_through_selective | write_back
    hicache_mem_layout: str = "page_first"  # page_first | layer_first
    load_back_threshold: int = 0  # tokens: a smaller host hit is recomputed instead of loaded
    # What a request preempted for room loses: "recompute" (its pages stay in the device prefix
    # cache until evicted) or "swap" (they are written to the host tier too; needs it).
    preemption_mode: str = "recompute"
    # HiCache L3: a store under the host tier, shared across processes (SGLang's names).
    hicache_storage_backend: str | None = None  # None | "file" | "redis"
    hicache_storage_backend_extra_config: str | dict | None = None  # JSON or dict, e.g. {"url": "redis://..."}
    hicache_storage_dir: str | None = None  # file backend directory (default $HYBRIDKV_CACHE_DIR/kv_store, ~/.cache/hybridkv/kv_store)
    hicache_storage_prefetch_policy: str = "timeout"  # best_effort | wait_complete | timeout
    # HiSparse (DeepSeek-V4 CSA layers): decode reads C4 entries from a per-request hot buffer;
    # the full C4 history is a host mirror charged to host memory, not to kv_cache_memory_bytes.
    enable_hisparse: bool = False
    hisparse_config: str | dict | None = None  # JSON or dict: {"hot_buffer_size": ..., "mirror_bytes": ...}
    # KV cache events for a KV-aware router (vLLM's kv_events_config; engine/kv_event_publisher.py).
    kv_events_config: str | dict | None = None
    # Greedy decode steps per model call (vLLM's name): a step of plain greedy decodes, with
    # nobody waiting and no tier below the device, runs up to this many steps in one C++ call
    # (engine/decode_burst.py). None = 8 without a step target (offline), 1 with one or under the
    # async engine (`serve`): a burst is that many steps' time, a stream would get its tokens that
    # many at a time and a new request would wait that many steps for admission.
    num_scheduler_steps: int | None = None
    # CPU compute threads (torch.set_num_threads, process-wide, set when the engine starts).
    # None = torch's default: OMP_NUM_THREADS when set, else one per core.
    num_threads: int | None = None
    # Model shards, one process each (vLLM's name; engine/tp_executor.py): 1 = one process, no
    # torch.distributed. With N > 1, num_threads is per rank (default: the cores shared evenly).
    tensor_parallel_size: int = 1
    # Expert parallelism (vLLM's name): under tensor_parallel_size > 1 each rank holds whole
    # routed experts, 1/N of them, instead of 1/N of every expert's intermediate size.
    # Mixture-of-experts models only. Refused with tensor_parallel_size=1, where there is nothing
    # to split: a silently ignored flag would hide a mistyped size.
    enable_expert_parallel: bool = False
    # The machines the ranks run on (SGLang's names; engine/node_layout.py): tensor_parallel_size
    # split evenly over nnodes; node 0 runs the driver and hosts the rendezvous at dist_init_addr
    # ("host:port"), every other node only its workers (engine/tp_node.py). None = torchrun's
    # WORLD_SIZE / RANK / MASTER_ADDR:MASTER_PORT when tensor_parallel_size > 1, else one node.
    nnodes: int | None = None
    node_rank: int | None = None
    dist_init_addr: str | None = None
    # Speculative decoding (vLLM's name; engine/speculative/): {"method": "ngram",
    # "num_speculative_tokens": k, "prompt_lookup_min": m, "prompt_lookup_max": n}, a dict or its
    # JSON. None = off. Greedy requests only; the model and features it refuses: docs/configuration.md.
    speculative_config: str | dict | None = None

    def __post_init__(self) -> None:
        self._check_tensor_parallel()
        self.nnodes, self.node_rank, self.dist_init_addr = resolve_nodes(
            self.tensor_parallel_size, self.nnodes, self.node_rank, self.dist_init_addr)
        validate_attention_backend_name(self.attention_backend)
        validate_kv_cache_dtype_name(self.kv_cache_dtype)
        resolve_device(self.device)  # a device this machine lacks fails before the model loads
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 or None, got {self.num_threads}")
        if self.num_scheduler_steps is not None and (
                isinstance(self.num_scheduler_steps, bool) or not isinstance(self.num_scheduler_steps, int)
                or self.num_scheduler_steps < 1):
            raise ValueError(f"num_scheduler_steps must be an integer >= 1 or None, got {self.num_scheduler_steps!r}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        check_step_seconds(self.target_step_seconds, self.max_step_seconds)
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.preemption_mode == "swap" and not self.enable_hierarchical_cache:
            raise ValueError("preemption_mode='swap' swaps pages out to the host tier: set enable_hierarchical_cache=True")
        if self.enable_hierarchical_cache:
            if not self.enable_prefix_caching:
                raise ValueError("enable_hierarchical_cache needs enable_prefix_caching=True (the host tier holds prefix pages)")
            if self.hicache_size is None and not self.hicache_ratio > 0:
                raise ValueError(f"hicache_ratio must be > 0, got {self.hicache_ratio}")
            if self.hicache_size is not None and self.hicache_size <= 0:
                raise ValueError(f"hicache_size must be > 0 bytes, got {self.hicache_size}")
        if self.hicache_storage_backend is not None and not self.enable_hierarchical_cache:
            raise ValueError("hicache_storage_backend reads into and writes from the host tier: "
                             "set enable_hierarchical_cache=True")
        if self.hicache_storage_prefetch_policy not in ("best_effort", "wait_complete", "timeout"):
            raise ValueError(f"unknown hicache_storage_prefetch_policy {self.hicache_storage_prefetch_policy!r}; "
                             "choose one of ['best_effort', 'wait_complete', 'timeout']")
        if self.load_back_threshold < 0:
            raise ValueError(f"load_back_threshold must be >= 0 tokens, got {self.load_back_threshold}")
        if self.hisparse_config is not None and not self.enable_hisparse:
            raise ValueError("hisparse_config is given but enable_hisparse is False")
        if self.enable_hisparse:
            HiSparseConfig.parse(self.hisparse_config)  # a bad config fails before the model loads
        spec = SpeculativeConfig.parse(self.speculative_config)  # the model's spaces are checked at load
        if spec is not None:
            check_speculation(spec, self, [])
        if KVEventsConfig.parse(self.kv_events_config) is not None and not self.enable_prefix_caching:
            raise ValueError("kv_events_config reports the prefix cache's pages: set enable_prefix_caching=True")


    def _check_tensor_parallel(self) -> None:
        n = self.tensor_parallel_size
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {n!r}")
        if n == 1 and self.enable_expert_parallel:
            raise ValueError("enable_expert_parallel splits the routed experts across tensor-parallel ranks: "
                             "it needs tensor_parallel_size > 1 (got 1)")


@dataclass(frozen=True)
class HiSparseConfig:
    """`hisparse_config` (SGLang's --hisparse-config JSON), validated.

    hot_buffer_size  C4 entries per request and CSA layer on the device (None = 2 x index_topk;
                     must be >= index_topk)
    mirror_bytes     host memory for the C4 mirror (None = as many pages as the device's other
                     whole-history spaces get, so the mirror never limits admission first)
    """

    hot_buffer_size: int | None = None
    mirror_bytes: int | None = None

    @classmethod
    def parse(cls, value: str | dict | None) -> "HiSparseConfig":
        if value is None or (isinstance(value, str) and not value.strip()):
            value = {}
        value = json_object(value, "hisparse_config")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown hisparse_config key(s) {unknown}; known: {sorted(known)}")
        for key, v in value.items():
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"hisparse_config[{key!r}] must be a positive integer, got {v!r}")
        return cls(**value)


# The page size of a model that declares none (dense models): block_size=None resolves to it.
DEFAULT_BLOCK_SIZE = 16
# Decode steps per call when num_scheduler_steps is None and no step target is set.
DEFAULT_SCHEDULER_STEPS = 8

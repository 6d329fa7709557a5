"""LLMEngine: add requests, call step(), collect RequestOutputs.

One step = schedule -> model runner forward + sample -> append tokens, detokenize, check
stop conditions -> release finished requests -> build outputs.
"""
from __future__ import annotations

import itertools
import logging
import math
import operator
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridkv import OPENMP_RUNTIME
from hybridkv.block_manager.kv_cache_manager import KVCacheManager, windowed_live_pages
from hybridkv.block_manager.space_spec import SpaceSpec
from hybridkv.engine.config import (
    DEFAULT_BLOCK_SIZE, EngineConfig, resolve_device,
)
from hybridkv.engine.kv_budget import (
    FRACTION_VARIABLE, check_one_sequence_fits, default_kv_cache_cap_bytes, kv_cache_fraction, one_sequence_bytes,
)
from hybridkv.engine.decode_burst import burst_limit, burst_steps
from hybridkv.engine.detokenizer import IncrementalDetokenizer
from hybridkv.engine.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from hybridkv.engine.request import Request, RequestStatus
from hybridkv.engine.sampling_params import RequestOutputKind, SamplingParams
from hybridkv.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from hybridkv.model_executor.checkpoint import load_generation_config
from hybridkv.model_executor.model_runner import ModelRunner, RunnerOutput, SampledToken, model_skeleton
from hybridkv.model_executor.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

PromptType = str | dict[str, Any] | list[int]


@dataclass
class _Group:
    """A user request: n sequences sampled from one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[Request]
    detoks: dict[str, IncrementalDetokenizer]
    sent_tokens: dict[str, int] = field(default_factory=dict)  # for DELTA outputs
    sent_logprobs: dict[str, int] = field(default_factory=dict)
    sent_prompt_logprobs: bool = False
    reported_finished: set[str] = field(default_factory=set)


def is_token_array(value: Any) -> bool:
    """A torch tensor or a numpy array (numpy is imported only if the caller already did:
    an object cannot be an ndarray otherwise, and numpy is not a hard dependency)."""
    if isinstance(value, torch.Tensor):
        return True
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, np.ndarray)


def as_token_ids(value: Any) -> list[int]:
    """Token ids as a list of Python ints, from a list, tuple, 1-D numpy array or 1-D tensor.

    Everything downstream (prefix hashing, the index, detokenization) compares ids as Python
    ints, so numpy/torch scalars are converted here, once. Floats and bools are refused rather
    than truncated: they are almost always a mistake (logits, masks) that would decode as garbage.
    """
    if is_token_array(value):
        if value.ndim != 1:
            raise ValueError(
                f"prompt token ids must be 1-D, got an array of shape {tuple(value.shape)} "
                f"(pass one prompt per row as a list of prompts)"
            )
        kind = str(value.dtype)  # e.g. "int64", "torch.int32"; bool, float, complex, object are refused
        if "int" not in kind:
            raise ValueError(f"prompt token ids must be integers, got an array of dtype {kind}")
        return [int(t) for t in value.tolist()]
    if not isinstance(value, (list, tuple)):
        raise ValueError(
            f"prompt token ids must be a list, tuple, 1-D numpy array or tensor, got {type(value).__name__}"
        )
    ids = []
    for t in value:
        # bool is an int subclass (True == 1): refuse it explicitly; numpy/torch integer scalars
        # implement __index__, floats do not, so operator.index is the exact integer test.
        if isinstance(t, bool) or _is_bool_scalar(t):
            raise ValueError(f"prompt token ids must be integers, got {t!r} (a bool)")
        try:
            ids.append(operator.index(t))
        except TypeError:
            raise ValueError(f"prompt token ids must be integers, got {t!r} ({type(t).__name__})") from None
    return ids


def _is_bool_scalar(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.bool
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, np.bool_)


def windowed_space_caps(specs: list[SpaceSpec], page_size: int, max_num_seqs: int, max_chunk_tokens: int,
                        prefix_caching: bool) -> dict[str, int]:
    """Most pages each windowed space needs (LLMEngine._pages_per_space): one sequence computing
    a prefill chunk of max_chunk_tokens with its window, every other one its decode window."""
    decode = windowed_live_pages(specs, 1, page_size, prefix_caching)
    chunk = windowed_live_pages(specs, max_chunk_tokens, page_size, prefix_caching)
    return {name: (max_num_seqs - 1) * decode[name] + chunk[name] for name in decode}


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        logger.info("CPU compute threads: %d (of %s cores); %s", torch.get_num_threads(), os.cpu_count(),
                    OPENMP_RUNTIME.describe())
        if config.device == "cpu" and torch.cuda.is_available():
            logger.info("a CUDA device is visible but device='cpu' (the default): pass device='cuda' "
                        "(--device cuda) to run on it")
        model_dir = config.model
        if model_dir is None:
            from hybridkv.model_executor.demo_model import (
                demo_model_dir, ensure_demo_model, is_converted, prebuild_demo_kernels,
            )

            if not is_converted(demo_model_dir()) and resolve_device(config.device).type == "cpu":
                prebuild_demo_kernels(config.dtype)  # compiled while the checkpoint converts
            model_dir = ensure_demo_model()
        self.model_dir = model_dir
        # Everything that needs only the model's shape is planned and checked before the weights
        # load (config.json, on the meta device): a budget too small fails in a second.
        skeleton = model_skeleton(model_dir, config.dtype, config.max_model_len, resolve_device(config.device),
                                  config.attention_backend)
        specs = skeleton.specs
        self.max_model_len = skeleton.max_model_len
        self.block_size = self._choose_block_size(specs, skeleton.model)
        budget = config.max_num_batched_tokens or max(2048, self.max_model_len)
        self.hisparse = self._hisparse_plan(specs, skeleton.model) if config.enable_hisparse else None
        device_pages = self._pages_per_space(specs, budget)
        check_one_sequence_fits(specs, device_pages, self.block_size, self.max_model_len, budget,
                                config.enable_prefix_caching, config.kv_cache_memory_bytes)
        self._log_kv_budget(specs, device_pages)
        host_pages = self._host_pages_per_space(specs, device_pages) if config.enable_hierarchical_cache else None

        self.runner = ModelRunner(
            model_dir, config.dtype, config.max_model_len, config.seed, config.allow_pickle_weights,
            attention_backend=config.attention_backend, dequantize_weights=config.dequantize_weights,
            device=resolve_device(config.device), skeleton=skeleton,
        )
        if self.runner.space_specs() != specs:  # a model whose spaces depend on its weights: a bug
            raise RuntimeError(f"the loaded model's block spaces {self.runner.space_specs()} differ from the "
                               f"ones planned from its config {specs}")
        self.tokenizer = load_tokenizer(model_dir)
        self.generation_defaults = load_generation_config(model_dir)
        self.eos_token_ids = set(self.generation_defaults.eos_token_ids)
        if not self.eos_token_ids and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids = {self.tokenizer.eos_token_id}
        self.kv = KVCacheManager(
            specs, device_pages, self.block_size, config.enable_prefix_caching,
            config.eviction_policy, config.windowed_match,
            max_pages_per_request=-(-self.max_model_len // self.block_size) + 1,
            max_requests=min(config.max_num_seqs, 64),
            host_pages=host_pages, hicache_write_policy=config.hicache_write_policy,
            load_back_threshold=config.load_back_threshold,
            hisparse=self.hisparse.buffers(resolve_device(config.device)) if self.hisparse is not None else None,
        )
        self.runner.bind_kv_cache(self.kv, prefault=bool(config.kv_cache_prefault))
        if host_pages is not None:
            self.runner.bind_host_cache(host_pages, config.hicache_mem_layout)
        self.storage = self._make_storage_tier(specs) if config.hicache_storage_backend is not None else None
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, budget, self.max_model_len, config.scheduling_policy,
                            config.target_step_seconds, config.max_step_seconds,
                            preemption_mode=config.preemption_mode),
            self.kv, self.runner.step_cost, storage=self.storage,
        )
        self._groups: dict[str, _Group] = {}
        self._request_to_group: dict[str, _Group] = {}
        self._counter = itertools.count()  # request ids for callers that give none
        self._sequence_counter = itertools.count()  # internal sequence ids (_new_sequence_id)
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0, "burst_calls": 0}
        # Decode steps per model call (engine/decode_burst.py); off under a step-time target.
        # AsyncLLMEngine resolves it again as a streaming server.
        self.burst_limit = burst_limit(config.num_scheduler_steps, config.target_step_seconds, streaming=False)
        # Host tier copies the runner executed: bytes each way and seconds spent.
        self.tier_stats = {"load_back_bytes": 0, "write_back_bytes": 0, "transfer_seconds": 0.0}
        self._load_seconds_seen = 0.0  # host_cache.load_seconds already counted in transfer_seconds
        logger.info(
            "engine ready: model=%s dtype=%s max_model_len=%d block_size=%d spaces=%s prefix_caching=%s",
            model_dir, self.runner.dtype, self.max_model_len, self.block_size,
            {n: s.num_pages for n, s in self.kv.spaces.items()}, self.kv.enable_prefix_caching,
        )
        if host_pages is not None:
            logger.info(
                "host tier (HiCache L2): pages per space %s, %.1f MiB, layout=%s, write policy=%s, preemption=%s",
                host_pages, self.runner.host_cache.nbytes / 2**20, config.hicache_mem_layout,
                config.hicache_write_policy, config.preemption_mode,
            )

    def _log_kv_budget(self, specs: list[SpaceSpec], pages: dict[str, int]) -> None:
        """The KV budget in the startup log: bytes, and tokens of context it holds."""
        P = self.block_size
        total = sum(pages[s.name] * s.bytes_per_page(P) for s in specs)
        whole = [pages[s.name] for s in specs if not s.windowed] or list(pages.values())
        how = ("kv_cache_memory_bytes" if self.config.kv_cache_memory_bytes is not None else
               f"default: max_num_seqs={self.config.max_num_seqs} x max_model_len={self.max_model_len}, capped at "
               f"{kv_cache_fraction():g} of available memory ({FRACTION_VARIABLE})")
        taken = ("on huge pages, touched at start (kv_cache_prefault)" if self.config.kv_cache_prefault
                 else "pages taken as they are written")
        logger.info("KV cache budget: %.0f MiB, %d tokens of context (%s); %s", total / 2**20, min(whole) * P, how, taken)

    def _choose_block_size(self, specs, model) -> int:
        """The page size: the user's explicit block_size, or the model's default when it is None.

        Page boundaries must be compression boundaries, so a page size must be a multiple of
        every space's tokens_per_slot (their lcm). An explicit size that is not is an error
        naming the sizes that work; it is never silently replaced (16 may be a deliberate choice).
        """
        ratios = sorted({s.tokens_per_slot for s in specs})
        step = math.lcm(*ratios)
        # A model may declare its page size (DeepSeek-V4: 128). Otherwise 16, rounded up to a
        # multiple of the ratios (dense models: ratio 1, so 16).
        default = getattr(model, "default_block_size", None) or -(-DEFAULT_BLOCK_SIZE // step) * step
        if default % step:  # a model bug: its declared page size contradicts its own spaces
            raise RuntimeError(f"the model's default page size {default} is not a multiple of {ratios}")
        P = self.config.block_size
        if P is None:
            return default
        if P % step:
            valid = ", ".join(str(step * k) for k in range(1, 4))
            raise ValueError(
                f"block_size {P} is not a multiple of this model's compression ratios {ratios}: page "
                f"boundaries must be compression boundaries; use a multiple of {step} ({valid}, ...; "
                f"this model's default is {default}) or leave block_size unset for the default"
            )
        return P

    def _host_pages_per_space(self, specs, device_pages: dict[str, int]) -> dict[str, int]:
        """Host pages: the same count in every space (a node keeps at most one page per space, so
        windowed spaces need as many host pages as whole-history ones for every cached node to
        keep its window), hicache_ratio x the whole-history device pages, or what hicache_size
        bytes hold."""
        P = self.block_size
        if self.config.hicache_size is not None:
            n = self.config.hicache_size // sum(s.bytes_per_page(P) for s in specs)
            if n < 1:
                raise ValueError(f"hicache_size={self.config.hicache_size} bytes holds no page "
                                 f"(one page of every space takes {sum(s.bytes_per_page(P) for s in specs)} bytes)")
            return {s.name: n for s in specs}
        whole = [device_pages[s.name] for s in specs if not s.windowed] or list(device_pages.values())
        n = max(1, int(self.config.hicache_ratio * max(whole)))
        return {s.name: n for s in specs}

    def _make_storage_tier(self, specs):
        """The L3 store under the host tier: pages are named by hash chains seeded with this
        configuration's KV fingerprint (set on the index before any node exists)."""
        import json
        import os

        from hybridkv.block_manager.storage.backend import make_backend
        from hybridkv.engine.kv_fingerprint import kv_fingerprint
        from hybridkv.engine.storage_tier import StorageTier

        cfg = self.config
        fp = kv_fingerprint(self.model_dir, str(self.runner.dtype), self.block_size, specs,
                            self.runner.host_cache.page_layout)
        extra = cfg.hicache_storage_backend_extra_config
        if isinstance(extra, str):
            try:
                extra = json.loads(extra) if extra.strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(f"hicache_storage_backend_extra_config is not valid JSON: {e}") from None
        extra = dict(extra or {})
        if cfg.hicache_storage_backend == "file":  # beside the demo model, under HYBRIDKV_CACHE_DIR
            from hybridkv.model_executor.demo_model import default_cache_dir

            extra.setdefault("dir", cfg.hicache_storage_dir or os.path.join(default_cache_dir(), "kv_store"))
        backend = make_backend(cfg.hicache_storage_backend, extra)
        self.kv.index.chain_seed = fp.seed
        logger.info("storage tier (HiCache L3): backend=%s prefetch=%s fingerprint=%s",
                    cfg.hicache_storage_backend, cfg.hicache_storage_prefetch_policy, fp.seed.hex()[:16])
        return StorageTier(backend, self.kv, self.runner.host_cache, fp, cfg.hicache_storage_prefetch_policy)

    def _flush_tier_transfers(self, before_forward: bool = False) -> None:
        """Execute the device <-> host copies the KV manager decided (before any forward reads
        the pages; the order is tier_transfers.py's). before_forward: the load-backs are left to
        the forward, which waits for each layer's pages as it reaches that layer (overlapped on
        a CUDA side stream)."""
        transfers = self.kv.take_transfers()
        if transfers.empty:
            return
        t0 = time.perf_counter()
        host_cache = self.runner.host_cache
        to_host, to_device = host_cache.apply(transfers, defer_loads=before_forward)
        self.tier_stats["write_back_bytes"] += to_host
        self.tier_stats["load_back_bytes"] += to_device
        self.tier_stats["transfer_seconds"] += time.perf_counter() - t0  # includes the loads it completed
        self._load_seconds_seen = host_cache.load_seconds
        if self.storage is not None:
            self.storage.store(transfers)

    def _hisparse_plan(self, specs, model):
        from hybridkv.engine.config import HiSparseConfig
        from hybridkv.engine.hisparse_plan import HiSparsePlan

        layers = getattr(model, "hisparse_layers", lambda: None)()
        return HiSparsePlan.make(HiSparseConfig.parse(self.config.hisparse_config), layers, specs,
                                 self.block_size, self.config.max_num_seqs)

    def _pages_per_space(self, specs, max_chunk_tokens: int) -> dict[str, int]:
        """Split the KV memory between spaces by bytes per token of context.

        Whole-history spaces (full, c4, c128, indexer) all get n pages (n pages cover n*P
        tokens of history in each). A windowed space (swa, state_*) gets room for one sequence
        computing a prefill chunk of max_chunk_tokens (with its window) while every other one
        decodes (kv_cache_manager.windowed_live_pages: the window, plus a page where its start
        can fall inside one; with prefix caching, the widest window's), and never more than
        n + max_num_seqs pages; n is the largest count for which everything fits in the budget.
        Sized for decode, not for every sequence prefilling at once: a step whose several
        prefill chunks need more takes the scheduler's usual shortage path (preempt the
        newest); short prompts fit in their decode window, so only several long chunks in one
        step can get there.

        HiSparse (engine/hisparse_plan.py): the c4 space is the host mirror, outside the device
        budget, which pays the hot buffers instead.
        """
        P = self.block_size
        seqs = self.config.max_num_seqs
        mirror = [s for s in specs if self.hisparse is not None and s.name == self.hisparse.space]
        specs = [s for s in specs if s not in mirror]
        whole = [s for s in specs if not s.windowed]
        windowed = [s for s in specs if s.windowed]
        cap = windowed_space_caps(windowed, P, seqs, max_chunk_tokens, self.config.enable_prefix_caching)
        whole_bpp = sum(s.bytes_per_page(P) for s in whole)

        def cost(n: int) -> int:
            return n * whole_bpp + sum(min(n + seqs, cap[s.name]) * s.bytes_per_page(P) for s in windowed)

        budget = self.config.kv_cache_memory_bytes
        n_default = -(-seqs * (self.max_model_len + P) // P)
        hot = self.hisparse.device_bytes if self.hisparse is not None else 0
        if budget is None:  # engine/kv_budget.py: never below one full-length sequence
            one = one_sequence_bytes(specs, self.max_model_len, P, max_chunk_tokens, self.config.enable_prefix_caching)
            budget = min(cost(n_default) + hot, max(default_kv_cache_cap_bytes(), one + hot))
        if self.hisparse is not None:
            budget -= hot
            if budget <= 0:
                raise ValueError(
                    f"kv_cache_memory_bytes={self.config.kv_cache_memory_bytes} does not hold the HiSparse hot "
                    f"buffers ({self.hisparse.device_bytes} bytes: max_num_seqs={seqs} x hot_buffer_size="
                    f"{self.hisparse.hot_buffer_size} entries); raise it or lower max_num_seqs")
        if not whole:  # every space is windowed (e.g. Mistral): they share the whole budget
            n = max(1, budget // sum(s.bytes_per_page(P) for s in specs))
            if self.config.kv_cache_memory_bytes is None:
                n = min(n, max(cap.values()))
            return {s.name: n for s in specs}
        lo, hi = 1, max(1, budget // whole_bpp)
        while lo < hi:  # largest n with cost(n) <= budget (cost is monotone in n)
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if cost(mid) <= budget else (lo, mid - 1)
        pages = {s.name: lo for s in whole}
        pages.update({s.name: max(1, min(lo + seqs, cap[s.name])) for s in windowed})
        for s in mirror:
            limit = self.hisparse.mirror_pages(s.bytes_per_page(P))
            pages[s.name] = lo if limit is None else min(lo, limit)
        return pages

    # -- requests ------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text or None, token ids as a list of Python ints). Token ids may be a list, a tuple,
        a 1-D numpy array or a 1-D torch tensor of integers, bare or as a dict's prompt_token_ids."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty; pass a non-empty string or token ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), as_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)) or is_token_array(prompt):
            return None, as_token_ids(prompt)
        raise ValueError(
            f"prompt must be a string, token ids (list, tuple, 1-D numpy array or tensor) or a dict, "
            f"got {type(prompt).__name__}"
        )

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        client_id: Any = None,
        interactive: bool = True,
    ) -> str:
        """client_id: the fairness key admission round-robins over (default: request_id); give
        several requests the same key when they come from one client request (a prompt batch).
        interactive: someone watches this request's tokens arrive (a stream); only such decodes
        hold prefill chunks to the step-time target (config.target_step_seconds)."""
        params = params or SamplingParams()
        if request_id is None:
            request_id = str(next(self._counter))
            while request_id in self._groups:  # a caller chose this number as its own id
                request_id = str(next(self._counter))
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        self._validate_prompt(ids)
        room = self.max_model_len - len(ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, {params.max_tokens} in the "
                f"completion). Reduce the prompt or max_tokens."
            )
        if params.min_tokens > room:
            raise ValueError(
                f"min_tokens={params.min_tokens} cannot be generated: this model's maximum context length is "
                f"{self.max_model_len} tokens and the prompt has {len(ids)}, which leaves room for {room}."
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        children, detoks = [], {}
        for i in range(params.n):
            seed = params.seed + i if params.seed is not None else None
            child_params = params.clone(seed=seed)  # never mutate the caller's params
            child_params.all_stop_token_ids = set(params.stop_token_ids) | (
                set() if params.ignore_eos else self.eos_token_ids
            )
            child_id = self._new_sequence_id(request_id, i)
            req = Request(child_id, ids, child_params, max_tokens, namespace=cache_salt, priority=priority,
                          client_id=request_id if client_id is None else client_id, interactive=interactive)
            req.index = i
            children.append(req)
            detoks[child_id] = IncrementalDetokenizer(self.tokenizer, ids, child_params)
        group = _Group(request_id, text, ids, params, children, detoks)
        self._groups[request_id] = group
        for req in children:
            self._request_to_group[req.request_id] = group
            self.scheduler.add(req)
        self.stats["prompt_tokens"] += len(ids)
        return request_id

    def _new_sequence_id(self, request_id: str, index: int) -> str:
        """The internal id of one sequence (one of a request's n samples).

        The scheduler, the KV manager and the runner key their state by it. It is unique for
        the engine's lifetime whatever ids users choose: the part after the last "@" is a
        private counter (digits only, so that "@" always delimits it), and no two sequences get
        the same counter. The user's id and the sample index are kept in front only to make
        logs readable; outputs and abort_request use the user's request_id.
        """
        return f"{request_id}#{index}@{next(self._sequence_counter)}"

    def sequence_ids(self, request_id: str) -> list[str]:
        """The internal ids of a request's sequences while it is in flight (debug/test hooks
        such as runner.captured_logits key by them)."""
        group = self._groups.get(request_id)
        return [r.request_id for r in group.children] if group is not None else []

    def _validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt is empty; pass at least one token")
        vocab = self.runner.config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or t < 0 or t >= vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens, but max_model_len is {self.max_model_len} (the prompt plus at "
                f"least one generated token must fit); shorten the prompt or raise max_model_len"
            )

    def abort_request(self, request_id: str) -> None:
        group = self._groups.pop(request_id, None)
        if group is None:
            return
        for req in group.children:
            if not req.finished:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            self._request_to_group.pop(req.request_id, None)
            if self.kv.hisparse is not None:
                self.kv.hisparse.forget(req.request_id)
        self._flush_tier_transfers()  # its pages' host copies, decided as it left

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        self._flush_tier_transfers(before_forward=not sched.empty)  # load-backs and write-backs of evicted pages
        if sched.empty:
            if self.storage is not None and self.storage.num_outstanding:
                self.storage.wait()  # requests wait for their prefetch: sleep until a read lands
            return []
        steps = self._burst_steps(sched)
        tokens = self._run_burst(sched, steps) if steps > 1 else None
        if tokens is not None:
            touched = self._book_burst(sched, tokens, steps)
        else:
            steps = 1
            result = self.runner.execute(sched.model_input())
            if self.runner.host_cache is not None:  # the load-backs the forward completed layer by layer
                self.tier_stats["transfer_seconds"] += self.runner.host_cache.load_seconds - self._load_seconds_seen
                self._load_seconds_seen = self.runner.host_cache.load_seconds
            self.scheduler.update_after_step(sched)
            self.stats["steps"] += 1
            touched = self._process(sched, result)
        # Write-through of the pages this step completed, and of those that requests finishing
        # now published as they left (a decode's last pages are published at retire).
        self._flush_tier_transfers()
        outputs = [o for o in (self._make_output(g) for g in touched) if o is not None]
        # The whole step, as a stream sees it between two tokens (the latency target's unit).
        self.scheduler.observe_step(sched, (time.perf_counter() - t0) / steps)
        return outputs

    # -- decode bursts (num_scheduler_steps; engine/decode_burst.py) --------------------------------
    def _burst_steps(self, sched: SchedulerOutput) -> int:
        if (self.burst_limit <= 1 or sched.preempted or self.storage is not None or self.kv.hisparse is not None
                or not self.runner.burst_fits(len(sched.scheduled))):
            return 1
        return burst_steps(self.burst_limit, [s.request for s in sched.scheduled],
                           [s.num_new_tokens for s in sched.scheduled], self.scheduler.num_running,
                           self.scheduler.num_waiting, self.max_model_len)

    def _run_burst(self, sched: SchedulerOutput, steps: int) -> dict[str, list[int]] | None:
        """The burst's tokens per request, or None (an ordinary step runs instead): the pages of
        all its steps are allocated first (all-or-nothing per request; pages taken for a burst
        that then does not run are the ones the next steps would take)."""
        for s in sched.scheduled:
            if not self.kv.allocate(s.request_id, s.end + steps - 1, decode=True):
                return None
        tokens = self.runner.execute_burst(sched.model_input(), steps)
        if tokens is not None:
            self.stats["burst_calls"] += 1
        return tokens

    def _book_burst(self, sched: SchedulerOutput, tokens: dict[str, list[int]], steps: int) -> list[_Group]:
        """Record a burst's tokens one step at a time, as `steps` ordinary steps would: computed
        counts and published pages, then each request's token and stop check; a request that
        stopped takes no more of its tokens."""
        touched: dict[str, _Group] = {}
        live = sched.scheduled
        for j in range(steps):
            if j == 0:
                self.scheduler.update_after_step(sched)
            else:
                self.scheduler.update_after_decodes([s.request for s in live])
            self.stats["steps"] += 1
            result = RunnerOutput(sampled={s.request_id: SampledToken(tokens[s.request_id][j], None, None)
                                           for s in live})
            for group in self._process(sched, result):
                touched[group.request_id] = group
            live = [s for s in live if not s.request.finished]
            if not live:
                break
        return list(touched.values())

    def _process(self, sched: SchedulerOutput, result: RunnerOutput) -> list[_Group]:
        now = time.monotonic()
        touched: dict[str, _Group] = {}
        for s in sched.scheduled:
            if s.request.request_id not in result.prompt_logprobs:
                continue
            req = s.request
            first, entries = result.prompt_logprobs[req.request_id]
            if req.prompt_logprobs is None:
                req.prompt_logprobs = [None]  # the first prompt token has no logprob
            if len(req.prompt_logprobs) == first:  # skip a recomputation after preemption
                req.prompt_logprobs.extend(self._to_logprobs(e) for e in entries)
        for s in sched.scheduled:
            req = s.request
            sampled = result.sampled.get(req.request_id)
            if sampled is None:
                continue
            group = self._request_to_group[req.request_id]
            touched[group.request_id] = group
            tok = sampled.token_id
            req.append_output_token(tok)
            self.stats["generation_tokens"] += 1
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            if sampled.logprob is not None:
                req.cumulative_logprob += sampled.logprob
            if req.logprobs is not None and sampled.top_logprobs is not None:
                req.logprobs.append(self._to_logprobs(sampled.top_logprobs))
            status = self._check_stop(req, group.detoks[req.request_id])
            if status is not None:
                self.scheduler.finish(req, status)
        return list(touched.values())

    def _check_stop(self, req: Request, detok: IncrementalDetokenizer) -> RequestStatus | None:
        tok = req.output_token_ids[-1]
        past_min = req.num_output_tokens >= req.params.min_tokens
        if past_min and tok in req.params.all_stop_token_ids:
            # The stop token stays in token_ids but not in the text (vLLM's behaviour).
            req.stop_reason = None if tok in self.eos_token_ids and tok not in req.params.stop_token_ids else tok
            return RequestStatus.FINISHED_STOPPED
        stop_str = detok.update([tok], check_stop=past_min)
        if stop_str is not None:
            req.stop_reason = stop_str
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _to_logprobs(self, entries: list[tuple[int, float, int]]) -> PositionLogprobs:
        return {tid: Logprob(lp, rank, self.tokenizer.decode([tid])) for tid, lp, rank in entries}

    # -- outputs ------------------------------------------------------------------------------
    def _make_output(self, group: _Group) -> RequestOutput | None:
        kind = group.params.output_kind
        finished = all(r.finished for r in group.children)
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        outputs = []
        for req in group.children:
            rid = req.request_id
            if delta and rid in group.reported_finished:
                continue
            detok = group.detoks[rid]
            text = detok.get_next_output_text(req.finished, delta)
            ids = req.output_token_ids
            logprobs = req.logprobs
            if delta:
                start = group.sent_tokens.get(rid, 0)
                ids = ids[start:]
                group.sent_tokens[rid] = req.num_output_tokens
                if logprobs is not None:
                    lstart = group.sent_logprobs.get(rid, 0)
                    group.sent_logprobs[rid] = len(logprobs)
                    logprobs = logprobs[lstart:]
                if not ids and not text and not req.finished:
                    continue
            if req.finished:
                group.reported_finished.add(rid)
            outputs.append(
                CompletionOutput(
                    index=req.index,
                    text=text,
                    token_ids=list(ids),
                    cumulative_logprob=req.cumulative_logprob if req.params.logprobs is not None else None,
                    logprobs=list(logprobs) if logprobs is not None else None,
                    finish_reason=req.finish_reason,
                    stop_reason=req.stop_reason,
                )
            )
        lead = group.children[0]
        prompt_logprobs = lead.prompt_logprobs
        if delta and prompt_logprobs is not None:
            if group.sent_prompt_logprobs or len(prompt_logprobs) < lead.num_prompt_tokens:
                prompt_logprobs = None
            else:
                group.sent_prompt_logprobs = True
        if delta and not outputs and not finished:
            return None
        metrics = self._metrics(group)
        if finished:
            self._groups.pop(group.request_id, None)
            for r in group.children:
                self._request_to_group.pop(r.request_id, None)
                if self.kv.hisparse is not None:
                    self.kv.hisparse.forget(r.request_id)
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=max(0, lead.num_cached_tokens),
            metrics=metrics,
        )

    def _metrics(self, group: _Group) -> dict:
        lead = group.children[0]
        return {
            "arrival_time": lead.arrival_time,
            "first_scheduled_time": lead.first_scheduled_time,
            "first_token_time": lead.first_token_time,
            "last_token_time": lead.last_token_time,
            "num_preemptions": sum(r.num_preemptions for r in group.children),
            "num_cached_tokens": max(0, lead.num_cached_tokens),
            # Where the prompt came from: device cache, host tier (loaded back), or computed.
            "prompt_tokens_from_device": max(0, lead.num_cached_tokens) - lead.num_host_cached_tokens,
            "prompt_tokens_from_host": lead.num_host_cached_tokens - lead.num_storage_cached_tokens,
            "prompt_tokens_from_storage": lead.num_storage_cached_tokens,
            "prompt_tokens_computed": len(lead.prompt_token_ids) - max(0, lead.num_cached_tokens),
            "cached_tokens_per_space": dict(lead.cached_tokens_per_space),
            **self._hisparse_metrics(group),
        }

    def _hisparse_metrics(self, group: _Group) -> dict:
        """HiSparse: the share of the request's selected C4 entries found in its hot buffers."""
        if self.kv.hisparse is None:
            return {}
        counts = [self.kv.hisparse.request_counts(r.request_id) for r in group.children]
        lookups, hits = sum(c[0] for c in counts), sum(c[1] for c in counts)
        return {"hisparse_lookups": lookups, "hisparse_hit_rate": hits / lookups if lookups else None}

    # -- introspection -------------------------------------------------------------------------
    def hisparse_stats(self) -> dict[str, float]:
        """HiSparse counters for /metrics ({} when it is off)."""
        buffers = self.kv.hisparse
        if buffers is None:
            return {}
        st, plan = buffers.stats, self.hisparse
        mirror = self.kv.spaces[plan.space]
        return {
            "lookups": st.lookups, "hits": st.hits, "loaded": st.loaded, "inserted": st.inserted,
            "handoffs": st.handoffs, "loaded_bytes": st.loaded * plan.entry_bytes // plan.num_layers,
            "rows_in_use": buffers.num_active, "rows": buffers.max_requests,
            "mirror_pages_in_use": mirror.num_in_use + mirror.num_cached, "mirror_pages": mirror.num_pages,
        }

    def check_invariants(self) -> None:
        self.kv.check_invariants()

    def reset_prefix_cache(self) -> int:
        return self.kv.reset_prefix_cache()

"""ModelRunner: scheduled batch -> tensors -> forward -> sampled tokens.

It owns the model, the physical KV tensors of every block space and the sampler. The engine
gives it a ModelInput (model_executor/batch.py) and the step's KVPlan (block tables, rows, tier
copies: block_manager/kv_plan.py); it never decides what runs or where pages go, and it imports
neither the engine nor the KV cache manager.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from concurrent.futures import wait
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
import torch

from hybridkv.attention_backends.hybrid_metadata import KeySet
from hybridkv.attention_backends.metadata import StepSequences
from hybridkv.attention_backends.cpu_kernels.build import prebuild
from hybridkv.attention_backends.hisparse_buffers import HotBuffers
from hybridkv.attention_backends.kv_cache_dtype import is_fp8, resolve_kv_cache_dtype
from hybridkv.attention_backends.registry import check_attention_backend, get_attention_backend
from hybridkv.block_manager.kv_plan import KVCacheLayout, KVPlan, TierTransfers
from hybridkv.model_executor.host_kv_cache import HostKVCache
from hybridkv.model_executor.heap_retention import release_free_heap, retain_freed_heap
from hybridkv.model_executor.huge_pages import move_parameters_to_huge_pages
from hybridkv.block_manager.space_spec import NULL_PAGE, SpaceSpec
from hybridkv.model_executor.batch import ModelInput, ScheduledSequence, verify_rows
from hybridkv.model_executor.checkpoint import iter_weights, load_config, resolve_dtype, weight_files
from hybridkv.model_executor.init_modes import SkipRandomInit
from hybridkv.model_executor.layers import packed_copy_serves_every_input
from hybridkv.model_executor.quantization import (
    attach_block_scales, checkpoint_bytes, describe_weights, quantization_config_of, weight_inventory,
)
from hybridkv.model_executor.models.base import CausalLM
from hybridkv.model_executor.models.registry import resolve_model_class
from hybridkv.model_executor.mtp_drafter import MtpDrafter, check_mtp
from hybridkv.model_executor.parallel.shard_loader import iter_weight_shards
from hybridkv.model_executor.parallel.state import TensorParallel
from hybridkv.model_executor.rejection_sampler import DraftedSequence, sample_drafted
from hybridkv.model_executor.sampler import Sampler, SamplingBatch, compute_prompt_logprobs, greedy_tokens


logger = logging.getLogger(__name__)


def dequantize_weights_wanted(explicit: bool | None, checkpoint_asks: bool) -> bool:
    """Whether to expand block-quantized weights to the model dtype at load instead of keeping
    them compressed (faster matmuls, 2-4x the memory). The caller's choice wins, then
    HYBRIDKV_DEQUANTIZE_WEIGHTS=1/0, then the checkpoint's quantization_config.dequantize."""
    if explicit is not None:
        return explicit
    env = os.environ.get("HYBRIDKV_DEQUANTIZE_WEIGHTS")
    if env is not None and env.strip() != "":
        return env.strip() not in ("0", "false", "False")
    return checkpoint_asks


def debug_checks_enabled() -> bool:
    """HYBRIDKV_DEBUG_CHECKS=1 turns on the runner's per-step assertions (null-page writes)."""
    return os.environ.get("HYBRIDKV_DEBUG_CHECKS", "0") not in ("", "0")


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float, int]] | None


@dataclass
class RunnerOutput:
    sampled: dict[str, SampledToken] = field(default_factory=dict)
    # request id -> (first prompt position these entries describe, entries)
    prompt_logprobs: dict[str, tuple[int, list[list[tuple[int, float, int]]]]] = field(default_factory=dict)
    # request id -> the model's token after each of its rows (ModelInput.verify's sequences), up
    # to the first that differs from the next draft: every row's argmax for a greedy request; for
    # a sampled one, its accepted drafts then the one token drawn after them (rejection_sampler.py)
    verified: dict[str, list[int]] = field(default_factory=dict)


def resolve_max_model_len(config, max_model_len: int | None) -> int:
    """The context length: the model's max_position_embeddings unless a shorter one is asked."""
    model_max = getattr(config, "max_position_embeddings", None) or 2048
    if max_model_len is None:
        return model_max
    if max_model_len > model_max:
        raise ValueError(f"max_model_len {max_model_len} is longer than the model's max_position_embeddings {model_max}")
    return max_model_len


@dataclass
class ModelSkeleton:
    """What the engine plans KV memory from, read from config.json alone: the model built on the
    meta device (no weights, no memory), its dtype, context length and block spaces, and the
    dtype its KV pools are stored in (kv_dtype: the model's, or FP8 with kv_cache_dtype)."""

    config: object  # the checkpoint's config (transformers' PretrainedConfig)
    model: CausalLM
    dtype: torch.dtype
    max_model_len: int
    specs: list[SpaceSpec]
    kv_dtype: torch.dtype
    mtp: bool = False  # built with the checkpoint's MTP layer (speculative decoding's drafter)


def build_model(cls: type[CausalLM], config, max_positions: int, parallel: TensorParallel | None,
                mtp: bool = False) -> CausalLM:
    """An instance of the model class: whole, or (parallel) this rank's shard; mtp: with its MTP
    layer (check_mtp first)."""
    if parallel is None:
        return cls(config, max_positions=max_positions, **({"mtp": True} if mtp else {}))
    if not cls.supports_tensor_parallel:
        raise ValueError(f"{cls.__name__} is not supported yet with tensor_parallel_size > 1 (the dense "
                         "Llama-family and Gemma-3 models and DeepSeek-V4 are)")
    if parallel.expert_parallel and not cls.supports_expert_parallel:
        raise ValueError(f"enable_expert_parallel applies to mixture-of-experts models; {cls.__name__} has no "
                         "routed experts (leave it off)")
    return cls(config, max_positions=max_positions, parallel=parallel)


def model_skeleton(model_dir: str, dtype: str | torch.dtype, max_model_len: int | None,
                   device: torch.device | str, attention_backend: str = "auto",
                   parallel: TensorParallel | None = None, mtp: bool = False,
                   kv_cache_dtype: str = "auto") -> ModelSkeleton:
    """The model of model_dir as ModelRunner will build it, on the meta device: in well under a
    second, so every check that needs only its shape runs before the weights load (the attention
    backend's first of all). parallel: rank 0's shard (every rank's KV shard has its shape).
    mtp: with the checkpoint's MTP layer (its K/V in the model's spaces)."""
    check_attention_backend(attention_backend, device)
    config = load_config(model_dir)
    resolved = resolve_dtype(dtype, config, torch.device(device))
    max_len = resolve_max_model_len(config, max_model_len)
    cls = resolve_model_class(config)
    kv_dtype = kv_cache_dtype_for(cls, kv_cache_dtype, resolved, attention_backend)
    if mtp:
        check_mtp(cls, model_dir, parallel)
    with torch.device("meta"), SkipRandomInit():
        model = build_model(cls, config, max_len, parallel, mtp)
    return ModelSkeleton(config, model, resolved, max_len, model.space_specs(kv_dtype), kv_dtype, mtp)


def kv_cache_dtype_for(cls: type[CausalLM], kv_cache_dtype: str, dtype: torch.dtype,
                       attention_backend: str) -> torch.dtype:
    """The dtype cls's KV pools are stored in (kv_cache_dtype's name resolved against the model
    dtype), or ValueError naming kv_cache_dtype and the path that cannot read an FP8 cache."""
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype)
    if is_fp8(kv_dtype):
        missing = cls.fp8_kv_cache_refusal()
        if missing is not None:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported for {cls.__name__}: {missing}; "
                             "use kv_cache_dtype='auto'")
        if attention_backend == "xformers":
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported by the xformers attention backend "
                             "(its kernels read K/V in the model dtype); use attention_backend='torch_native' or "
                             "'triton', or kv_cache_dtype='auto'")
    return kv_dtype


class ModelRunner:
    def __init__(
        self,
        model_dir: str,
        dtype: str | torch.dtype = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        allow_pickle_weights: bool = False,
        attention_backend: str = "auto",
        device: torch.device | str = "cpu",
        dequantize_weights: bool | None = None,
        skeleton: ModelSkeleton | None = None,
        parallel: TensorParallel | None = None,
        mtp: bool = False,
        kv_cache_dtype: str = "auto",
    ) -> None:
        """`skeleton`: the engine's model_skeleton of the same arguments, whose config, dtype, context
        length and MTP choice are taken as they are (resolved and logged once). `parallel`: this rank of
        a tensor-parallel group: the runner builds and loads its shard, and only rank 0 samples.
        `mtp`: with the checkpoint's MTP layer, which drafts for speculative decoding (propose_mtp).
        `kv_cache_dtype`: "auto" or an FP8 format (attention_backends/kv_cache_dtype.py); with a
        skeleton, the skeleton's KV dtype is taken instead."""
        self.device = torch.device(device)
        self.parallel = parallel
        if self.device.type == "cpu":  # each layer's activations are freed and allocated again
            retention = retain_freed_heap()
            logger.info("heap retention (heap_retention.py): %s (%s)", "on" if retention.applied else "off",
                        retention.reason)
        self.config = load_config(model_dir) if skeleton is None else skeleton.config
        self.dtype = resolve_dtype(dtype, self.config, self.device) if skeleton is None else skeleton.dtype
        # Validated before the (slow) load: an unsupported quant_method / fmt fails fast.
        self.quantization = quantization_config_of(self.config)
        self.dequantize_weights = self.quantization is not None and dequantize_weights_wanted(
            dequantize_weights, self.quantization.dequantize
        )
        self.max_model_len = max_model_len = (resolve_max_model_len(self.config, max_model_len) if skeleton is None
                                              else skeleton.max_model_len)
        check_attention_backend(attention_backend, self.device)  # a typo or a missing device: before anything
        cls = resolve_model_class(self.config)
        mtp = skeleton.mtp if skeleton is not None else mtp
        if mtp and skeleton is None:
            check_mtp(cls, model_dir, parallel)
        # The KV pools' dtype: the model's, or FP8 (kv_cache_dtype), refused before the load where unsupported.
        self.kv_dtype = (kv_cache_dtype_for(cls, kv_cache_dtype, self.dtype, attention_backend) if skeleton is None
                         else skeleton.kv_dtype)
        # The C++ kernels this model uses compile side by side (once per build environment)
        # while the backend is resolved and the weights load; each caller waits for its own.
        self.kernel_builds = prebuild(cls.cpu_kernel_loaders(self.dtype) if self.device.type == "cpu" else [])
        # Resolved before the (slow) load: a typo (listing the choices) or a backend that cannot
        # run here (naming the missing device or package) fails fast. "auto" -> a concrete name,
        # logged; models with their own attention (DeepSeek-V4) read attention_backend_name.
        self.backend = get_attention_backend(attention_backend, self.device)
        self.attention_backend_name: str = self.backend.name
        t0 = time.perf_counter()
        with self.device, SkipRandomInit():  # every weight comes from the checkpoint
            model = build_model(cls, self.config, max_model_len, parallel, mtp)
        model.attention_backend_name = self.attention_backend_name
        quantized_names: list[str] = []
        weights = (iter_weights(model_dir, allow_pickle=allow_pickle_weights) if parallel is None
                   else iter_weight_shards(model_dir, model.shard().slice_of))
        model.load_weights(attach_block_scales(
            weights, self.quantization, dequantize=self.dequantize_weights, paired=quantized_names,
        ))
        model.cast_to(self.dtype)
        self.step_cost = model.step_cost()  # before packing: it counts parameters
        packing = self.device.type == "cpu" and self.model_packing_wanted()
        # Parameters whose packed copy will serve every input are released once packed, so
        # they are not copied onto huge pages first (the weights are then held once).
        release = frozenset(id(m) for m in model.linears_read_only_by_forward()
                            if packing and packed_copy_serves_every_input(m.weight)) if packing else frozenset()
        if self.device.type == "cpu":  # each decode step streams them: 2 MiB pages (huge_pages.py)
            skip = frozenset(id(m.weight) for m in model.modules() if id(m) in release)
            logger.info("weights on huge pages: %.0f MiB", move_parameters_to_huge_pages(model, skip) / 2**20)
        self.model = model.eval()
        # Speculative decoding's MTP drafter (mtp_drafter.py): its draft extend after every step.
        self.mtp_drafter = MtpDrafter(self.model) if mtp else None
        if packing:
            self.model.pack_weights(release)
        if self.device.type == "cpu":  # the load's and the packing's freed tensors go back to the OS
            release_free_heap()
        wait(self.kernel_builds)  # every module is ready (or logged as unavailable) before the first step
        logger.info("loaded %s (%s, %s) in %.1fs", model_dir, self.dtype, self.device, time.perf_counter() - t0)
        self._log_weights(model_dir, quantized_names, allow_pickle_weights)
        self.sampler = Sampler(torch.Generator().manual_seed(seed))
        self.layout: KVCacheLayout | None = None
        self.host_cache: HostKVCache | None = None
        self.windows: dict[str, int | None] = {}
        # Tier copies executed: bytes each way and host seconds spent (load-backs a forward
        # completed layer by layer included).
        self.copy_stats = {"load_back_bytes": 0, "write_back_bytes": 0, "transfer_seconds": 0.0}
        self._load_seconds_seen = 0.0
        self.kv_caches: dict[str, list[torch.Tensor]] = {}  # space -> all its physical tensors (slots on dim -2)
        # Assert every step that no new token is written into a space's null page (tests set
        # this attribute directly; HYBRIDKV_DEBUG_CHECKS=1 sets it for a whole run).
        self.debug_checks = debug_checks_enabled()
        # Debug/parity hook: when a dict, the logits of every computed position are appended
        # per request id (tests compare them to transformers).
        self.captured_logits: dict[str, list[torch.Tensor]] | None = None

    def _log_weights(self, model_dir: str, quantized_names: list[str], allow_pickle: bool) -> None:
        """Which tensors are kept FP8/FP4, which were expanded, and the resident weight memory."""
        if self.quantization is not None:
            logger.info("checkpoint quantization: %s", self.quantization.describe())
        expanded = quantized_names if self.dequantize_weights else None
        files = checkpoint_bytes(weight_files(model_dir, allow_pickle=allow_pickle))
        for line in describe_weights(weight_inventory(self.model), files, expanded):
            logger.info("%s", line)

    @staticmethod
    def model_packing_wanted() -> bool:
        # HYBRIDKV_PACK_WEIGHTS=0 keeps plain F.linear (for comparing numerics or speed).
        return os.environ.get("HYBRIDKV_PACK_WEIGHTS", "1") != "0"

    # -- KV cache --------------------------------------------------------------------------
    def space_specs(self) -> list[SpaceSpec]:
        return self.model.space_specs(self.kv_dtype)

    def bind_kv_cache(self, layout: KVCacheLayout, prefault: bool = False) -> None:
        """Allocate each space's physical tensors (the model's hook) and bind them to its layers;
        prefault: on huge pages, touched now (huge_pages.kv_pool_on), rather than taken lazily."""
        self.layout = layout
        self.windows = layout.windows
        self.kv_caches = self.model.allocate_kv_cache(layout, self.backend, self.kv_dtype, self.device,
                                                      prefault=prefault)
        if self.kv_dtype != self.dtype:
            logger.info("KV cache in %s (kv_cache_dtype), the model in %s", self.kv_dtype, self.dtype)

    @property
    def hot_buffers(self) -> HotBuffers | None:
        """HiSparse's hot buffers, the model's (None: off). The engine reads their counters and
        tells them which requests left (release_requests)."""
        return getattr(self.model, "hot_buffers", None)

    def release_requests(self, request_ids: Iterable[str]) -> None:
        """Requests that left the device (finished, preempted, aborted): their HiSparse hot-buffer
        rows are emptied and free for others."""
        buffers = self.hot_buffers
        if buffers is not None:
            for rid in request_ids:
                buffers.release(rid)
        if self.mtp_drafter is not None:
            self.mtp_drafter.release(request_ids)

    def kv_cache_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes allocated for the KV cache per tier ("device", "host") and space, summed over
        the tensors themselves: each space's pools (in host memory: layout.host_spaces, HiSparse's
        c4 mirror), the model's auxiliary tensors on the device (HiSparse's "hot_buffer"), and the
        host tier's page buffers (HiCache L2) in host memory."""
        out: dict[str, dict[str, int]] = {"device": {}, "host": {}}

        def add(tier: str, name: str, tensors: list[torch.Tensor]) -> None:
            out[tier][name] = out[tier].get(name, 0) + sum(t.numel() * t.element_size() for t in tensors)

        host_spaces = self.layout.host_spaces if self.layout is not None else frozenset()
        for name, tensors in self.kv_caches.items():
            add("host" if name in host_spaces else "device", name, tensors)
        for name, tensors in self.model.auxiliary_kv_tensors().items():
            add("device", name, tensors)
        if self.host_cache is not None:
            for name, tensors in self.host_cache.host.items():
                add("host", name, tensors)
        return out

    def bind_host_cache(self, host_pages: dict[str, int], mem_layout: str) -> None:
        """The host tier's page buffers for every space (HiCache L2); pinned on CUDA."""
        P = self.layout.page_size
        self.host_cache = HostKVCache(
            self.kv_caches, {n: s.slots_per_page(P) for n, s in self.layout.specs.items()}, host_pages,
            layout=mem_layout, pin_memory=self.device.type == "cuda",
        )

    def stored_host_pages(self) -> HostKVCache:
        """The host pages a storage tier reads and fills (block_manager/storage_tier.HostPages)."""
        return self.host_cache

    def run_copies(self, copies: TierTransfers, defer_loads: bool = False) -> None:
        """Execute tier copies (the order is kv_plan.py's TierTransfers'). defer_loads: the
        load-backs are left to the next forward, which waits for each layer's pages as it reaches
        that layer (overlapped on a CUDA side stream)."""
        if copies.empty:
            return
        t0 = time.perf_counter()
        to_host, to_device = self.host_cache.apply(copies, defer_loads=defer_loads)
        self.copy_stats["write_back_bytes"] += to_host
        self.copy_stats["load_back_bytes"] += to_device
        self.copy_stats["transfer_seconds"] += time.perf_counter() - t0  # includes the loads it completed
        self._load_seconds_seen = self.host_cache.load_seconds

    # -- one step ------------------------------------------------------------------------------
    @staticmethod
    def decodes_first(items: list[ScheduledSequence]) -> tuple[list[ScheduledSequence], int]:
        """The step's sequences with its decodes first (stable), and how many there are. A decode
        is one new token at a generated position: the backend's batched decode group (the paged
        kernel). A prompt's one-token chunk (the rest of the prompt cached or computed before) is
        not one: its row goes through the prefill kernel like the rest of the prompt, so its bits
        do not depend on how the prompt was chunked or cached (the two kernels round differently;
        tests/engine/test_batch_invariance.py). The scheduler mostly hands decodes over first."""
        dec = [s.end - s.start == 1 and s.start >= len(s.prompt_token_ids) for s in items]
        n = dec.count(True)
        if dec[:n].count(True) == n:
            return items, n
        return [s for s, d in zip(items, dec) if d] + [s for s, d in zip(items, dec) if not d], n

    def step_sequences(self, items: list[ScheduledSequence], plan: KVPlan,
                       num_decodes: int | None = None) -> StepSequences:
        """Lengths of the step's sequences and their block-table rows: one take per space.
        (Plain list comprehensions: on CPython 3.11+ their specialised slot reads are ~3x faster
        than map over operator.attrgetter for the hundreds of sequences of a step.)"""
        ids = [s.request_id for s in items]
        ctx = [s.end for s in items]
        tables = plan.step_tables(ids, -(-max(ctx) // self.layout.page_size))  # no space needs more pages than a raw-token one
        return StepSequences([s.end - s.start for s in items], ctx, tables, ids,
                             decode_tiles=self.backend.needs_decode_tiles, decodes=num_decodes,
                             # only prefill chunks can regenerate rows: a decode-only step skips it
                             prompt_lens=(None if num_decodes == len(items)
                                          else [len(s.prompt_token_ids) for s in items]))

    @torch.inference_mode()
    def execute(self, batch: ModelInput, plan: KVPlan) -> RunnerOutput:
        """One forward of the batch under the step's plan: its tier copies first (load-backs
        deferred to the layers that read them), then the forward and sampling."""
        if self.host_cache is not None:
            self.run_copies(plan.copies, defer_loads=True)
        verify = batch.verify if self.model.verify_rows_as_decodes else frozenset()
        items, num_decodes = self.decodes_first(verify_rows(batch.sequences, verify))
        seqs = self.step_sequences(items, plan, num_decodes)
        meta = self.model.build_attention_metadata(seqs, self.windows, self.layout.page_size)
        if self.debug_checks:
            self.check_no_null_page_writes(meta)
        positions = torch.from_numpy(seqs.token_rows[1])  # token j of sequence i sits at start_i + j
        ids = torch.tensor(list(itertools.chain.from_iterable(s.token_ids for s in items)), dtype=torch.long)
        if self.device.type != "cpu":
            meta, ids, positions = _to_device(meta, self.device), ids.to(self.device), positions.to(self.device)
        # Host-tier load-backs of this step: every reader of the KV cache waits for its layer's
        # pages (model_executor/kv_loads.py); whatever nobody waited for completes after.
        loads = self.host_cache.take_loads() if self.host_cache is not None else None
        meta.kv_loads = loads
        sampling, sampled_rows = self.sampled(items)
        output_rows = None if batch.verify else self._output_rows(sampled_rows, items, ids)
        try:
            hidden = self.model(ids, positions, meta, output_rows=output_rows)
        finally:
            if loads is not None:
                self.host_cache.loads_done(loads)
                # the load-backs the forward completed layer by layer
                self.copy_stats["transfer_seconds"] += self.host_cache.load_seconds - self._load_seconds_seen
                self._load_seconds_seen = self.host_cache.load_seconds

        if self.captured_logits is not None and self.parallel is None:
            all_logits = self.model.compute_logits(hidden).float().cpu()
            row = 0
            for s in items:
                self.captured_logits.setdefault(s.request_id, []).append(all_logits[row : row + s.num_new_tokens])
                row += s.num_new_tokens

        out = RunnerOutput()
        if output_rows is None:  # every row came back
            row = 0
            for s in items:
                if s.wants_prompt_logprobs:
                    self._prompt_logprobs(s, hidden[row : row + s.num_new_tokens], out)
                row += s.num_new_tokens
            if batch.verify:
                self._verify(items, batch.verify, hidden, out)
            if len(sampled_rows) != ids.shape[0]:
                hidden = hidden[sampled_rows]
        if not sampling:
            return self._mtp_extend(items, positions, meta, out)
        # The sampler works on the host (per-request torch.Generators are CPU generators), in
        # float32 except for plain greedy rows, whose argmax it takes in the model's dtype.
        logits = self.model.compute_logits(hidden)
        if logits is None:  # a tensor-parallel rank other than 0: its columns went to rank 0
            return out
        bits, bitmask_rows = self._bitmask_rows(batch, sampling)
        res = self.sampler(
            logits.cpu(),
            SamplingBatch(
                params=[s.params for s in sampling],
                generators=[s.generator for s in sampling],
                prompt_token_ids=[s.prompt_token_ids for s in sampling],
                output_token_ids=[s.output_token_ids for s in sampling],
                token_bitmask=bits,
                bitmask_rows=bitmask_rows,
            ),
        )
        for i, s in enumerate(sampling):
            out.sampled[s.request_id] = SampledToken(
                res.token_ids[i],
                None if res.sampled_logprobs is None else res.sampled_logprobs[i],
                res.top_logprobs[i],
            )
        return self._mtp_extend(items, positions, meta, out)

    def _mtp_extend(self, items: list[ScheduledSequence], positions: torch.Tensor, meta,
                    out: RunnerOutput) -> RunnerOutput:
        """With an MTP drafter: its draft extend over the step's rows (mtp_drafter.py)."""
        if self.mtp_drafter is not None:
            self.mtp_drafter.extend(items, positions, meta, {rid: t.token_id for rid, t in out.sampled.items()},
                                    out.verified)
        return out

    @torch.inference_mode()
    def propose_mtp(self, request_ids: list[str], num_computed: list[int], last_tokens: list[int],
                    num_drafts: list[int], plan: KVPlan) -> dict[str, list[int]]:
        """Greedy drafts of the MTP layer for these decoding requests (each num_computed tokens in
        the cache, last_tokens the next), batched: up to num_drafts[i] each, none for a request
        without an MTP row at its last token. plan: their block tables, with pages for the drafts'
        positions."""
        P = self.layout.page_size

        def rows_meta(ids: list[str], rows: list[int]) -> tuple[object, torch.Tensor]:
            tables = plan.step_tables(ids, -(-(max(rows) + 1) // P))
            seqs = StepSequences([1] * len(ids), [p + 1 for p in rows], tables, ids,
                                 decode_tiles=self.backend.needs_decode_tiles, decodes=len(ids))
            meta = self.model.build_attention_metadata(seqs, self.windows, P)
            positions = torch.tensor(rows, dtype=torch.long)
            if self.device.type != "cpu":
                meta, positions = _to_device(meta, self.device), positions.to(self.device)
            return meta, positions

        return self.mtp_drafter.propose(request_ids, num_computed, last_tokens, num_drafts, rows_meta)

    def _verify(self, items: list[ScheduledSequence], verify: frozenset[str], hidden: torch.Tensor,
                out: RunnerOutput) -> None:
        """The model's token after the rows of each verified request, whose rows are its entries of
        `items` in position order (one chunk, or one-token decodes: verify_rows). A greedy request
        gets the argmax after every row, as the sampler's would give it for each row alone (the same
        logits head, the same argmax, in the model's dtype). A sampled one gets what speculative
        sampling yields (rejection_sampler.py): its accepted drafts, then the one token drawn after
        them."""
        rows_of: dict[str, list[int]] = {}
        entries_of: dict[str, list[ScheduledSequence]] = {}
        row = 0
        for s in items:
            if s.request_id in verify:
                rows_of.setdefault(s.request_id, []).extend(range(row, row + s.num_new_tokens))
                entries_of.setdefault(s.request_id, []).append(s)
            row += s.num_new_tokens
        rows = [r for rs in rows_of.values() for r in rs]
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])
        if logits is None:  # a tensor-parallel rank other than 0: its columns went to rank 0
            return
        logits = logits.cpu()
        span_of, first = {}, 0  # request id -> its rows of `logits`
        for rid, rs in rows_of.items():
            span_of[rid] = (first, first + len(rs))
            first += len(rs)
        sampled = [rid for rid, entries in entries_of.items() if not entries[0].params.greedy]
        if len(sampled) < len(rows_of):
            tokens = greedy_tokens(logits).tolist()
            for rid, (lo, hi) in span_of.items():
                if entries_of[rid][0].params.greedy:
                    out.verified[rid] = tokens[lo:hi]
        if sampled:
            seqs = []
            for rid in sampled:
                head = entries_of[rid][0]
                inputs = [t for s in entries_of[rid] for t in s.token_ids]  # the last known token, then the drafts
                seqs.append(DraftedSequence(head.params, head.generator, head.prompt_token_ids,
                                            head.output_token_ids, inputs[1:]))
            sampled_rows = torch.tensor([r for rid in sampled for r in range(*span_of[rid])])
            for rid, tokens in zip(sampled, sample_drafted(logits[sampled_rows], seqs, self.sampler.default_generator)):
                out.verified[rid] = tokens

    def burst_fits(self, num_decodes: int) -> bool:
        """Whether execute_burst can run this many decodes here (asked before their pages are
        allocated): the model's burst path takes them, and nothing execute_burst refuses is on."""
        return (self.device.type == "cpu" and self.captured_logits is None and self.host_cache is None
                and self.mtp_drafter is None  # its draft extend follows every forward
                and 0 < num_decodes <= self.model.decode_burst_rows())

    @torch.inference_mode()
    def execute_burst(self, batch: ModelInput, steps: int, plan: KVPlan) -> dict[str, list[int]] | None:
        """`steps` greedy decode steps of a batch of decodes in one model call (the engine's
        num_scheduler_steps; it allocated every step's pages and checked the requests sample
        greedily): each request's `steps` tokens, the ones `steps` calls of execute() would give.
        None where the model has no such path for this batch; the engine then runs one step."""
        items = batch.sequences
        if not self.burst_fits(len(items)) or any(s.end - s.start != 1 for s in items):
            return None
        P = self.layout.page_size
        request_ids = [s.request_id for s in items]
        ctx0 = [s.end for s in items]
        # the last step's pages: the tables serve every step
        tables = plan.step_tables(request_ids, -(-(max(ctx0) + steps - 1) // P))
        query_lens = [1] * len(items)
        metas, positions = [], []
        for j in range(steps):
            seqs = StepSequences(query_lens, [c + j for c in ctx0], tables, request_ids,
                                 decode_tiles=self.backend.needs_decode_tiles)
            meta = self.model.build_attention_metadata(seqs, self.windows, P)
            if self.debug_checks:
                self.check_no_null_page_writes(meta)
            metas.append(meta)
            positions.append(seqs.token_rows[1])
        ids = torch.tensor([s.token_ids[0] for s in items], dtype=torch.long)
        tokens = self.model.decode_burst(ids, torch.from_numpy(np.concatenate(positions)), metas)
        if tokens is None:
            return None
        by_sequence = tokens.t().tolist()
        return {s.request_id: by_sequence[i] for i, s in enumerate(items)}

    @staticmethod
    def _bitmask_rows(batch: ModelInput, sampling: list[ScheduledSequence]) -> tuple[torch.Tensor | None, list[int]]:
        """The step's token bitmask in the order of the sampled rows (decodes come first here,
        not in the engine's order): (bits, the sampled row each one constrains)."""
        mask = batch.token_bitmask
        if mask is None:
            return None, []
        rows = [i for i, s in enumerate(sampling) if s.request_id in mask.rows]
        if not rows:
            return None, []
        order = [mask.rows[sampling[i].request_id] for i in rows]
        bits = mask.bits if order == list(range(mask.bits.shape[0])) else mask.bits[torch.tensor(order)]
        return bits, rows

    @staticmethod
    def sampled(items: list[ScheduledSequence]) -> tuple[list[ScheduledSequence], list[int]]:
        """The sequences that sample this step, and the row of each one's logits (its last row)."""
        sampling, rows, row = [], [], 0
        for s in items:
            row += s.num_new_tokens
            if s.samples:
                sampling.append(s)
                rows.append(row - 1)
        return sampling, rows

    def _output_rows(self, sampled_rows: list[int], items: list[ScheduledSequence],
                     ids: torch.Tensor) -> torch.Tensor | None:
        """The rows the model must return: only the sampled ones, unless a step reads more
        (prompt logprobs, the logits-capture hook) or every row is sampled (a decode step):
        None (all rows) then."""
        # (the logits-capture hook is the driver's alone: every rank must return the same rows)
        if (len(sampled_rows) == ids.shape[0] or (self.captured_logits is not None and self.parallel is None)
                or any(s.wants_prompt_logprobs for s in items)):
            return None
        return torch.tensor(sampled_rows, dtype=torch.long, device=ids.device)

    def check_no_null_page_writes(self, meta) -> None:
        """Debug check: the null page (page NULL_PAGE, slots [0, slots_per_page) of a space) is
        never written. A write there means a block table holds NULL_PAGE where the request
        should own a page (e.g. an off-by-one in window release): fail loudly, naming the space."""
        P = self.layout.page_size
        for space, slots in meta.slot_mappings().items():
            per_page = self.layout.specs[space].slots_per_page(P)
            lo, hi = NULL_PAGE * per_page, (NULL_PAGE + 1) * per_page
            bad = slots[(slots >= lo) & (slots < hi)]
            if bad.numel():
                raise AssertionError(
                    f"this step writes into the null page of space {space!r} (slots {bad.tolist()[:8]}): "
                    f"a block table holds NULL_PAGE where a running request should own a page"
                )

    def _prompt_logprobs(self, s: ScheduledSequence, hidden: torch.Tensor, out: RunnerOutput) -> None:
        # Row p predicts prompt token p+1; the last prompt position predicts the first output.
        last = min(s.end, s.num_prompt_tokens - 1)
        n = last - s.start
        if n <= 0:
            return
        logits = self.model.compute_logits(hidden[:n])
        if logits is None:  # a tensor-parallel rank other than 0
            return
        logits = logits.float().cpu()
        targets = torch.tensor(s.prompt_token_ids[s.start + 1 : last + 1])
        entries = compute_prompt_logprobs(logits, targets, s.params.prompt_logprobs)
        out.prompt_logprobs[s.request_id] = (s.start + 1, entries)


def _to_device(obj, device: torch.device):
    """Metadata is built on the host; move every tensor in it (dataclasses, key sets, lists,
    tuples, dicts)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, KeySet):  # a plain class (its slots are built lazily): it moves itself
        return obj.to(device, non_blocking=True)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj, **{f.name: _to_device(getattr(obj, f.name), device) for f in dataclasses.fields(obj) if f.init}
        )
    if isinstance(obj, list):
        return [_to_device(x, device) for x in obj]
    if isinstance(obj, tuple):
        return tuple(_to_device(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj

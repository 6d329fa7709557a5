"""ModelRunner: scheduled batch -> tensors -> forward -> sampled tokens.

It owns the model, the physical KV tensors of every block space and the sampler. The
engine gives it a SchedulerOutput and the page tables; it never decides what runs.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from attention_backends.metadata import StepSequences, build_attention_metadata
from attention_backends.torch_native import TorchNativeAttention
from block_manager.kv_cache_manager import KVCacheManager
from block_manager.space_spec import SpaceSpec
from engine.scheduler import ScheduledRequest, SchedulerOutput
from model_executor.checkpoint import iter_weights, load_config, resolve_dtype
from model_executor.layers import pack_linear_weights
from model_executor.models.base import CausalLM
from model_executor.models.registry import resolve_model_class
from model_executor.sampler import Sampler, SamplingBatch, compute_prompt_logprobs

logger = logging.getLogger(__name__)


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


class ModelRunner:
    def __init__(
        self,
        model_dir: str,
        dtype: str | torch.dtype = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        allow_pickle_weights: bool = False,
    ) -> None:
        self.config = load_config(model_dir)
        self.dtype = resolve_dtype(dtype, self.config)
        model_max = getattr(self.config, "max_position_embeddings", None) or 2048
        if max_model_len is None:
            max_model_len = model_max
        elif max_model_len > model_max:
            raise ValueError(
                f"max_model_len {max_model_len} is longer than the model's max_position_embeddings {model_max}"
            )
        self.max_model_len = max_model_len
        cls = resolve_model_class(self.config)
        t0 = time.perf_counter()
        with torch.device("cpu"):
            model: CausalLM = cls(self.config, max_positions=max_model_len)
        model.load_weights(iter_weights(model_dir, allow_pickle=allow_pickle_weights))
        # Only parameters take the model dtype; RoPE tables stay float32 and are cast per use,
        # as transformers does. A model that keeps some tensors in float32 casts itself.
        if hasattr(model, "cast_to"):
            model.cast_to(self.dtype)
        else:
            for p in model.parameters():
                p.data = p.data.to(self.dtype)
        self.model = model.eval()
        if self.model_packing_wanted():
            pack = getattr(self.model, "pack_weights", None)
            pack() if pack is not None else pack_linear_weights(self.model)
        logger.info("loaded %s (%s) in %.1fs", model_dir, self.dtype, time.perf_counter() - t0)
        self.backend = TorchNativeAttention()
        self.sampler = Sampler(torch.Generator().manual_seed(seed))
        self.kv: KVCacheManager | None = None
        self.windows: dict[str, int | None] = {}
        # Debug/parity hook: when a dict, the logits of every computed position are appended
        # per request id (tests compare them to transformers).
        self.captured_logits: dict[str, list[torch.Tensor]] | None = None

    @staticmethod
    def model_packing_wanted() -> bool:
        import os

        # HYBRIDKV_PACK_WEIGHTS=0 keeps plain F.linear (for comparing numerics or speed).
        return os.environ.get("HYBRIDKV_PACK_WEIGHTS", "1") != "0"

    # -- KV cache --------------------------------------------------------------------------
    def space_specs(self) -> list[SpaceSpec]:
        return self.model.space_specs(self.dtype)

    def bind_kv_cache(self, kv: KVCacheManager) -> None:
        """Allocate each space's physical tensors and hand every attention layer its slice."""
        self.kv = kv
        if hasattr(self.model, "allocate_kv_cache"):
            # Models with their own cache layout (e.g. DeepSeek-V4's five spaces) bind it themselves.
            self.model.allocate_kv_cache(kv)
            self.windows = {name: spec.window for name, spec in kv.specs.items()}
            return
        layers = self.model.attention_layers()
        per_space: dict[str, list] = {}
        for attn in layers:
            per_space.setdefault(attn.space, []).append(attn)
        for name, attns in per_space.items():
            slots = kv.spaces[name].num_pages * kv.page_size
            a = attns[0]
            # Zero-filled: masked-out padding slots are still read and must be finite.
            # Head-major [Hkv, slots, D]: a gather of any slots yields one contiguous block per
            # KV head, the layout the attention matmuls read fastest.
            cache = torch.zeros(len(attns), 2, a.num_kv_heads, slots, a.head_dim, dtype=self.dtype)
            for i, attn in enumerate(attns):
                attn.k_cache, attn.v_cache = cache[i, 0], cache[i, 1]
                attn.backend = self.backend
            self.windows[name] = kv.specs[name].window

    # -- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        # One-token chunks first: they form the batched decode group of the backend.
        items = sorted(sched.scheduled, key=lambda s: s.num_new_tokens != 1)
        ids: list[int] = []
        positions: list[int] = []
        for s in items:
            ids.extend(s.request.all_token_ids[s.start : s.end])
            positions.extend(range(s.start, s.end))
        seqs = StepSequences(
            query_lens=[s.num_new_tokens for s in items],
            context_lens=[s.end for s in items],
            page_tables={
                name: [self.kv.page_table(s.request.request_id, name) for s in items] for name in self.windows
            },
        )
        if hasattr(self.model, "build_attention_metadata"):
            meta = self.model.build_attention_metadata(seqs, self.kv.page_size)
        else:
            meta = build_attention_metadata(seqs, self.windows, self.kv.page_size)
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), meta)

        if self.captured_logits is not None:
            all_logits = self.model.compute_logits(hidden).float()
            row = 0
            for s in items:
                self.captured_logits.setdefault(s.request.request_id, []).append(all_logits[row : row + s.num_new_tokens])
                row += s.num_new_tokens

        out = RunnerOutput()
        rows, sampling = [], []
        row = 0
        for s in items:
            req = s.request
            if req.wants_prompt_logprobs and s.start < req.num_prompt_tokens:
                self._prompt_logprobs(s, hidden[row : row + s.num_new_tokens], out)
            if s.samples:
                rows.append(row + s.num_new_tokens - 1)
                sampling.append(s)
            row += s.num_new_tokens
        if not sampling:
            return out
        logits = self.model.compute_logits(hidden[rows]).float()
        batch = SamplingBatch(
            params=[s.request.params for s in sampling],
            generators=[s.request.generator for s in sampling],
            prompt_token_ids=[s.request.prompt_token_ids for s in sampling],
            output_token_ids=[s.request.output_token_ids for s in sampling],
        )
        res = self.sampler(logits, batch)
        for i, s in enumerate(sampling):
            out.sampled[s.request.request_id] = SampledToken(
                res.token_ids[i],
                None if res.sampled_logprobs is None else res.sampled_logprobs[i],
                res.top_logprobs[i],
            )
        return out

    def _prompt_logprobs(self, s: ScheduledRequest, hidden: torch.Tensor, out: RunnerOutput) -> None:
        req = s.request
        # Row p predicts prompt token p+1; the last prompt position predicts the first output.
        last = min(s.end, req.num_prompt_tokens - 1)
        n = last - s.start
        if n <= 0:
            return
        logits = self.model.compute_logits(hidden[:n]).float()
        targets = torch.tensor(req.prompt_token_ids[s.start + 1 : last + 1])
        entries = compute_prompt_logprobs(logits, targets, req.params.prompt_logprobs)
        out.prompt_logprobs[req.request_id] = (s.start + 1, entries)

"""The contract every model in the registry fulfils, and the shared weight loader."""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from hybridkv.attention_backends.metadata import AttentionMetadata, StepSequences, build_attention_metadata
from hybridkv.block_manager.kv_plan import KVCacheLayout
from hybridkv.block_manager.space_spec import SpaceSpec
from hybridkv.model_executor.huge_pages import kv_pool_on
from hybridkv.model_executor.layers import pack_linear_weights
from hybridkv.model_executor.quantization import BlockQuantizedTensor, QuantizedWeightInstaller, quantized_weight_numel
from hybridkv.model_executor.step_cost import StepCost, dense_step_cost


class CausalLM(nn.Module):
    """A decoder the model runner can drive.

    Every model implements:
      forward(input_ids [T], positions [T], meta, output_rows=None) -> hidden [T, H] for a flat
        batch of tokens, or [len(output_rows), H] of those rows (all T still write their K/V)
      compute_logits(hidden [N, H]) -> [N, vocab]
      space_specs(kv_dtype) -> the block spaces this model's layers read and write, their bytes
        counted in kv_dtype (the KV pools' dtype: the model's, or FP8 where kv_cache_dtype asks
        and fp8_kv_cache_refusal() is None)
      load_weights(iterable of (HF name, tensor))
    and may override the hooks below, whose defaults fit dense decoders whose attention layers
    (attention_layers(): modules with .space, .num_kv_heads, .head_dim and k_cache / v_cache /
    backend slots) each keep one K and one V per token in one space:
      default_block_size, allocate_kv_cache, auxiliary_kv_tensors, build_attention_metadata, cast_to,
      pack_weights, step_cost, decode_burst, cpu_kernel_loaders.
    """

    # The page size this model prefers when the user leaves block_size at the engine default;
    # None = the engine default fits (DeepSeek-V4 wants 128: a multiple of its compress ratios).
    default_block_size: int | None = None
    # Whether the constructor takes `parallel` (a TensorParallel) and builds one rank's shard.
    supports_tensor_parallel: bool = False
    # Whether that shard can hold whole routed experts, a different set per rank (expert
    # parallelism, TensorParallel.expert_parallel): only mixture-of-experts models.
    supports_expert_parallel: bool = False
    # Whether that shard's layout slices block-quantized (FP8 / MXFP4) weights with their scales.
    supports_quantized_shards: bool = False
    # Speculative decoding: whether a verified chunk (a token and its drafts) may run as one-token
    # decodes of consecutive positions (model_executor/batch.verify_rows), which needs every layer
    # to write all rows' cache entries before any row reads them. False: it runs as one chunk.
    verify_rows_as_decodes: bool = True

    @classmethod
    def fp8_kv_cache_refusal(cls) -> str | None:
        """None where this model's KV pools may be FP8 (kv_cache_dtype="fp8..."): every layer writes
        and reads its cache through a path that quantizes and dequantizes. Else what is missing."""
        return "its attention layers have no FP8 KV cache path"

    @classmethod
    def cpu_kernel_loaders(cls, dtype: torch.dtype) -> list[Callable[[], object]]:
        """The C++ kernel modules this model uses on the CPU in `dtype`, as their loaders: the
        runner builds them side by side while the weights load (cpu_kernels/build.py prebuild)."""
        from hybridkv.model_executor.cpu_kernels import dense_model_kernel_loaders

        return dense_model_kernel_loaders(dtype)

    def space_specs(self, dtype: torch.dtype) -> list[SpaceSpec]:  # pragma: no cover - interface
        raise NotImplementedError

    def attention_layers(self) -> list[nn.Module]:  # pragma: no cover - interface
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:  # pragma: no cover
        raise NotImplementedError

    # -- hooks with defaults -------------------------------------------------------------------
    def allocate_kv_cache(
        self, layout: KVCacheLayout, backend, dtype: torch.dtype, device: torch.device, prefault: bool = False
    ) -> dict[str, list[torch.Tensor]]:
        """Allocate each space's physical K/V tensors in `dtype` (the KV dtype: the model's, or
        FP8, which the backends quantize into on write and dequantize on every read) and bind
        every attention layer its slice and the attention backend. Returns space -> every physical
        tensor of that space (here
        one, [layers, 2, Hkv, slots, D]); in each, the slot dimension is dim -2 and slot s is in
        page s // slots_per_page, the contract the host tier (HostKVCache) copies pages by.

        Head-major [Hkv, slots, D] per layer: a gather of any slots yields one contiguous block per
        KV head, the layout the attention matmuls read fastest. Zeroed (huge_pages.kv_pool_on: taken
        as pages are written, or with `prefault` on huge pages and touched here), so the null page
        every padded or masked read of the backends points at is zero too."""
        per_space: dict[str, list[nn.Module]] = {}
        for attn in self.attention_layers():
            per_space.setdefault(attn.space, []).append(attn)
        caches = {}
        for name, attns in per_space.items():
            slots = layout.slots(name)
            a = attns[0]
            cache = kv_pool_on(device, len(attns), 2, a.num_kv_heads, slots, a.head_dim, dtype=dtype, prefault=prefault)
            for i, attn in enumerate(attns):
                attn.k_cache, attn.v_cache = cache[i, 0], cache[i, 1]
                attn.backend = backend
            caches[name] = [cache]
        return caches

    def auxiliary_kv_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Device tensors the model allocated for its KV cache beyond the spaces' pools (what
        allocate_kv_cache returns), by name: the runner reports them and the device KV budget
        pays for them. Default: none (DeepSeek-V4 with HiSparse: its hot buffers)."""
        return {}

    def build_attention_metadata(
        self, seqs: StepSequences, windows: dict[str, int | None], page_size: int
    ) -> AttentionMetadata:
        """Per-step metadata shared by every layer (slot mappings, decode tiles, prefill chunks)."""
        return build_attention_metadata(seqs, windows, page_size)

    def decode_burst_rows(self) -> int:
        """Most decodes decode_burst may take at once (0: it takes none). The engine asks before
        it allocates a burst's pages."""
        return 0

    def decode_burst(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     metas: list[AttentionMetadata]) -> torch.Tensor | None:
        """len(metas) greedy decode steps in one call: the sampled tokens [steps, T], exactly
        those forward + compute_logits + a greedy argmax would give step by step; positions
        [steps * T] step-major, metas[j] step j's metadata with its pages allocated. None (the
        default) where the model has no such path for these decodes: the runner steps one at a
        time."""
        return None

    def token_params(self) -> int:
        """Parameters every token multiplies: all but embedding tables and the logits head
        (a lookup, and a product computed only for sampled positions)."""
        skip = {id(p) for m in self.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
        head = getattr(self, "lm_head", None)
        if isinstance(head, nn.Module):
            skip.update(id(p) for p in head.parameters())
        # Block-quantized linears keep their weight in buffers: count them at their logical size.
        quantized = quantized_weight_numel(self, exclude=(head,) if isinstance(head, nn.Module) else ())
        return sum(p.numel() for p in self.parameters() if id(p) not in skip) + quantized

    def step_cost(self) -> StepCost:
        """FLOPs of a forward as a function of tokens and positions (the scheduler sizes prefill
        chunks with it). Default: every attention layer reads one K/V per earlier token, up to its
        window. Call before pack_weights (packing may replace parameters)."""
        return dense_step_cost(self.token_params(), self.attention_layers(), self.logits_params())

    def logits_params(self) -> int:
        """Size of the logits matrix (the head, or the tied embedding): vocab x hidden."""
        head = getattr(self, "lm_head", None)
        sizes = [p.numel() for m in self.modules() if isinstance(m, nn.Embedding) for p in m.parameters()]
        if isinstance(head, nn.Module):
            sizes += [p.numel() for p in head.parameters()] + [quantized_weight_numel(head)]
        return max(sizes, default=0)

    def cast_to(self, dtype: torch.dtype) -> None:
        """Cast to the model dtype. Only parameters: RoPE tables stay float32 and are cast per
        use, as transformers does. A model that keeps some tensors in float32 overrides this."""
        for p in self.parameters():
            p.data = p.data.to(dtype)

    def pack_weights(self, release: frozenset[int] = frozenset()) -> None:
        """Prepack projections for the CPU's oneDNN kernels (the runner calls this on CPU only);
        the linears whose id() is in `release` give up their parameter where the packed copy
        serves every input (layers.pack_linear_weights)."""
        pack_linear_weights(self, release=release)

    def linears_read_only_by_forward(self) -> list[nn.Linear]:
        """The nn.Linear modules nothing reads but their own forward (not their .weight): their
        parameters may be released once packed. None by default; a model lists the ones it can."""
        return []


def load_stacked_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    rename: Callable[[str], str | None],
    stacked: dict[str, tuple[str, object]],
) -> None:
    """Copy checkpoint tensors into the model, fusing q/k/v and gate/up shards.

    Block-quantized weights (BlockQuantizedTensor, see model_executor/quantization) of linear
    layers stay compressed: the installer swaps those layers for QuantizedLinear at the end
    (a fused layer keeps one quantized shard per checkpoint weight). Raises ValueError naming
    every parameter the checkpoint did not provide and every checkpoint tensor whose shape
    does not fit.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    shard_offsets = _shard_offsets(model)
    installer = QuantizedWeightInstaller(model)
    for hf_name, tensor in weights:
        name = rename(hf_name)
        if name is None:
            continue
        parts = name.split(".")
        target, shard = name, None
        if len(parts) >= 2 and parts[-2] in stacked:
            fused, shard = stacked[parts[-2]]
            target = ".".join(parts[:-2] + [fused, parts[-1]])
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {hf_name!r} does not belong to this model (no parameter {target!r})")
        module_name, _, leaf = target.rpartition(".")
        start, size = (0, None) if shard is None else shard_offsets[module_name][shard]
        loaded_as = target if shard is None else f"{target}#{shard}"
        if isinstance(tensor, BlockQuantizedTensor):
            if leaf == "weight" and installer.keeps_compressed(module_name):
                rows = param.shape[0] if size is None else size
                _check_shape(hf_name, (rows,) + tuple(param.shape[1:]), tensor.shape)
                installer.add(module_name, tensor, start)
                loaded.add(loaded_as)
                continue
            installer.note_dequantized(hf_name)  # not a linear layer: it cannot stay compressed
            tensor = tensor.dequantize(torch.float32)
        elif leaf == "weight":
            installer.note_dense(module_name, hf_name)
        with torch.no_grad():
            dst = param if shard is None else param.narrow(0, start, size)
            _check_shape(hf_name, dst.shape, tensor.shape)
            dst.copy_(tensor)
            loaded.add(loaded_as)
    missing = []
    for name in params:
        module = name.rsplit(".", 1)[0]
        if module in shard_offsets:
            missing += [f"{name}#{s}" for s in shard_offsets[module] if f"{name}#{s}" not in loaded]
        elif name not in loaded:
            missing.append(name)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint is missing weights for: {shown}")
    installer.finish()


def _check_shape(name: str, want: torch.Size, got: torch.Size) -> None:
    if tuple(want) != tuple(got):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(got)}, the model expects {tuple(want)}")


def _shard_offsets(model: nn.Module) -> dict[str, dict[object, tuple[int, int]]]:
    """Row ranges of each shard inside the fused qkv_proj / gate_up_proj modules."""
    out: dict[str, dict[object, tuple[int, int]]] = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "qkv_proj":
            attn = model.get_submodule(name.rsplit(".", 1)[0])
            q, kv = attn.q_size, attn.kv_size
            out[name] = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}
        elif leaf == "gate_up_proj":
            i = module.out_features // 2
            out[name] = {0: (0, i), 1: (i, i)}
    return out

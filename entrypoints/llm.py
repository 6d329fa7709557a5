"""LLM: the offline entry point (vLLM's `LLM` class, same argument and method names)."""
from __future__ import annotations

from typing import Any, Sequence

from tqdm.auto import tqdm

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.llm_engine import LLMEngine, PromptType, is_token_array
from hybridkv.engine.outputs import RequestOutput
from hybridkv.engine.sampling_params import SamplingParams
from hybridkv.model_executor.tokenizer import apply_chat_template


class LLM:
    """Generate from a HuggingFace checkpoint folder (or the built-in demo model when model is None).

    >>> llm = LLM()                                    # SmolLM2-135M-Instruct, converted once
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8))[0].outputs[0].text

    enable_hierarchical_cache: a host-memory tier (HiCache L2) under every block space: pages the
    device evicts are kept on the host and loaded back on a hit; hicache_ratio / hicache_size
    size it, hicache_write_policy says when pages are copied there, hicache_mem_layout how
    they are laid out. preemption_mode="swap" writes a preempted request's pages to that tier.
    hicache_storage_backend="file" | "redis" adds a store under it (HiCache L3) that outlasts the
    process and can be shared by several (hicache_storage_backend_extra_config: JSON or dict,
    e.g. {"url": "redis://127.0.0.1:6379/0"}; hicache_storage_dir for "file").

    enable_hisparse (DeepSeek-V4): during decode each request keeps only a hot buffer of C4
    entries per CSA layer on the device (hisparse_config={"hot_buffer_size": entries, default
    2 x index_topk; "mirror_bytes": host memory for the full C4 history}); outputs are unchanged.

    kv_events_config (vLLM's): publish KV cache events (pages stored / removed per tier) over
    ZeroMQ for a KV-aware router, e.g. {"enable_kv_cache_events": true, "endpoint":
    "tcp://127.0.0.1:5557"}; needs prefix caching.

    attention_backend: "auto" (default: "triton" on CUDA when triton imports, else "torch_native"),
    "torch_native", "triton" (CUDA, or CPU under TRITON_INTERPRET=1) or "xformers" (CUDA). One that
    cannot run here raises before the model loads, naming what is missing.

    device: "cpu" (default), "cuda" / "cuda:N", or "auto" (CUDA when torch sees a GPU). A device
    this machine lacks raises ValueError before the model loads. The CUDA path has been checked
    on the CPU only (Triton interpreted, xformers' masks) until benchmarks/gpu_check.py runs on a
    GPU, hence opt-in.

    num_scheduler_steps: greedy decode steps per model call while every running request decodes
    greedily and nobody waits (None: 8 here, 1 with a target_step_seconds); the tokens are
    those of one step at a time.

    speculative_config (vLLM's): {"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_min": m, "prompt_lookup_max": n}: greedy requests verify up to k tokens copied
    from their own prompt + output per forward; outputs are those of plain greedy decoding.
    Full-attention models only (docs/configuration.md lists what is refused).

    tensor_parallel_size: model shards, one process each (torch.distributed; gloo on the CPU):
    this process is rank 0 and starts N-1 workers, stopped by shutdown(). Dense Llama-family and
    Gemma-3 models and DeepSeek-V4 (quantized checkpoints included); every KV tier runs on each
    rank from the driver's plan.

    enable_expert_parallel: with tensor_parallel_size > 1, each rank holds whole routed experts
    (1/N of them) instead of 1/N of every expert (vLLM's name); mixture-of-experts models only.

    nnodes, node_rank, dist_init_addr: the ranks split evenly over several machines (SGLang's
    names). This LLM is node 0 (node_rank 0): it hosts the rendezvous at dist_init_addr
    ("host:port") and waits for the other nodes' ranks, which `hybridkv generate|serve --nnodes N
    --node-rank k --dist-init-addr host:port` starts there. None: torchrun's WORLD_SIZE, RANK and
    MASTER_ADDR:MASTER_PORT when tensor_parallel_size > 1, else one node.

    block_size: tokens per KV page; None (the default) takes the model's default page size (16
    for dense models, 128 for DeepSeek-V4). An explicit size the model cannot use (not a multiple
    of its compression ratios) raises ValueError naming the sizes it can use.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        kv_cache_dtype: str = "auto",
        max_model_len: int | None = None,
        block_size: int | None = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        kv_cache_memory_bytes: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        target_step_seconds: float | str | None = None,
        max_step_seconds: float | None = None,
        allow_pickle_weights: bool = False,
        chat_template: str | None = None,
        scheduling_policy: str = "fcfs",
        eviction_policy: str = "lru",
        windowed_match: bool = True,
        attention_backend: str = "auto",
        device: str = "cpu",
        enable_hierarchical_cache: bool = False,
        hicache_ratio: float = 2.0,
        hicache_size: int | None = None,
        hicache_write_policy: str = "write_through",
        hicache_mem_layout: str = "page_first",
        load_back_threshold: int = 0,
        preemption_mode: str = "recompute",
        hicache_storage_backend: str | None = None,
        hicache_storage_backend_extra_config: str | dict | None = None,
        hicache_storage_dir: str | None = None,
        hicache_storage_prefetch_policy: str = "timeout",
        dequantize_weights: bool | None = None,
        enable_hisparse: bool = False,
        hisparse_config: str | dict | None = None,
        kv_events_config: str | dict | None = None,
        num_threads: int | None = None,
        num_scheduler_steps: int | None = None,
        kv_cache_prefault: bool | None = None,
        tensor_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        nnodes: int | None = None,
        node_rank: int | None = None,
        dist_init_addr: str | None = None,
        speculative_config: str | dict | None = None,
    ) -> None:
        self.engine = LLMEngine(
            EngineConfig(
                model=model,
                dtype=dtype,
                kv_cache_dtype=kv_cache_dtype,
                max_model_len=max_model_len,
                block_size=block_size,
                enable_prefix_caching=enable_prefix_caching,
                seed=seed,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                target_step_seconds=target_step_seconds,
                max_step_seconds=max_step_seconds,
                allow_pickle_weights=allow_pickle_weights,
                chat_template=chat_template,
                scheduling_policy=scheduling_policy,
                eviction_policy=eviction_policy,
                windowed_match=windowed_match,
                attention_backend=attention_backend,
                device=device,
                enable_hierarchical_cache=enable_hierarchical_cache,
                hicache_ratio=hicache_ratio,
                hicache_size=hicache_size,
                hicache_write_policy=hicache_write_policy,
                hicache_mem_layout=hicache_mem_layout,
                load_back_threshold=load_back_threshold,
                preemption_mode=preemption_mode,
                hicache_storage_backend=hicache_storage_backend,
                hicache_storage_backend_extra_config=hicache_storage_backend_extra_config,
                hicache_storage_dir=hicache_storage_dir,
                hicache_storage_prefetch_policy=hicache_storage_prefetch_policy,
                dequantize_weights=dequantize_weights,
                enable_hisparse=enable_hisparse,
                hisparse_config=hisparse_config,
                kv_events_config=kv_events_config,
                num_threads=num_threads,
                num_scheduler_steps=num_scheduler_steps,
                kv_cache_prefault=kv_cache_prefault,
                tensor_parallel_size=tensor_parallel_size,
                enable_expert_parallel=enable_expert_parallel,
                nnodes=nnodes,
                node_rank=node_rank,
                dist_init_addr=dist_init_addr,
                speculative_config=speculative_config,
            )
        )

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel worker processes (with tensor_parallel_size > 1; garbage
        collection and interpreter exit do it too). The LLM cannot generate afterwards."""
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        d = self.engine.generation_defaults.defaults
        known = {k: d[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty") if k in d}
        return SamplingParams(**known)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """priority: one int per prompt; with eviction_policy="priority", the prefix-cache pages
        of higher-priority requests are evicted last."""
        if isinstance(prompts, (str, dict)) or _is_one_token_id_prompt(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            return []
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling params for {len(prompts)} prompts; pass one or one per prompt"
                )
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts; pass one per prompt")
        return self._run(prompts, params_list, use_tqdm, list(priority) if priority is not None else None)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        template = chat_template or self.engine.config.chat_template
        prompts = []
        for conv in conversations:
            text = apply_chat_template(self.engine.tokenizer, conv, template, add_generation_prompt)
            ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams],
        use_tqdm: bool,
        priorities: list[int] | None = None,
    ) -> list[RequestOutput]:
        engine = self.engine
        engine.check_structured_outputs(params)  # a bad grammar is refused before anything is added
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                # The offline API returns whole outputs, whatever kind the params ask for.
                if p.output_kind.name != "FINAL_ONLY":
                    p = p.clone(output_kind=type(p.output_kind).FINAL_ONLY)
                ids.append(engine.add_request(None, prompt, p, priority=priorities[i] if priorities else 0))
        except Exception:
            for rid in ids:
                engine.abort_request(rid)
            raise
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update(1)
        except BaseException:
            for rid in ids:
                engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return results  # type: ignore[return-value]

    def reset_prefix_cache(self) -> int:
        return self.engine.reset_prefix_cache()


def _is_one_token_id_prompt(prompts: Any) -> bool:
    """One prompt given as token ids (a list/tuple of ints, or a 1-D array/tensor), not a list of prompts."""
    if is_token_array(prompts):
        return prompts.ndim == 1
    return isinstance(prompts, (list, tuple)) and bool(prompts) and isinstance(prompts[0], int)

"""LLMEngine: add requests, call step(), collect RequestOutputs.

One step = schedule -> the step executor runs it (the KV manager's plan, then one forward and
sampling, or a decode burst) -> append tokens, detokenize, check stop conditions -> release
finished requests -> build outputs. Memory planning lives in engine/kv_memory_plan.py, the tiers
are wired by engine/tier_factory.py, outputs are built by engine/request_group.py.
"""
from __future__ import annotations

import itertools
import logging
import os
import time
import weakref
from typing import Any

import torch

from hybridkv import OPENMP_RUNTIME
from hybridkv.block_manager.kv_cache_manager import KVCacheManager
from hybridkv.engine.config import EngineConfig, resolve_device
from hybridkv.engine.decode_burst import burst_limit
from hybridkv.engine.detokenizer import IncrementalDetokenizer
from hybridkv.engine.kv_event_publisher import KVEventsConfig, make_publisher
from hybridkv.engine.kv_memory_plan import log_kv_cache_bytes, plan_kv_memory
from hybridkv.engine.outputs import Logprob, PositionLogprobs, RequestOutput
from hybridkv.engine.prompts import PromptType, as_token_ids, is_token_array, tokenize_prompt, validate_prompt
from hybridkv.engine.request import Request, RequestStatus
from hybridkv.engine.request_group import RequestGroup, make_output
from hybridkv.engine.sampling_params import SamplingParams
from hybridkv.engine.scheduler import ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput
from hybridkv.engine.speculative.config import mtp_wanted, speculation_config
from hybridkv.engine.speculative.verifier import Verifier
from hybridkv.engine.step_executor import StepExecutor
from hybridkv.engine.structured_output import StructuredOutputManager
from hybridkv.engine.tier_factory import wire_tiers
from hybridkv.engine.tp_executor import TensorParallelRunner, start_tensor_parallel, threads_per_rank
from hybridkv.model_executor.checkpoint import load_generation_config
from hybridkv.model_executor.model_runner import ModelRunner, RunnerOutput, model_skeleton
from hybridkv.model_executor.parallel.state import TensorParallel
from hybridkv.model_executor.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "PromptType", "as_token_ids", "is_token_array"]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.node_rank:
            raise ValueError(f"node_rank={config.node_rank} runs no engine, only its tensor-parallel workers: "
                             "start it with `hybridkv serve` or `hybridkv generate` and --node-rank "
                             "(engine/tp_node.py); the engine runs on node 0")
        self.config = config
        parallel = (TensorParallel(0, config.tensor_parallel_size, config.enable_expert_parallel)
                    if config.tensor_parallel_size > 1 else None)
        self._threads_before = torch.get_num_threads()  # given back at shutdown (tensor parallelism)
        if parallel is not None:
            torch.set_num_threads(threads_per_rank(config))  # this process is rank 0: its share of the cores
        elif config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        logger.info("CPU compute threads: %d (of %s cores); %s", torch.get_num_threads(), os.cpu_count(),
                    OPENMP_RUNTIME.describe())
        if config.device == "cpu" and torch.cuda.is_available():
            logger.info("a CUDA device is visible but device='cpu' (the default): pass device='cuda' "
                        "(--device cuda) to run on it")
        device = resolve_device(config.device)
        model_dir = config.model
        if model_dir is None:
            from hybridkv.model_executor.demo_model import (
                demo_model_dir, ensure_demo_model, is_converted, prebuild_demo_kernels,
            )

            if not is_converted(demo_model_dir()) and device.type == "cpu":
                prebuild_demo_kernels(config.dtype)  # compiled while the checkpoint converts
            model_dir = ensure_demo_model()
        self.model_dir = model_dir
        # Everything that needs only the model's shape is planned and checked before the weights
        # load (config.json, on the meta device): a budget too small fails in a second.
        skeleton = model_skeleton(model_dir, config.dtype, config.max_model_len, device, config.attention_backend,
                                  parallel, mtp=mtp_wanted(config), kv_cache_dtype=config.kv_cache_dtype)
        self.max_model_len = skeleton.max_model_len
        self.speculative, specs = speculation_config(config, skeleton.specs)  # refused before the weights load
        memory = plan_kv_memory(config, specs, skeleton.model, self.max_model_len)
        self.block_size, self.hisparse = memory.block_size, memory.hisparse

        if parallel is None:
            self.runner: ModelRunner | TensorParallelRunner = ModelRunner(
                model_dir, config.dtype, config.max_model_len, config.seed, config.allow_pickle_weights,
                attention_backend=config.attention_backend, dequantize_weights=config.dequantize_weights,
                device=device, skeleton=skeleton,
            )
        else:  # rank 0's shard here, the others in worker processes (engine/tp_executor.py)
            self.runner = start_tensor_parallel(config, model_dir, device, skeleton)
        if self.runner.space_specs() != skeleton.specs:  # a model whose spaces depend on its weights: a bug
            raise RuntimeError(f"the loaded model's block spaces {self.runner.space_specs()} differ from the "
                               f"ones planned from its config {skeleton.specs}")
        self.tokenizer = load_tokenizer(model_dir)
        self.generation_defaults = load_generation_config(model_dir)
        self.eos_token_ids = set(self.generation_defaults.eos_token_ids)
        if not self.eos_token_ids and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids = {self.tokenizer.eos_token_id}
        kv_events_config = KVEventsConfig.parse(config.kv_events_config)
        self.kv = KVCacheManager(
            specs, memory.device_pages, self.block_size, config.enable_prefix_caching,
            config.eviction_policy, config.windowed_match,
            max_pages_per_request=-(-self.max_model_len // self.block_size) + 1,
            max_requests=min(config.max_num_seqs, 64),
            host_pages=memory.host_pages, hicache_write_policy=config.hicache_write_policy,
            load_back_threshold=config.load_back_threshold,
            report_freed=self.hisparse is not None or skeleton.mtp,  # the runner drops their hot-buffer rows, MTP tails
            kv_events=kv_events_config is not None,
        )
        hs = self.hisparse  # its c4 mirror in host memory, hot buffers on the device
        layout = self.kv.layout(hs.host_spaces, hs.shape) if hs is not None else self.kv.layout()
        self.runner.bind_kv_cache(layout, prefault=bool(config.kv_cache_prefault))
        self.storage = wire_tiers(config, self.kv, self.runner, memory.host_pages, model_dir, specs)
        self.kv_event_publisher = make_publisher(kv_events_config)  # after the tiers: they seed the page hashes
        if self.kv_event_publisher is not None:  # an engine dropped without shutdown() frees its endpoint
            weakref.finalize(self, self.kv_event_publisher.close)
        # What was allocated, from the tensors: tier ("device" / "host") -> space -> bytes.
        self.kv_cache_bytes = self.runner.kv_cache_bytes()
        log_kv_cache_bytes(self.kv_cache_bytes)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, memory.max_num_batched_tokens, self.max_model_len,
                            config.scheduling_policy, config.target_step_seconds, config.max_step_seconds,
                            preemption_mode=config.preemption_mode),
            self.kv, self.runner.step_cost,
        )
        # Structured outputs: grammars compiled on a worker thread, one mask row per constrained
        # sequence each step (engine/structured_output/manager.py).
        self.structured = StructuredOutputManager(self.tokenizer, self.runner.config.vocab_size, self.eos_token_ids)
        self._groups: dict[str, RequestGroup] = {}
        self._request_to_group: dict[str, RequestGroup] = {}
        self._counter = itertools.count()  # request ids for callers that give none
        self._sequence_counter = itertools.count()  # internal sequence ids (_new_sequence_id)
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0, "burst_calls": 0}
        self.verifier = Verifier.attach(self.speculative, self.scheduler, self.max_model_len, self.stats, self.runner)
        # Decode steps per model call (engine/decode_burst.py); off under a step-time target.
        # AsyncLLMEngine resolves it again as a streaming server.
        self.executor = StepExecutor(self.kv, self.runner, self.max_model_len,
                                     burst_limit(config.num_scheduler_steps, config.target_step_seconds,
                                                 streaming=False), self.stats, self.verifier is not None)
        logger.info(
            "engine ready: model=%s dtype=%s max_model_len=%d block_size=%d spaces=%s prefix_caching=%s",
            model_dir, self.runner.dtype, self.max_model_len, self.block_size,
            {n: s.num_pages for n, s in self.kv.spaces.items()}, self.kv.enable_prefix_caching,
        )

    @property
    def burst_limit(self) -> int:
        return self.executor.burst_limit

    @burst_limit.setter
    def burst_limit(self, value: int) -> None:
        self.executor.burst_limit = value

    @property
    def tier_stats(self) -> dict:  # host tier copies the runner executed: bytes each way and seconds spent
        return self.runner.copy_stats

    # -- requests ------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text or None, token ids as a list of Python ints): engine/prompts.py."""
        return tokenize_prompt(self.tokenizer, prompt)

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
        """client_id: the fairness key admission round-robins over (default: request_id); give several
        requests the same key when they come from one client request (a prompt batch). interactive: someone
        watches this request's tokens arrive (a stream); only such decodes hold prefill chunks to the
        step-time target (config.target_step_seconds)."""
        params = params or SamplingParams()
        if request_id is None:
            request_id = str(next(self._counter))
            while request_id in self._groups:  # a caller chose this number as its own id
                request_id = str(next(self._counter))
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        validate_prompt(ids, self.runner.config.vocab_size, self.max_model_len)
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
        grammars = (self.structured.grammars_for(params, params.n) if params.structured_outputs is not None
                    else [None] * params.n)
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
            req.grammar = grammars[i]
            children.append(req)
            detoks[child_id] = IncrementalDetokenizer(self.tokenizer, ids, child_params)
        group = RequestGroup(request_id, text, ids, params, children, detoks)
        self._groups[request_id] = group
        for req in children:
            self._request_to_group[req.request_id] = group
            self.scheduler.add(req)
        self.structured.track(children)
        self.stats["prompt_tokens"] += len(ids)
        return request_id

    def _new_sequence_id(self, request_id: str, index: int) -> str:
        """The internal id of one sequence (one of a request's n samples).

        The scheduler, the KV manager and the runner key their state by it. It is unique for the engine's
        lifetime whatever ids users choose: the part after the last "@" is a private counter (digits only,
        so that "@" always delimits it), and no two sequences get the same counter. The user's id and the
        sample index are kept in front only to make logs readable; outputs and abort_request use the
        user's request_id."""
        return f"{request_id}#{index}@{next(self._sequence_counter)}"

    def sequence_ids(self, request_id: str) -> list[str]:
        """The internal ids of a request's sequences in flight (debug/test hooks like runner.captured_logits)."""
        group = self._groups.get(request_id)
        return [r.request_id for r in group.children] if group is not None else []

    def abort_request(self, request_id: str) -> None:
        group = self._groups.pop(request_id, None)
        if group is None:
            return
        for req in group.children:
            if not req.finished:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            self._request_to_group.pop(req.request_id, None)
            if self.runner.hot_buffers is not None:
                self.runner.hot_buffers.forget(req.request_id)
        self.executor.flush_copies()  # its pages' host copies, decided as it left
        self._publish_kv_events()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    # -- the step ------------------------------------------------------------------------------
    def check_structured_outputs(self, params: list[SamplingParams], timeout: float | None = None) -> None:
        """Compile the constraints of these params (side by side, cached) and wait for them:
        a ValueError names the first that cannot be compiled. Thread-safe (the server calls it
        from its handlers before adding a request)."""
        self.structured.check([p.structured_outputs for p in params if p.structured_outputs is not None], timeout)

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        failed = self._finish_failed_grammars() if self.structured.has_pending else []
        sched = self.scheduler.schedule()
        if sched.empty:
            self.executor.flush_copies()  # write-backs of pages evicted while nothing ran
            self._publish_kv_events()
            if self.kv.waiting_for_reads():
                self.kv.wait_for_reads()  # requests wait for their prefix reads: sleep until one lands
            elif self.structured.has_pending:
                self.structured.wait_for_compiles(0.05)  # requests wait for their grammars
            return [o for o in (self._make_output(g) for g in failed) if o is not None]
        results = self.executor.run(sched, self.scheduler, self.structured.bitmask(sched.scheduled))
        touched = list({g.request_id: g for g in failed + self._book(sched, results)}.values())
        # Write-through of the pages this step completed, and of those that requests finishing
        # now published as they left (a decode's last pages are published at retire).
        self.executor.flush_copies()
        self._publish_kv_events()
        outputs = [o for o in (self._make_output(g) for g in touched) if o is not None]
        # The whole step, as a stream sees it between two tokens (the latency target's unit).
        self.scheduler.observe_step(sched, (time.perf_counter() - t0) / len(results))
        return outputs

    def _finish_failed_grammars(self) -> list[RequestGroup]:
        """Sequences whose grammar failed to compile while they waited finish with "abort"."""
        groups: dict[str, RequestGroup] = {}
        for req, error in self.structured.take_failed():
            logger.warning("request %s: %s; finishing it", req.request_id, error)
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            group = self._request_to_group.get(req.request_id)
            if group is not None:
                groups[group.request_id] = group
        return list(groups.values())

    def _book(self, sched: SchedulerOutput, results: list[RunnerOutput]) -> list[RequestGroup]:
        """Record the step's results one decode step at a time (a burst's as the ordinary steps it stands
        for): computed counts and published pages, then each request's token(s) and stop check; a request
        that stopped takes no more of its tokens."""
        touched: dict[str, RequestGroup] = {}
        live = sched.scheduled
        for j, result in enumerate(results):
            if j == 0:
                self.scheduler.update_after_step(sched)
            else:
                self.scheduler.update_after_decodes([s.request for s in live])
            self.stats["steps"] += 1
            for group in self._process(live, result, sched.drafts):
                touched[group.request_id] = group
            live = [s for s in live if not s.request.finished]
            if not live:
                break
        return list(touched.values())

    def _process(self, scheduled: list[ScheduledRequest], result: RunnerOutput, drafts: dict) -> list[RequestGroup]:
        now = time.monotonic()
        touched: dict[str, RequestGroup] = {}
        for s in scheduled:
            if s.request.request_id not in result.prompt_logprobs:
                continue
            req = s.request
            first, entries = result.prompt_logprobs[req.request_id]
            if req.prompt_logprobs is None:
                req.prompt_logprobs = [None]  # the first prompt token has no logprob
            if len(req.prompt_logprobs) == first:  # skip a recomputation after preemption
                req.prompt_logprobs.extend(self._to_logprobs(e) for e in entries)
        for s in scheduled:
            req = s.request
            sampled = result.sampled.get(req.request_id)
            verified = result.verified.get(req.request_id) if drafts else None
            if sampled is None and verified is None:
                continue
            group = self._request_to_group[req.request_id]
            touched[group.request_id] = group
            status = (self.verifier.book(req, drafts[req.request_id], verified,  # 1..k+1 tokens, each stop-checked
                                         lambda tok: self._take(req, group, tok, now, None))
                      if verified is not None else self._take(req, group, sampled.token_id, now, sampled))
            if status is not None:
                self.scheduler.finish(req, status)
        return list(touched.values())

    def _take(self, req: Request, group: RequestGroup, tok: int, now: float, sampled) -> RequestStatus | None:
        """Append one generated token and check the stop conditions after it."""
        req.append_output_token(tok)
        self.stats["generation_tokens"] += 1
        if req.first_token_time is None:
            req.first_token_time = now
        req.last_token_time = now
        if sampled is not None:  # None: a verified token (greedy, no logprobs asked)
            if sampled.logprob is not None:
                req.cumulative_logprob += sampled.logprob
            if req.logprobs is not None and sampled.top_logprobs is not None:
                req.logprobs.append(self._to_logprobs(sampled.top_logprobs))
        status = self._check_stop(req, group.detoks[req.request_id])
        if req.grammar is not None:
            status = self.structured.after_token(req, status)
        return status

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
    def _make_output(self, group: RequestGroup) -> RequestOutput | None:
        buffers = self.runner.hot_buffers
        out = make_output(group, buffers.request_counts if buffers is not None else None)
        if out is not None and out.finished:
            self._groups.pop(group.request_id, None)
            for r in group.children:
                self._request_to_group.pop(r.request_id, None)
                if buffers is not None:
                    buffers.forget(r.request_id)
        return out

    # -- introspection -------------------------------------------------------------------------
    def hisparse_stats(self) -> dict[str, float]:
        """HiSparse counters for /metrics ({} when it is off)."""
        buffers = self.runner.hot_buffers
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
        if self.runner.hot_buffers is not None:
            self.runner.hot_buffers.check_invariants()

    def reset_prefix_cache(self) -> int:
        dropped = self.kv.reset_prefix_cache()
        self._publish_kv_events()
        return dropped

    def _publish_kv_events(self) -> None:
        """Hand the KV cache events of the last step (or call) to the publisher, as one batch."""
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.publish(self.kv.take_kv_events())

    def check_workers(self) -> None:
        """Raise, naming the rank, when a tensor-parallel worker here exited since the last step."""
        if isinstance(self.runner, TensorParallelRunner):
            self.runner.workers.check()

    def parallel_layout(self) -> dict[str, str]:
        """How the model is split over processes and machines, as labels (the server exports them as
        hybridkv:parallel_layout, so a dashboard can tell what a deployment runs). backend: the collectives'
        (gloo, nccl), "none" in one process."""
        workers = getattr(self.runner, "workers", None)
        expert_parallel = bool(getattr(self.config, "enable_expert_parallel", False))  # not every build has it
        return {"tensor_parallel_size": str(self.config.tensor_parallel_size), "nnodes": str(self.config.nnodes),
                "backend": workers.backend if workers is not None else "none",
                "expert_parallel": str(expert_parallel).lower()}

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (none with tensor_parallel_size=1); GC and interpreter exit do too."""
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.close()
        self.structured.shutdown()
        if isinstance(self.runner, TensorParallelRunner):
            self.runner.shutdown()
            torch.set_num_threads(self._threads_before)  # the workers' cores are free again

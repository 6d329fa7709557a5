"""LLMEngine: add requests, call step(), collect RequestOutputs.

One step = schedule -> model runner forward + sample -> append tokens, detokenize, check
stop conditions -> release finished requests -> build outputs.
"""
from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass, field, fields
from typing import Any

from block_manager.kv_cache_manager import KVCacheManager
from engine.config import DEFAULT_KV_CACHE_CAP_BYTES, EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from model_executor.checkpoint import load_generation_config
from model_executor.model_runner import ModelRunner, RunnerOutput
from model_executor.tokenizer import load_tokenizer

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


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_dir = config.model
        if model_dir is None:
            from model_executor.demo_model import ensure_demo_model

            model_dir = ensure_demo_model()
        self.model_dir = model_dir
        self.runner = ModelRunner(
            model_dir, config.dtype, config.max_model_len, config.seed, config.allow_pickle_weights
        )
        self.max_model_len = self.runner.max_model_len
        self.tokenizer = load_tokenizer(model_dir)
        self.generation_defaults = load_generation_config(model_dir)
        self.eos_token_ids = set(self.generation_defaults.eos_token_ids)
        if not self.eos_token_ids and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids = {self.tokenizer.eos_token_id}

        specs = self.runner.space_specs()
        self.block_size = self._choose_block_size(specs)
        budget = config.max_num_batched_tokens or max(2048, self.max_model_len)
        self.kv = KVCacheManager(
            specs, self._pages_per_space(specs, budget), self.block_size, config.enable_prefix_caching,
            config.eviction_policy, config.windowed_match,
        )
        short = self.kv.spaces_short_for(self.max_model_len, budget)
        if short:
            raise ValueError(
                f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} holds fewer pages than one "
                f"max_model_len={self.max_model_len} sequence needs in block space(s) {', '.join(short)}; "
                f"raise it or lower max_model_len (or max_num_batched_tokens)"
            )
        self.runner.bind_kv_cache(self.kv)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, budget, self.max_model_len, config.scheduling_policy), self.kv
        )
        self._groups: dict[str, _Group] = {}
        self._request_to_group: dict[str, _Group] = {}
        self._counter = itertools.count()
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0}
        logger.info(
            "engine ready: model=%s dtype=%s max_model_len=%d block_size=%d spaces=%s prefix_caching=%s",
            model_dir, self.runner.dtype, self.max_model_len, self.block_size,
            {n: s.num_pages for n, s in self.kv.spaces.items()}, self.kv.enable_prefix_caching,
        )

    def _choose_block_size(self, specs) -> int:
        """The page size: the user's, or the model's preferred one when the user left the default.

        Page boundaries must be compression boundaries, so the page size must be a multiple
        of every space's tokens_per_slot (DeepSeek-V4 prefers 128).
        """
        P = self.config.block_size
        preferred = getattr(self.runner.model, "default_block_size", None)
        default = next(f.default for f in fields(EngineConfig) if f.name == "block_size")
        if preferred is not None and P == default and P != preferred:
            logger.info("block_size %d -> %d (this model's default page size)", P, preferred)
            P = preferred
        ratios = sorted({s.tokens_per_slot for s in specs})
        if any(P % r for r in ratios):
            lcm = math.lcm(*ratios)
            raise ValueError(
                f"block_size {P} is not a multiple of this model's compression ratios {ratios}: page "
                f"boundaries must be compression boundaries; use a multiple of {lcm}"
                + (f" (this model's default is {preferred})" if preferred else "")
            )
        return P

    def _pages_per_space(self, specs, max_chunk_tokens: int) -> dict[str, int]:
        """Split the KV memory between spaces by bytes per token of context.

        Whole-history spaces (full, c4, c128, indexer) all get n pages (n pages cover n*P
        tokens of history in each). A windowed space (swa, state) never needs more than every
        running sequence's window (+2 pages: one straddling the window start, one partial)
        plus one step's worth of new tokens, and never more than n + max_num_seqs pages;
        n is the largest count for which everything fits in the budget.
        """
        P = self.block_size
        seqs = self.config.max_num_seqs
        whole = [s for s in specs if not s.windowed]
        windowed = [s for s in specs if s.windowed]
        cap = {s.name: seqs * (-(-(s.window - 1) // P) + 2) + -(-max_chunk_tokens // P) for s in windowed}
        whole_bpp = sum(s.bytes_per_page(P) for s in whole)

        def cost(n: int) -> int:
            return n * whole_bpp + sum(min(n + seqs, cap[s.name]) * s.bytes_per_page(P) for s in windowed)

        budget = self.config.kv_cache_memory_bytes
        n_default = -(-seqs * (self.max_model_len + P) // P)
        if budget is None:
            budget = min(DEFAULT_KV_CACHE_CAP_BYTES, cost(n_default))
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
        return pages

    # -- requests ------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty; pass a non-empty string or token ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = list(prompt["prompt_token_ids"])
                return prompt.get("prompt"), ids
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> str:
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._counter))
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
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        children, detoks = [], {}
        for i in range(params.n):
            seed = params.seed + i if params.seed is not None else None
            child_params = params.clone(seed=seed)  # never mutate the caller's params
            child_params.all_stop_token_ids = set(params.stop_token_ids) | (
                set() if params.ignore_eos else self.eos_token_ids
            )
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            req = Request(child_id, ids, child_params, max_tokens, namespace=cache_salt, priority=priority)
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

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.empty:
            return []
        result = self.runner.execute(sched)
        self.scheduler.update_after_step(sched)
        self.stats["steps"] += 1
        touched = self._process(sched, result)
        return [o for o in (self._make_output(g) for g in touched) if o is not None]

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
        if finished:
            self._groups.pop(group.request_id, None)
            for r in group.children:
                self._request_to_group.pop(r.request_id, None)
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=max(0, lead.num_cached_tokens),
            metrics=self._metrics(group),
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
            "cached_tokens_per_space": dict(lead.cached_tokens_per_space),
        }

    # -- introspection -------------------------------------------------------------------------
    def check_invariants(self) -> None:
        self.kv.check_invariants()

    def reset_prefix_cache(self) -> int:
        return self.kv.reset_prefix_cache()

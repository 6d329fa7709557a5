"""StructuredOutputManager: what the engine calls for constrained requests, and their counters.

Lifecycle of a constrained request:
1. add: its spec is queued for compilation (or found in the cache); each of its n sequences gets
   a RequestGrammar. A spec already known to be bad is refused with a ValueError right away;
   LLM.generate and the server wait for their specs first (check()), so they always refuse a bad
   one before anything is added.
2. admission: the request waits in the scheduler's queue until its grammar is compiled (it is
   neither prefilled nor sampled before); others keep running meanwhile. A grammar that fails
   while its request waits (only possible through LLMEngine.add_request directly) finishes the
   request with finish_reason "abort".
3. each step: the allowed-token bitmask of every constrained sequence that samples now goes to
   the sampler with the step (never to the decode bursts: a constrained request is not plain
   greedy, so bursts do not run while one is scheduled).
4. each sampled token advances the sequence's matcher; when the grammar is complete the
   sequence finishes with "stop" (EOS is only allowed where the grammar accepts). With a start
   marker (start_after) steps 3 and 4 begin once the output holds the marker.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any

from hybridkv.engine.request import Request, RequestStatus
from hybridkv.engine.scheduler import ScheduledRequest
from hybridkv.engine.sampling_params import SamplingParams, StructuredOutputsParams
from hybridkv.engine.structured_output.bitmask_builder import BitmaskBuilder
from hybridkv.engine.structured_output.grammar_compiler import CompiledGrammar, GrammarCompiler
from hybridkv.engine.structured_output.request_grammar import RequestGrammar
from hybridkv.model_executor.token_bitmask import TokenBitmask

logger = logging.getLogger(__name__)


@dataclass
class StructuredOutputStats:
    """Counters for /metrics (engine snapshot)."""

    requests: int = 0  # user requests added with a constraint
    compiles: int = 0  # grammars compiled (cache misses), failures included
    compile_seconds: float = 0.0  # their total time on the worker
    compile_failures: int = 0
    cache_hits: int = 0  # specs found compiled (or compiling) in the cache


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int]) -> None:
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        self.builder = BitmaskBuilder(self.compiler.mask_width)
        self.num_requests = 0
        self._pending: list[Request] = []  # added, grammar not compiled yet
        self._checked: set[int] = set()  # specs check() looked up, by id, until their request is added

    # -- adding requests ----------------------------------------------------------------------
    def compile_all(self, specs: Iterable[StructuredOutputsParams]) -> list[Future[CompiledGrammar]]:
        """Queue every spec's compile (side by side on the worker, cached). Thread-safe: the
        server's handlers call it before adding their request."""
        specs = list(specs)
        futures = [self.compiler.compile(s) for s in specs]
        # Their requests' adds find these entries: not counted again as cache hits (grammars_for).
        if len(self._checked) > 4096:  # checked specs whose request was never added (refused for another reason)
            self._checked.clear()
        self._checked.update(id(s) for s in specs)
        return futures

    def check(self, specs: Iterable[StructuredOutputsParams], timeout: float | None = None) -> None:
        """compile_all, then wait: ValueError naming the first spec that cannot be compiled."""
        for fut in self.compile_all(specs):
            fut.result(timeout)

    def grammars_for(self, params: SamplingParams, n: int) -> list[RequestGrammar]:
        """One RequestGrammar per sequence of a request with a constraint (counted once)."""
        spec = params.structured_outputs
        checked = id(spec) in self._checked
        self._checked.discard(id(spec))
        fut = self.compiler.compile(spec, count_hit=not checked)
        if fut.done() and fut.exception() is not None:
            raise fut.exception()
        self.num_requests += 1
        start_after = (self.compiler.encode(spec.start_after) if spec.start_after is not None else None)
        return [RequestGrammar(fut, start_after) for _ in range(n)]

    def track(self, requests: Sequence[Request]) -> None:
        """Watch these sequences' compiles (a failure finishes them: take_failed)."""
        self._pending.extend(r for r in requests if r.grammar is not None and not r.grammar.ready)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def take_failed(self) -> list[tuple[Request, BaseException]]:
        """Sequences whose grammar failed to compile since the last call (still unfinished)."""
        failed, still = [], []
        for r in self._pending:
            if r.finished:
                continue
            if not r.grammar.ready:
                still.append(r)
            elif r.grammar.error is not None:
                failed.append((r, r.grammar.error))
        self._pending = still
        return failed

    def wait_for_compiles(self, timeout: float) -> None:
        """Sleep until one pending compile ends (or timeout): a step with nothing else to run."""
        futures = {r.grammar.compiled for r in self._pending if not r.grammar.ready}
        if futures:
            wait(futures, timeout, return_when=FIRST_COMPLETED)

    # -- each step ---------------------------------------------------------------------------
    def bitmask(self, scheduled: Sequence[ScheduledRequest]) -> TokenBitmask | None:
        """The allowed-token rows of the step's constrained sequences that sample."""
        rows = [(s.request_id, s.request.grammar, s.output_token_ids) for s in scheduled
                if s.samples and s.request.grammar is not None and s.request.grammar.active(s.output_token_ids)]
        return self.builder.build(rows)

    @staticmethod
    def after_token(req: Request, status: RequestStatus | None) -> RequestStatus | None:
        """Advance the sequence's matcher over its newest token; the status the sequence ends
        with: the stop checks' (status), else "stop" once the grammar is complete (also when
        max_tokens was reached by the token that completed it), or "abort" if the grammar refused
        the token (only when the mask left no token, e.g. min_tokens forbade the EOS the grammar
        required)."""
        grammar = req.grammar
        if status is not None and status is not RequestStatus.FINISHED_LENGTH:
            return status
        if not grammar.active(req.output_token_ids):  # before its start marker: unconstrained
            return status
        matcher = grammar.sync(req.output_token_ids)
        if grammar.failed:
            logger.warning("request %s: the grammar refused token %d (%s); finishing it",
                           req.request_id, req.output_token_ids[-1], matcher.get_error())
            return status or RequestStatus.FINISHED_ABORTED
        if grammar.terminated:
            return RequestStatus.FINISHED_STOPPED
        return status

    def stats(self) -> StructuredOutputStats:
        c = self.compiler
        return StructuredOutputStats(self.num_requests, c.num_compiles, c.compile_seconds, c.num_failures,
                                     c.num_cache_hits)

    def shutdown(self) -> None:
        self.compiler.shutdown()

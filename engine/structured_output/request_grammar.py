"""RequestGrammar: one sequence's grammar matcher, kept in step with its output tokens.

The matcher is advanced by each accepted token. Before a mask is computed it is synced to the
sequence's output tokens (consuming the ones it has not seen, rolling back any it saw that are
gone), so whatever happened in between -- a preemption (recompute or swap: the output tokens
survive it), a decode that never sampled -- the mask is always that of the tokens the request
holds. Each of a request's n sequences has its own matcher, sharing the compiled grammar.

With a start marker (StructuredOutputsParams.start_after, as token ids) the grammar applies only
to the tokens after the marker's first occurrence in the output: before it the sequence is
unconstrained (a reasoning model's thinking), and the matcher sees the answer alone.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from hybridkv.engine.structured_output.grammar_compiler import CompiledGrammar


class RequestGrammar:
    def __init__(self, compiled: Future[CompiledGrammar], start_after: list[int] | None = None) -> None:
        self.compiled = compiled
        self.matcher: Any = None  # llguidance.LLMatcher, made when the grammar is first needed
        self.num_consumed = 0  # output tokens (after the start marker) the matcher has advanced over
        self.start_after = start_after or None
        self._start: int | None = None  # where the constrained part begins, once the marker is found
        self._scanned = 0  # output tokens searched for the marker so far

    def start_of(self, output_token_ids: list[int]) -> int | None:
        """Index of the first constrained output token (None: the marker is not written yet).
        Each call scans only the tokens added since the last one (and the marker's length
        before them): a step costs what it adds, not the output's length."""
        marker = self.start_after
        if marker is None:
            return 0
        n, m = len(output_token_ids), len(marker)
        if self._start is not None and self._start <= n:
            return self._start
        if self._start is not None or n < self._scanned:  # the output was rolled back past it
            self._start, self._scanned = None, 0
        for i in range(max(0, self._scanned - m + 1), n - m + 1):
            if output_token_ids[i:i + m] == marker:
                self._start = i + m
                break
        self._scanned = n
        return self._start

    @property
    def ready(self) -> bool:
        """Compiled (or failed): the scheduler admits the request only then."""
        return self.compiled.done()

    @property
    def error(self) -> BaseException | None:
        return self.compiled.exception() if self.compiled.done() else None

    def active(self, output_token_ids: list[int]) -> bool:
        """Whether the grammar constrains the next token (the start marker, if any, is written)."""
        return self.start_of(output_token_ids) is not None

    def sync(self, output_token_ids: list[int]) -> Any:
        """The matcher, advanced over exactly the constrained part of `output_token_ids` (the
        caller checked active())."""
        if self.matcher is None:
            self.matcher = self.compiled.result().new_matcher()
        output_token_ids = output_token_ids[self.start_of(output_token_ids):]
        n = len(output_token_ids)
        if self.num_consumed > n:
            self.matcher.rollback(self.num_consumed - n)
            self.num_consumed = n
        while self.num_consumed < n:
            self.accept(output_token_ids[self.num_consumed])
        return self.matcher

    def accept(self, token_id: int) -> bool:
        """Advance over one sampled token; False if the grammar refused it (the matcher is then
        in its error state)."""
        ok = self.matcher.consume_token(token_id)
        self.num_consumed += 1
        return bool(ok)

    @property
    def terminated(self) -> bool:
        """The grammar is complete: no token but EOS could follow."""
        return self.matcher is not None and self.matcher.is_stopped()

    @property
    def failed(self) -> bool:
        return self.matcher is not None and self.matcher.is_error()

"""RequestGrammar: one sequence's grammar matcher, kept in step with its output tokens.

The matcher is advanced by each accepted token. Before a mask is computed it is synced to the
sequence's output tokens (consuming the ones it has not seen, rolling back any it saw that are
gone), so whatever happened in between -- a preemption (recompute or swap: the output tokens
survive it), a decode that never sampled -- the mask is always that of the tokens the request
holds. Each of a request's n sequences has its own matcher, sharing the compiled grammar.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from hybridkv.engine.structured_output.grammar_compiler import CompiledGrammar


class RequestGrammar:
    def __init__(self, compiled: Future[CompiledGrammar]) -> None:
        self.compiled = compiled
        self.matcher: Any = None  # llguidance.LLMatcher, made when the grammar is first needed
        self.num_consumed = 0  # output tokens the matcher has advanced over

    @property
    def ready(self) -> bool:
        """Compiled (or failed): the scheduler admits the request only then."""
        return self.compiled.done()

    @property
    def error(self) -> BaseException | None:
        return self.compiled.exception() if self.compiled.done() else None

    def sync(self, output_token_ids: list[int]) -> Any:
        """The matcher, advanced over exactly `output_token_ids`."""
        if self.matcher is None:
            self.matcher = self.compiled.result().new_matcher()
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

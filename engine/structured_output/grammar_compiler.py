"""Grammar compilation: a StructuredOutputsParams -> a compiled grammar, cached, off the step loop.

Why llguidance (and not xgrammar): one self-contained wheel (abi3, no torch, no TVM runtime; the
engine pins its own torch), grammars need no ahead-of-time compilation over the vocabulary (its
Earley parser with a lazy lexer builds a JSON schema's matcher in ~1-2 ms where xgrammar's
compiler pre-computes per-token tables), computing a mask takes tens of microseconds, and it
takes JSON schema, regex, Lark and GBNF, with error messages that point at the offending part.
vLLM ships it as its "guidance" backend.

Compiling runs on a worker thread (concurrent.futures): a request whose grammar is not ready
waits in the scheduler's queue (it is not admitted) while every other request keeps running.
Results are cached by the spec's canonical key (LRU, `cache_size` entries), so a schema sent by
every request of a workload compiles once; a failure is cached too (it would fail again). The
cached object is a template matcher; each sequence gets a deep copy (microseconds).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from hybridkv.engine.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 256  # distinct specs kept compiled


@dataclass
class CompiledGrammar:
    """A spec's grammar, ready: new_matcher() gives a sequence its own matcher at the start."""

    key: tuple[str, str]
    template: Any  # llguidance.LLMatcher, never advanced

    def new_matcher(self) -> Any:
        return self.template.deep_copy()


# Whitespace allowed between two JSON tokens: an optional newline, then up to 12 spaces (": ",
# pretty-printed indentation). The library's default ([ \t\n\r]+) lets a model (a small or random
# one especially) emit whitespace until max_tokens and never close the object; a bound forces it
# on to the next token.
JSON_WHITESPACE = r"\n?[ ]{0,12}"


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a spec (JSON text; ValueError on a malformed spec)."""
    import llguidance

    kind = spec.kind
    options = {"whitespace_pattern": JSON_WHITESPACE}
    if kind == "json":
        schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", spec.choice)
    return llguidance.grammar_from("grammar", spec.grammar)  # Lark or GBNF, told apart by llguidance


class GrammarCompiler:
    """Thread-safe: the engine thread and the server's handlers (which check a spec before adding
    its request) both call compile()."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int],
                 cache_size: int = DEFAULT_CACHE_SIZE, max_workers: int = 1) -> None:
        """tokenizer: the engine's (a transformers fast tokenizer); vocab_size: the model's logits
        width (the mask covers it; ids the tokenizer lacks are never allowed)."""
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        # The matcher's vocabulary: the logits' width, or the tokenizer's where it has more ids
        # (added tokens past the embedding); the sampler cuts a mask row to the logits' width.
        self.mask_vocab = max(vocab_size, len(tokenizer))
        self.eos_token_ids = sorted(eos_token_ids)
        self.cache_size = cache_size
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future[CompiledGrammar]] = OrderedDict()
        self._ll_tokenizer: Any = None  # built on the worker thread by the first compile (~0.3 s)
        # Counters (read by /metrics): compiles run, their total seconds, failures, cache hits.
        self.num_compiles = 0
        self.compile_seconds = 0.0
        self.num_failures = 0
        self.num_cache_hits = 0

    def encode(self, text: str) -> list[int]:
        """text's token ids, as the model would write it (no special tokens added)."""
        return list(self._hf_tokenizer.encode(text, add_special_tokens=False))

    @property
    def mask_width(self) -> int:
        """int32 words per mask row."""
        return (self.mask_vocab + 31) // 32

    def compile(self, spec: StructuredOutputsParams, count_hit: bool = True) -> Future[CompiledGrammar]:
        """The spec's compiled grammar: a cached future, or one just queued on the worker.
        Its exception, if any, is a ValueError naming the problem."""
        key = spec.key()
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += count_hit
                return fut
            fut = self._pool.submit(self._compile, spec, key)
            self._cache[key] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return fut

    def _tokenizer(self) -> Any:
        if self._ll_tokenizer is None:  # only the (single) worker thread gets here
            import llguidance.hf

            t0 = time.perf_counter()
            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self.mask_vocab,
                eos_token=self.eos_token_ids or None,
            )
            logger.info("structured outputs: llguidance tokenizer ready in %.2fs", time.perf_counter() - t0)
        return self._ll_tokenizer

    def _compile(self, spec: StructuredOutputsParams, key: tuple[str, str]) -> CompiledGrammar:
        import llguidance

        tokenizer = self._tokenizer()
        t0 = time.perf_counter()
        try:
            try:
                grammar = grammar_text(spec)
            except (ValueError, TypeError) as e:
                raise ValueError(f"structured_outputs.{spec.kind}: {e}") from None
            error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
            if error:
                raise ValueError(f"structured_outputs.{spec.kind} cannot be compiled: {error.strip()}")
            template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            if template.is_error():
                raise ValueError(f"structured_outputs.{spec.kind} cannot be compiled: {template.get_error()}")
        except ValueError:
            with self._lock:
                self.num_failures += 1
            raise
        finally:
            seconds = time.perf_counter() - t0
            with self._lock:
                self.num_compiles += 1
                self.compile_seconds += seconds
        logger.info("structured outputs: compiled a %s grammar in %.1f ms", spec.kind, seconds * 1e3)
        return CompiledGrammar(key, template)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

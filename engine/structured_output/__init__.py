"""Structured outputs (constrained decoding): the engine's side.

- grammar_compiler.py: a request's StructuredOutputsParams -> a compiled grammar, once per
  distinct spec (LRU cache), on a worker thread;
- request_grammar.py: one sequence's matcher, kept in step with its output tokens;
- bitmask_builder.py: the step's allowed-token bitmask of the constrained sequences that sample;
- manager.py: what the engine calls (add, admit, mask, accept) and the counters /metrics reads.

The library is llguidance (grammar_compiler.py says why). The model side only ever sees the
bitmask (model_executor/token_bitmask.py).
"""
from hybridkv.engine.structured_output.manager import StructuredOutputManager, StructuredOutputStats
from hybridkv.engine.structured_output.request_grammar import RequestGrammar

__all__ = ["RequestGrammar", "StructuredOutputManager", "StructuredOutputStats"]

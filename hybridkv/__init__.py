"""hybridkv: an LLM inference engine whose block manager understands hybrid attention.

The public API::

    from hybridkv import LLM, SamplingParams, StructuredOutputsParams

The subpackages are the repository's top-level folders, installed under this one name
(setup.py's package_dir maps them): hybridkv.engine, hybridkv.block_manager,
hybridkv.model_executor, hybridkv.attention_backends, hybridkv.entrypoints.

The public names are resolved lazily (PEP 562), so importing a lower layer such as
hybridkv.model_executor does not drag in the engine above it.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hybridkv.openmp_runtime import OpenMPRuntime, select as _select_openmp_runtime

__version__ = "0.1.0"

# Before anything imports torch: Intel's OpenMP runtime where installed (openmp_runtime.py says why).
OPENMP_RUNTIME: OpenMPRuntime = _select_openmp_runtime()

_PUBLIC = {
    "LLM": "hybridkv.entrypoints.llm",
    "SamplingParams": "hybridkv.model_executor.sampling_params",
    "StructuredOutputsParams": "hybridkv.model_executor.structured_outputs",
    "RequestOutput": "hybridkv.engine.outputs",
    "CompletionOutput": "hybridkv.engine.outputs",
    "Logprob": "hybridkv.engine.outputs",
}
__all__ = [*_PUBLIC, "__version__"]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load on first use
    from hybridkv.engine.outputs import CompletionOutput, Logprob, RequestOutput
    from hybridkv.entrypoints.llm import LLM
    from hybridkv.model_executor.sampling_params import SamplingParams
    from hybridkv.model_executor.structured_outputs import StructuredOutputsParams


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'hybridkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)

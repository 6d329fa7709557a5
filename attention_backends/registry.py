"""Attention backends by name (EngineConfig.attention_backend / LLM(attention_backend=...)).

Only "torch_native" today; Triton and xformers register here when they arrive. Models with
their own attention math (DeepSeek-V4's hybrid layers) bind their own backend in
allocate_kv_cache and ignore this choice.
"""
from __future__ import annotations

from typing import Callable

from hybridkv.attention_backends.torch_native import TorchNativeAttention

_BACKENDS: dict[str, Callable[[], object]] = {
    TorchNativeAttention.name: TorchNativeAttention,
}


def available_attention_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_attention_backend(name: str):
    """A new backend instance; unknown names raise ValueError listing the choices."""
    try:
        factory = _BACKENDS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of: {', '.join(available_attention_backends())}"
        ) from None
    return factory()

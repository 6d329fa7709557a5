"""Every attention backend implements its family's contract (attention_backends/backend.py) with
the contract's exact forward signature, so a model can call any of them the same way."""
from __future__ import annotations

import importlib
import inspect

import pytest

from hybridkv.attention_backends.backend import AttentionBackend, HybridAttentionBackend
from hybridkv.attention_backends.registry import _BACKENDS, available_attention_backends

HYBRID = ["hybridkv.attention_backends.hybrid_v4:HybridV4Attention",
          "hybridkv.attention_backends.triton_attention.hybrid_v4:TritonHybridV4Attention"]


def load(spec: str) -> type:
    module, name = spec.split(":")
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as e:  # triton / xformers not installed here
        pytest.skip(f"{spec}: {e}")


def same_parameters(cls: type, base: type) -> None:
    want = list(inspect.signature(base.forward).parameters)
    got = list(inspect.signature(cls.forward).parameters)
    assert got == want, f"{cls.__name__}.forward takes {got}, the contract {want}"


@pytest.mark.parametrize("name", available_attention_backends())
def test_every_registered_backend_implements_the_paged_contract(name):
    cls = load(_BACKENDS[name])
    assert issubclass(cls, AttentionBackend), f"{name} does not implement AttentionBackend"
    assert cls.name == name
    same_parameters(cls, AttentionBackend)


@pytest.mark.parametrize("spec", HYBRID)
def test_every_hybrid_backend_implements_the_hybrid_contract(spec):
    cls = load(spec)
    assert issubclass(cls, HybridAttentionBackend)
    same_parameters(cls, HybridAttentionBackend)


def test_a_backend_missing_forward_cannot_be_built():
    class Incomplete(AttentionBackend):
        name = "incomplete"

    with pytest.raises(TypeError):
        Incomplete()

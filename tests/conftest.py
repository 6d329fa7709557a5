"""Shared fixtures: tiny checkpoints, and the leak check every test ends with."""
from __future__ import annotations

import os

import pytest
import torch

# The Triton kernels run on CPU tensors only under the interpreter, and a kernel is bound to
# the interpreter or not when its module is imported. Without a GPU, turn it on before any
# test runs, so that the result does not depend on which test imported a kernel module first
# (a model test importing one before the kernel tests set the flag made them fail).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from redis_server import redis_server, redis_server_factory  # noqa: F401 - fixtures (a real redis-server)
from tiny_checkpoints import build_checkpoint


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """Factory: tiny_ckpt("llama" | "qwen2" | "qwen3" | "mistral", **config overrides) -> folder (cached per session)."""
    cache: dict = {}

    def make(arch: str = "llama", **overrides) -> str:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"ckpt_{arch}")
            cache[key] = build_checkpoint(str(path), arch, **overrides)
        return cache[key]

    return make


@pytest.fixture(autouse=True)
def _engines_end_idle(monkeypatch):
    """Invariant checked after every test: each engine it built holds no page; all pages are free or
    cached; and no tensor-parallel worker process of it still runs."""
    from hybridkv.engine.llm_engine import LLMEngine

    built: list[LLMEngine] = []
    original = LLMEngine.__init__

    def tracking_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(LLMEngine, "__init__", tracking_init)
    yield built
    for engine in built:
        assert not engine.has_unfinished_requests(), "test left requests in the engine (abort them)"
        engine.kv.assert_idle()
        hot = engine.runner.hot_buffers  # HiSparse: every request's hot-buffer row was released
        assert hot is None or hot.num_active == 0, f"{hot.num_active} hot-buffer rows still held"
        workers = getattr(engine.runner, "workers", None)  # tensor_parallel_size > 1
        alive = [p.pid for p in workers.processes if p.is_alive()] if workers is not None else []
        assert not alive, f"test left tensor-parallel workers {alive} running (LLM.shutdown())"

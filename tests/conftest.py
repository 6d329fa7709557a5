"""Shared fixtures: tiny checkpoints, and the leak check every test ends with."""
from __future__ import annotations

import pytest

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
    """Invariant checked after every test: each engine it built holds no page; all pages are free or cached."""
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

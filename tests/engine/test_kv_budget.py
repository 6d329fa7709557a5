"""engine/kv_budget.py: the default KV budget is sized from the machine (a fraction of the memory
available, never below one full-length sequence), and a budget that cannot hold one sequence is
refused before the weights load, naming the flags to change."""
from __future__ import annotations

import logging
import sys

import pytest

from hybridkv import LLM
from hybridkv.engine import kv_budget
from hybridkv.model_executor import model_runner
from memory_pages import resident_fraction


@pytest.fixture
def no_weight_load(monkeypatch):
    """Fail the test if the checkpoint's weights are read: the check must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("the weights were read before the KV budget was checked")

    monkeypatch.setattr(model_runner, "iter_weights", refuse)


def _full_space_page_bytes(path: str) -> int:
    skeleton = model_runner.model_skeleton(path, "float32", 128, "cpu")
    (spec,) = skeleton.specs
    return spec.bytes_per_page(16)


def test_a_budget_below_one_sequence_is_refused_before_the_weights_load(tiny_ckpt, no_weight_load):
    path = tiny_ckpt("llama")
    page = _full_space_page_bytes(path)
    with pytest.raises(ValueError) as info:
        LLM(path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=3 * page)
    message = str(info.value)
    assert "--kv-cache-memory-bytes" in message and "--max-model-len" in message, "the flags to change are not named"
    assert "full (needs 8 pages, has 3)" in message, message


def test_the_default_budget_is_a_fraction_of_available_memory_and_holds_one_sequence(tiny_ckpt, monkeypatch, caplog):
    path = tiny_ckpt("llama")
    page = _full_space_page_bytes(path)
    one_sequence = (128 // 16) * page
    # A machine with almost no memory available: the default still holds one full-length sequence.
    monkeypatch.setattr(kv_budget, "available_memory_bytes", lambda: 1)
    with caplog.at_level(logging.INFO, logger="hybridkv.engine"):
        llm = LLM(path, dtype="float32", max_model_len=128, max_num_seqs=64)
    assert llm.engine.kv.spaces["full"].num_pages * page >= one_sequence
    assert llm.engine.kv.spaces["full"].num_pages < 64 * 8, "the default ignored the memory cap"
    assert any("KV cache budget" in r.getMessage() for r in caplog.records), "the startup log does not state the budget"
    # Plenty available: what max_num_seqs full-length sequences need, and no more.
    monkeypatch.setattr(kv_budget, "available_memory_bytes", lambda: 1 << 40)
    roomy = LLM(path, dtype="float32", max_model_len=128, max_num_seqs=4)
    assert roomy.engine.kv.spaces["full"].num_pages == 4 * (128 + 16) // 16


@pytest.mark.parametrize("raw", ["0", "1.5", "-0.1", "half"])
def test_a_bad_fraction_is_an_error_naming_the_variable(monkeypatch, raw):
    monkeypatch.setenv(kv_budget.FRACTION_VARIABLE, raw)
    with pytest.raises(ValueError, match=kv_budget.FRACTION_VARIABLE):
        kv_budget.default_kv_cache_cap_bytes()


def test_the_fraction_scales_the_cap(monkeypatch):
    monkeypatch.setattr(kv_budget, "available_memory_bytes", lambda: 1000 << 20)
    monkeypatch.setenv(kv_budget.FRACTION_VARIABLE, "0.5")
    assert kv_budget.default_kv_cache_cap_bytes() == 500 << 20
    monkeypatch.delenv(kv_budget.FRACTION_VARIABLE)
    assert kv_budget.default_kv_cache_cap_bytes() == 250 << 20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore(2) on Linux")
def test_the_kv_cache_is_taken_lazily_unless_prefaulted(tiny_ckpt):
    """LLM's default pool is (almost) not resident after start, however large the budget; with
    kv_cache_prefault every page of it is resident before the first request."""
    path = tiny_ckpt("llama")
    budget = 64 << 20
    lazy = LLM(path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=budget)
    (pool,) = lazy.engine.runner.kv_caches["full"]
    assert pool.numel() * pool.element_size() > 32 << 20
    assert resident_fraction(pool) < 0.05, "the default KV pool was touched at start"
    eager = LLM(path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=budget, kv_cache_prefault=True)
    (pool,) = eager.engine.runner.kv_caches["full"]
    assert resident_fraction(pool) == 1.0, "a prefaulted pool must be resident before the first request"

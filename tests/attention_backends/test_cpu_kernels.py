"""attention_backends/cpu_kernels: when the C++ kernel cannot be had (switched off, no compiler,
a failed build) the loader says so once and returns None, and the torch-native backend decodes
over the torch tiles with the same result; a backend without the kernel never silently runs on
metadata that lacks the tiles."""
from __future__ import annotations

import logging

import pytest
import torch

from hybridkv.attention_backends import cpu_kernels
from hybridkv.attention_backends.metadata import StepSequences, build_attention_metadata
from hybridkv.attention_backends.torch_native import TorchNativeAttention

P, H, HKV, D = 4, 4, 2, 8


# Every loader the backend calls when it is built: each is cached per process, so one that ran
# while a test switched the kernels off would hand None to every later test (the bf16 prefill
# tests failed that way when this file ran before them in a fresh process).
_BACKEND_LOADERS = (cpu_kernels.load_paged_attention_module, cpu_kernels.load_prefill_attention,
                    cpu_kernels.load_prefill_attention_bf16)


@pytest.fixture
def fresh_loader():
    """Clear the backend's cached loaders around the test (the next user reloads the compiled
    modules from the build cache)."""
    for loader in _BACKEND_LOADERS:
        loader.cache_clear()
    yield
    for loader in _BACKEND_LOADERS:
        loader.cache_clear()


def _decode_step():
    g = torch.Generator().manual_seed(0)
    lens = [5, 9]
    tables = [[1, 2], [3, 4, 5]]
    k_cache = torch.randn(HKV, 6 * P, D, generator=g)
    v_cache = torch.randn(HKV, 6 * P, D, generator=g)
    k_cache[:, :P] = 0
    v_cache[:, :P] = 0
    seqs = StepSequences.from_page_lists([1, 1], lens, {"full": tables})
    q = torch.randn(2, H, D, generator=g)
    k_new = torch.stack([k_cache[:, t[(n - 1) // P] * P + (n - 1) % P] for t, n in zip(tables, lens)])
    v_new = torch.stack([v_cache[:, t[(n - 1) // P] * P + (n - 1) % P] for t, n in zip(tables, lens)])
    return seqs, (q, k_new, v_new, k_cache, v_cache)


def _run(backend: TorchNativeAttention):
    seqs, (q, k, v, kc, vc) = _decode_step()
    seqs.decode_tiles = backend.needs_decode_tiles
    meta = build_attention_metadata(seqs, {"full": None}, P)
    return backend.forward(q, k, v, kc, vc, meta, "full", D**-0.5)


def test_switched_off_by_the_environment(fresh_loader, monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    assert cpu_kernels.load_paged_attention() is None and cpu_kernels.load_write_kv() is None
    assert TorchNativeAttention().needs_decode_tiles, "without the kernel the backend must ask for tiles"


def test_the_backend_writes_the_same_cache_with_and_without_write_kv():
    # The step's new rows must land in the same slots whether write_kv or index_copy_ puts them there.
    caches = []
    for kernels in (True, False):
        seqs, (q, k, v, kc, vc) = _decode_step()
        k, v = k + 1.0, v - 1.0  # new rows, different from what the slots held
        backend = TorchNativeAttention(cpu_kernels=kernels)
        seqs.decode_tiles = backend.needs_decode_tiles
        backend.forward(q, k, v, kc, vc, build_attention_metadata(seqs, {"full": None}, P), "full", D**-0.5)
        caches.append((kc, vc))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert not torch.equal(caches[1][0], _decode_step()[1][3]), "the step wrote nothing"


def test_a_failed_build_falls_back_to_torch_with_one_warning(fresh_loader, monkeypatch, caplog):
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension 'hybridkv_paged_attention': g++: not found")

    monkeypatch.setattr(cpp_extension, "load_inline", no_compiler)
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        backend = TorchNativeAttention()
        first = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
        TorchNativeAttention()  # the outcomes are cached: one attempt per kernel, one warning each
    assert backend.needs_decode_tiles
    warnings = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    kernels = [w.split(" unavailable")[0] for w in warnings]
    assert first and warnings == first and len(set(kernels)) == len(kernels), warnings
    assert all("g++: not found" in w for w in warnings)
    for loader in _BACKEND_LOADERS:
        loader.cache_clear()
    monkeypatch.undo()
    with_kernel = TorchNativeAttention()
    assert not with_kernel.needs_decode_tiles, "the CPU paged kernel did not build on this machine"
    torch.testing.assert_close(_run(backend), _run(with_kernel), atol=1e-5, rtol=1e-5)


def test_a_backend_without_the_kernel_refuses_metadata_without_tiles():
    backend = TorchNativeAttention(cpu_kernels=False)
    seqs, (q, k, v, kc, vc) = _decode_step()
    seqs.decode_tiles = False  # as for a backend that reads the block tables in place
    meta = build_attention_metadata(seqs, {"full": None}, P)
    with pytest.raises(RuntimeError, match="decode tiles were not built"):
        backend.forward(q, k, v, kc, vc, meta, "full", D**-0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_puts_rows_where_index_copy_does(dtype):
    write_kv = cpu_kernels.load_write_kv()
    if write_kv is None:
        pytest.skip("the CPU kernels do not build on this machine")
    g = torch.Generator().manual_seed(1)
    T, slots_n = 7, 40
    # k and v as the model hands them over: views into a fused qkv row, not contiguous tensors.
    qkv = torch.randn(T, (H + 2 * HKV) * D, generator=g).to(dtype)
    k = qkv[:, H * D:(H + HKV) * D].view(T, HKV, D)
    v = qkv[:, (H + HKV) * D:].view(T, HKV, D)
    slots = torch.randperm(slots_n, generator=g)[:T]
    kc, vc = torch.randn(HKV, slots_n, D, generator=g).to(dtype), torch.randn(HKV, slots_n, D, generator=g).to(dtype)
    ref_k, ref_v = kc.clone(), vc.clone()
    ref_k.index_copy_(1, slots, k.transpose(0, 1))
    ref_v.index_copy_(1, slots, v.transpose(0, 1))
    write_kv(kc, vc, slots, k, v)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v), "write_kv must write exactly what index_copy_ writes"


def test_write_kv_refuses_a_slot_outside_the_cache_before_writing():
    write_kv = cpu_kernels.load_write_kv()
    if write_kv is None:
        pytest.skip("the CPU kernels do not build on this machine")
    kc, vc = torch.zeros(HKV, 8, D), torch.zeros(HKV, 8, D)
    k = v = torch.ones(2, HKV, D)
    with pytest.raises(RuntimeError, match="outside the cache"):
        write_kv(kc, vc, torch.tensor([3, 8]), k, v)
    assert not kc.any() and not vc.any(), "nothing may be written when a slot is out of range"

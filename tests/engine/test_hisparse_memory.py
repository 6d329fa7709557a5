"""HiSparse's memory split on tiny DeepSeek-V4 checkpoints: the C4 mirror in host memory, only
hot buffers on the device, and the bytes of each tier counted from the tensors.

Invariants checked:
- every KV tensor sits on its tier's device: the c4 mirror in host memory (pinned only for a
  CUDA engine), every other space, each hot buffer and the hot buffers' slot tables on the
  engine's device -- for this CPU engine, and for the same layout allocated for another device
  (the meta device stands in for CUDA: a tensor created on the wrong side shows there);
- the paths that cross devices on CUDA (host gathers of the mirror, staged mirror writes, the
  prefill read of the mirror) run on the CPU when forced, and outputs still equal HiSparse off;
- the bytes per tier and space in the startup log and in /metrics are those of the tensors;
- at a 32k-token context and a 128 MiB device budget the device holds no more KV bytes than the
  budget (counted on the allocated storages) while HiSparse holds >= 5x the decode batch, with
  the tokens of HiSparse off.
"""
from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch

from bench_runner import load_benchmark
from hybridkv.attention_backends import hisparse_reads, host_mirror
from hybridkv.block_manager.kv_plan import HotBufferShape
from hybridkv.entrypoints import LLM, SamplingParams
from tiny_deepseek_v4 import build_v4_checkpoint, single_thread

KW = dict(dtype="float32", block_size=32, max_model_len=2048, max_num_seqs=4)


@pytest.fixture(scope="module")
def v4_path(tmp_path_factory) -> str:
    return build_v4_checkpoint(str(tmp_path_factory.mktemp("v4mem")))


@pytest.fixture(autouse=True)
def _one_thread():
    with single_thread():
        yield


def _prompts(lengths, seed=0, vocab=200):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _tokens(llm: LLM, prompts, max_tokens: int) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                         use_tqdm=False)]


def _layer_tensors(model) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(device-tier, host-tier) tensors the model's layers were bound to, plus the hot buffers'
    slot tables: walked from the layers themselves, not from what allocate_kv_cache returned."""
    device, host = [], []
    for layer in model.layers:
        cache = layer.attn.cache
        device.append(cache.swa)
        if cache.hot is not None:
            device.append(cache.hot)
        for i, cc in enumerate((cache.compressor, cache.indexer)):
            if cc is None:
                continue
            device += [cc.state_kv, cc.state_gate]
            mirrored = i == 0 and cache.hot is not None  # a CSA layer's c4 entries with HiSparse
            (host if mirrored else device).append(cc.entries)
    if model.hot_buffers is not None:
        device += model.hot_buffers.tables()
    return device, host


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages under these tensors (views of one pool count once)."""
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr() if t.device.type != "meta" else id(s)] = s.nbytes()
    return sum(seen.values())


def _check_placement(model, device: torch.device) -> None:
    on_device, on_host = _layer_tensors(model)
    assert on_host, "HiSparse is on: the c4 mirror must be among the model's tensors"
    wrong = [tuple(t.shape) for t in on_device if t.device != device]
    assert not wrong, f"KV tensors of the device tier not on {device}: {wrong}"
    assert all(t.device.type == "cpu" for t in on_host), [t.device for t in on_host]
    pinned = device.type == "cuda" and torch.cuda.is_available()
    assert all(t.is_pinned() == pinned for t in on_host), "the mirror is pinned exactly when the device is CUDA"


def test_every_kv_tensor_sits_on_its_tiers_device(v4_path):
    from hybridkv.model_executor.model_runner import model_skeleton

    llm = LLM(v4_path, enable_hisparse=True, hisparse_config={"hot_buffer_size": 16}, **KW)
    runner = llm.engine.runner
    layout = runner.layout
    assert layout.host_spaces == frozenset({"c4"}) and layout.hot_buffers == HotBufferShape(2, 4, 16, 8)
    _check_placement(runner.model, runner.device)
    # The same layout allocated for another device than the CPU: meta stands in for CUDA.
    meta = torch.device("meta")
    skeleton = model_skeleton(v4_path, "float32", KW["max_model_len"], "cpu").model
    caches = skeleton.allocate_kv_cache(layout, None, torch.float32, meta)
    _check_placement(skeleton, meta)
    assert all(t.device.type == ("cpu" if name == "c4" else "meta") for name, ts in caches.items() for t in ts)
    aux = skeleton.auxiliary_kv_tensors()["hot_buffer"]
    assert len(aux) == 2 + 3 and all(t.device == meta for t in aux)  # 2 CSA layers' buffers, 3 tables


def test_the_cross_device_paths_run_on_the_cpu_and_change_nothing(v4_path, monkeypatch):
    """On CUDA every read of the mirror is a host gather plus one transfer, and the step's new
    entries are staged and scattered once per step. Forced here (host_mirror.crosses says every
    pool is elsewhere; the transfers are then CPU copies): chunked prefills that read the mirror,
    hand-offs, misses and new entries all take those paths, and the tokens equal HiSparse off."""
    ran: Counter[str] = Counter()
    monkeypatch.setattr(host_mirror, "crosses", lambda pool, compute: True)
    for name in ("gather_rows", "keys_on"):
        real = getattr(hisparse_reads, name)

        def counted(*args, _real=real, _name=name):
            ran[_name] += 1
            return _real(*args)

        monkeypatch.setattr(hisparse_reads, name, counted)
    real_flush = host_mirror.MirrorWrites.flush

    def flush(self):
        ran["staged_flushes"] += bool(self._pending)
        real_flush(self)

    monkeypatch.setattr(host_mirror.MirrorWrites, "flush", flush)
    prompts = _prompts([300, 90, 200], seed=3)
    kw = dict(KW, max_num_batched_tokens=128)
    want = _tokens(LLM(v4_path, **kw), prompts, 16)
    llm = LLM(v4_path, enable_hisparse=True, hisparse_config={"hot_buffer_size": 8}, **kw)
    assert _tokens(llm, prompts, 16) == want
    st = llm.engine.runner.hot_buffers.stats
    assert st.loaded > 0 and st.handoffs == 3, st
    assert ran["gather_rows"] > 0 and ran["keys_on"] > 0 and ran["staged_flushes"] > 0, ran


def test_allocated_bytes_per_tier_and_space_are_logged_and_exported(v4_path, caplog):
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from hybridkv.engine.async_llm_engine import EngineSnapshot
    from hybridkv.entrypoints.openai.metrics import ServerMetrics

    with caplog.at_level(logging.INFO, logger="hybridkv.engine.kv_memory_plan"):
        llm = LLM(v4_path, enable_hisparse=True, hisparse_config={"hot_buffer_size": 16},
                  enable_hierarchical_cache=True, **KW)
    eng = llm.engine
    runner = eng.runner

    def nbytes(ts):
        return sum(t.numel() * t.element_size() for t in ts)

    hot = [layer.attn.cache.hot for layer in runner.model.layers if layer.attn.cache.hot is not None]
    device = {name: nbytes(ts) for name, ts in runner.kv_caches.items() if name != "c4"}
    device["hot_buffer"] = nbytes(hot + runner.hot_buffers.tables())
    host = {name: nbytes(ts) for name, ts in runner.host_cache.host.items()}
    host["c4"] += nbytes(runner.kv_caches["c4"])
    assert eng.kv_cache_bytes == {"device": device, "host": host}
    assert device["hot_buffer"] == eng.hisparse.device_bytes > 0

    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache allocated")]
    assert len(lines) == 1, lines
    mib = lambda n: f"{n / 2**20:.2f}"  # noqa: E731
    assert f"device {mib(sum(device.values()))} MiB (" in lines[0] and f"hot_buffer {mib(device['hot_buffer'])}" in lines[0]
    assert f"host {mib(sum(host.values()))} MiB (" in lines[0] and f"c4 {mib(host['c4'])}" in lines[0], lines[0]

    text = generate_latest(ServerMetrics("m", lambda: EngineSnapshot.capture(eng)).registry).decode()
    family = next(f for f in text_string_to_metric_families(text) if f.name == "hybridkv:kv_cache_bytes")
    assert family.type == "gauge"
    got = {(s.labels["tier"], s.labels["space"]): s.value for s in family.samples}
    assert got == {(tier, space): float(n) for tier, spaces in eng.kv_cache_bytes.items() for space, n in spaces.items()}


def test_32k_context_at_128_mib_fits_the_device_budget_and_holds_5x_the_batch(tmp_path):
    """benchmarks/hisparse.py's tiny V4 (C4 most of the whole-history KV): the largest decode
    batch by the engine's own page arithmetic, HiSparse off and on, at a 32k-token context and a
    128 MiB device budget; the engine built at HiSparse's batch allocates at most the budget on the
    device (the storages its layers are bound to), and a short run gives HiSparse off's tokens."""
    bench = load_benchmark("hisparse")
    model = bench.build_model(str(tmp_path))
    budget, context, out = 128 << 20, 32768, 16
    hot = 2 * bench.OVERRIDES["index_topk"]
    L = context + out
    batch_off, batch_on = bench.max_batch(model, L, budget, None), bench.max_batch(model, L, budget, hot)
    assert batch_off >= 1 and batch_on >= bench.TARGET_BATCH_X * batch_off, (batch_off, batch_on)

    on = LLM(model, **bench.engine_kw(L, batch_on, budget, hot))
    assert bench.capacity(on, L) >= batch_on
    device, host = _layer_tensors(on.engine.runner.model)
    allocated = _storage_bytes(device)
    assert allocated <= budget, f"{allocated} bytes on the device for KV, budget {budget}"
    assert allocated == sum(on.engine.kv_cache_bytes["device"].values())
    assert _storage_bytes(host) == on.engine.kv_cache_bytes["host"]["c4"] > budget  # the mirror: off the device

    off = LLM(model, **bench.engine_kw(L, batch_off, budget, None))
    prompts = bench.prompts(3, 300, 1, on.engine.runner.config.vocab_size)  # all three run at once in both
    assert _tokens(on, prompts, out) == _tokens(off, prompts, out)
    print(f"device KV bytes allocated {allocated} of {budget}; decode batch off {batch_off}, on {batch_on} "
          f"({batch_on / batch_off:.2f}x)")


def _tensors_in(obj, seen=None):
    """Every tensor reachable from a step's metadata (dataclasses, key sets, lists, tuples, dicts)."""
    import dataclasses

    from hybridkv.attention_backends.hybrid_metadata import KeySet

    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, KeySet):
        for t in (obj._slots, obj.explicit_mask, obj.visible, obj.pages):
            if t is not None:
                yield t
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors_in(getattr(obj, f.name), seen)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors_in(x, seen)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors_in(x, seen)


def test_a_steps_metadata_moves_to_the_engines_device_whole(v4_path):
    """What a CUDA engine's forward reads of a step's metadata is on the device: the runner's move
    of the host-built metadata reaches every tensor, in key sets and compression plans too (the
    meta device stands in for CUDA), for prefill and decode steps with HiSparse on."""
    from hybridkv.model_executor.model_runner import _to_device

    llm = LLM(v4_path, enable_hisparse=True, hisparse_config={"hot_buffer_size": 16}, **KW)
    model = llm.engine.runner.model
    metas = []
    build = model.build_attention_metadata

    def capture(*args, **kwargs):
        metas.append(build(*args, **kwargs))
        return metas[-1]

    model.build_attention_metadata = capture
    _tokens(llm, _prompts([70, 150]), max_tokens=6)
    assert len(metas) >= 6, "the run did not build prefill and decode metadata"
    for meta in metas:
        moved = list(_tensors_in(_to_device(meta, torch.device("meta"))))
        assert moved, "no tensor found in the metadata"
        left = [tuple(t.shape) for t in moved if t.device.type != "meta"]
        assert not left, f"metadata tensors left on the host after the move to the device: {left[:5]}"

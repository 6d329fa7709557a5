"""HostKVCache: the host tier's page copies are bit-exact, touch only the pages named, run
device->host before host->device, and cover every physical tensor of a space."""
from __future__ import annotations

import pytest
import torch

from hybridkv.block_manager.kv_cache_manager import KVCacheManager
from hybridkv.block_manager.kv_plan import TierTransfers
from hybridkv.model_executor.host_kv_cache import HostKVCache

NUM_PAGES = 7  # device pages per space, null page 0 included
HOST_PAGES = 9
LAYOUTS = ("page_first", "layer_first")
DTYPES = (torch.float32, torch.bfloat16)


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads, denormals, -0): a copy that goes through float
    arithmetic or a canonicalising cast would change some of them."""
    elt = torch.tensor([], dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * elt), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def page(t: torch.Tensor, spp: int, p: int) -> torch.Tensor:
    """Page p of a tensor whose slot dimension is dim -2."""
    return t.unflatten(-2, (t.shape[-2] // spp, spp)).select(-3, p)


def dense_space(dtype: torch.dtype, spp: int, gen: torch.Generator) -> list[torch.Tensor]:
    """The base model's layout: one [layers, 2, Hkv, slots, D] tensor."""
    return [random_bits((2, 2, 3, NUM_PAGES * spp, 8), dtype, gen)]


def v4_space(dtype: torch.dtype, spp: int, gen: torch.Generator) -> list[torch.Tensor]:
    """V4's layout: several tensors of different shapes and dtypes share the space's pages."""
    slots = NUM_PAGES * spp
    return [
        random_bits((3, slots, 8), dtype, gen),
        random_bits((slots, 5), torch.float32, gen),
        random_bits((slots, 3), dtype, gen),
        random_bits((slots, 6), torch.float32, gen),
    ]


def make_cache(layout: str, dtype: torch.dtype, kind: str, seed: int = 0):
    """Two spaces with different slots per page, host pages pre-filled with random bits (the
    real pool is torch.empty) so untouched host pages can be checked too."""
    gen = torch.Generator().manual_seed(seed)
    build = dense_space if kind == "dense" else v4_space
    spp = {"a": 4, "b": 2}
    caches = {name: build(dtype, n, gen) for name, n in spp.items()}
    host = HostKVCache(caches, spp, {name: HOST_PAGES for name in spp}, layout=layout)
    for hs in host.host.values():
        for h in hs:
            h.copy_(random_bits(tuple(h.shape), h.dtype, gen))
    return host, caches, spp


def host_page_bits(host: HostKVCache, name: str, p: int) -> torch.Tensor:
    """A host page's bytes in page_first order, whatever the layout."""
    if host.layout == "page_first":
        return host.host[name][0][p].clone()
    spp = host.slots_per_page[name]
    return torch.cat([bits(page(h, spp, p)).flatten() for h in host.host[name]])


def device_page_bits(caches: dict[str, list[torch.Tensor]], spp: int, name: str, p: int) -> torch.Tensor:
    return torch.cat([bits(page(t, spp, p)).flatten() for t in caches[name]])


def snapshot(host: HostKVCache, caches, spp) -> tuple[dict, dict]:
    dev = {(n, p): device_page_bits(caches, spp[n], n, p) for n in caches for p in range(NUM_PAGES)}
    hst = {(n, p): host_page_bits(host, n, p) for n in caches for p in range(HOST_PAGES)}
    return dev, hst


@pytest.mark.parametrize("kind", ["dense", "v4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_round_trip_bit_exactly_and_only_named_pages_change(layout, dtype, kind):
    host, caches, spp = make_cache(layout, dtype, kind)
    out_pages = {"a": {4: 2, 0: 5, 8: 3}, "b": {1: 6, 2: 1}}  # host page <- device page
    dev0, host0 = snapshot(host, caches, spp)

    host.apply(TierTransfers(to_host=out_pages))
    dev1, host1 = snapshot(host, caches, spp)
    assert all(torch.equal(dev1[k], dev0[k]) for k in dev0), "to_host must not change the device"
    for (n, p), before in host0.items():
        want = dev0[(n, out_pages[n][p])] if p in out_pages[n] else before
        assert torch.equal(host1[(n, p)], want), f"host page {n}/{p}: written = the device page, others untouched"

    # Overwrite the source pages with garbage, then load into *different* device pages.
    gen = torch.Generator().manual_seed(1)
    for n, pairs in out_pages.items():
        for t in caches[n]:
            for d in pairs.values():
                page(t, spp[n], d).copy_(random_bits(tuple(page(t, spp[n], d).shape), t.dtype, gen))
    back = {"a": {1: 4, 4: 0, 6: 8}, "b": {3: 1, 5: 2}}  # device page <- host page
    dev2, host2 = snapshot(host, caches, spp)
    host.apply(TierTransfers(to_device=back))
    dev3, host3 = snapshot(host, caches, spp)
    assert all(torch.equal(host3[k], host2[k]) for k in host2), "to_device must not change the host"
    for (n, p), before in dev2.items():
        want = dev0[(n, out_pages[n][back[n][p]])] if p in back[n] else before
        assert torch.equal(dev3[(n, p)], want), f"device page {n}/{p}: loaded ones bit-exact, others untouched"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_page_first_row_is_the_pages_bytes_tensor_after_tensor(layout):
    """The page_first contract: one contiguous uint8 row per host page = each tensor's page slice
    in C order, in list order; layer_first mirrors each device tensor with host slots."""
    host, caches, spp = make_cache(layout, torch.bfloat16, "v4")
    host.apply(TierTransfers(to_host={"a": {3: 5}}))
    if layout == "page_first":
        (h,) = host.host["a"]
        assert h.dtype == torch.uint8 and h.shape == (HOST_PAGES, host.bytes_per_page["a"]) and h.is_contiguous()
        assert torch.equal(h[3], device_page_bits(caches, spp["a"], "a", 5))
    else:
        for h, t in zip(host.host["a"], caches["a"]):
            assert h.dtype == t.dtype
            assert h.shape == t.shape[:-2] + (HOST_PAGES * spp["a"], t.shape[-1])
            assert torch.equal(bits(page(h, spp["a"], 3)), bits(page(t, spp["a"], 5)))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_to_host_runs_before_to_device(layout):
    """TierTransfers' ordering contract: a device page both saved and overwritten in one apply
    reaches the host with its old content, then takes the loaded page."""
    host, caches, spp = make_cache(layout, torch.float32, "v4")
    old = device_page_bits(caches, spp["a"], "a", 3)
    loaded = host_page_bits(host, "a", 6)
    # to_device of another space listed too: every space's to_host goes first.
    host.apply(TierTransfers(to_device={"b": {3: 1}, "a": {3: 6}}, to_host={"b": {0: 3}, "a": {2: 3}}))
    assert torch.equal(host_page_bits(host, "a", 2), old), "to_host read device page 3 before to_device wrote it"
    assert torch.equal(device_page_bits(caches, spp["a"], "a", 3), loaded), "device page 3 holds the loaded host page"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_byte_counts_cover_every_tensor_of_a_space(layout):
    host, caches, spp = make_cache(layout, torch.bfloat16, "v4")
    want = {n: sum(t.numel() // NUM_PAGES * t.element_size() for t in ts) for n, ts in caches.items()}
    assert host.bytes_per_page == want, "a host page holds one page of every tensor of the space"
    assert host.nbytes == HOST_PAGES * sum(want.values())
    moved = host.apply(TierTransfers(to_host={"a": {0: 1, 1: 2}, "b": {5: 5}}, to_device={"b": {2: 7, 4: 8}}))
    assert moved == (2 * want["a"] + want["b"], 2 * want["b"]), "(bytes to host, bytes to device)"
    assert host.apply(TierTransfers()) == (0, 0)


def test_invalid_pages_and_layouts_are_rejected_before_anything_moves():
    host, caches, spp = make_cache("page_first", torch.float32, "dense")
    dev0, host0 = snapshot(host, caches, spp)
    bad = [
        (TierTransfers(to_host={"a": {1: 2, HOST_PAGES: 3}}),
         rf"space 'a': host page {HOST_PAGES} outside \[0, {HOST_PAGES}\)"),
        (TierTransfers(to_host={"b": {-1: 2}}), r"space 'b': host page -1"),
        (TierTransfers(to_host={"a": {1: 0}}), r"space 'a': device page 0 .*null page"),
        (TierTransfers(to_device={"b": {1: 2, NUM_PAGES: 0}}),
         rf"space 'b': device page {NUM_PAGES} outside \[1, {NUM_PAGES}\)"),
        (TierTransfers(to_device={"a": {2: 1}, "c": {1: 1}}), r"space 'c' has no host pages"),
    ]
    for transfers, match in bad:
        with pytest.raises(ValueError, match=match):
            host.apply(transfers)
    dev1, host1 = snapshot(host, caches, spp)
    assert all(torch.equal(dev0[k], dev1[k]) for k in dev0) and all(torch.equal(host0[k], host1[k]) for k in host0), \
        "a rejected TierTransfers moves no page"
    with pytest.raises(ValueError, match="'page_first', 'layer_first'"):
        HostKVCache(caches, spp, {"a": 2}, layout="head_first")


def test_only_spaces_with_host_pages_get_a_buffer_and_pinning_is_safe_without_cuda():
    gen = torch.Generator().manual_seed(0)
    caches = {"a": dense_space(torch.float32, 4, gen), "b": dense_space(torch.float32, 2, gen)}
    host = HostKVCache(caches, {"a": 4, "b": 2}, {"a": 3}, pin_memory=True)
    assert list(host.host) == ["a"] and host.nbytes == 3 * host.bytes_per_page["a"]
    assert host.host["a"][0].is_pinned() == torch.cuda.is_available()
    host.apply(TierTransfers(to_host={"a": {2: 1}}))
    assert torch.equal(host.host["a"][0][2], device_page_bits(caches, 4, "a", 1))


@pytest.fixture(scope="module")
def v4_model():
    from tiny_deepseek_v4 import single_thread, v4_config

    from hybridkv.model_executor.models.deepseek_v4.model import DeepseekV4ForCausalLM

    with single_thread():
        return DeepseekV4ForCausalLM(v4_config(64), max_positions=512)


def test_v4_allocate_kv_cache_returns_every_tensor_of_each_space(v4_model):
    """Every physical tensor of a space is returned (the host tier must copy all of them): per
    slot their bytes add up to the space's bytes_per_slot, and each slot dim -2 spans the pool."""
    specs = v4_model.space_specs(torch.float32)
    kv = KVCacheManager(specs, {s.name: 3 for s in specs}, 128)
    caches = v4_model.allocate_kv_cache(kv.layout(), None, torch.float32, torch.device("cpu"))
    cfg = v4_model.cfg
    n_csa, n_hca = cfg.num_csa_layers, cfg.num_hca_layers
    counts = {"swa": 1, "c4": n_csa, "c128": n_hca, "indexer": n_csa, "state_c4": 4 * n_csa, "state_c128": 2 * n_hca}
    assert {n: len(ts) for n, ts in caches.items()} == counts
    for name, ts in caches.items():
        space = kv.spaces[name]
        slots = space.num_physical_pages * space.spec.slots_per_page(128)
        assert all(t.shape[-2] == slots for t in ts), f"{name}: slot dim -2 covers every page"
        per_slot = sum(t.numel() // slots * t.element_size() for t in ts)
        assert per_slot == space.spec.bytes_per_slot, f"{name}: the returned tensors are all of the space's bytes"
    # The layers' views and the returned tensors are the same storage, none missing or extra.
    returned = {t.untyped_storage().data_ptr() for ts in caches.values() for t in ts}
    bound = set()
    for layer in v4_model.layers:
        c = layer.attn.cache
        views = [c.swa] + [getattr(cc, f) for cc in (c.compressor, c.indexer) if cc is not None
                           for f in ("state_kv", "state_gate", "entries")]
        bound |= {t.untyped_storage().data_ptr() for t in views}
    assert bound == returned, "allocate_kv_cache returns exactly the tensors the layers write"

    # End to end on the real tensors: a page of every space survives a trip through the host.
    spp = {n: kv.spaces[n].spec.slots_per_page(128) for n in caches}
    gen = torch.Generator().manual_seed(0)
    for ts in caches.values():
        for t in ts:
            t.copy_(random_bits(tuple(t.shape), t.dtype, gen))
    host = HostKVCache(caches, spp, {n: 2 for n in caches})
    want = {n: device_page_bits(caches, spp[n], n, 1) for n in caches}
    host.apply(TierTransfers(to_host={n: {1: 1} for n in caches}))
    host.apply(TierTransfers(to_device={n: {3: 1} for n in caches}))
    for n in caches:
        assert torch.equal(device_page_bits(caches, spp[n], n, 3), want[n]), f"{n}: page 1 restored into page 3"


def test_dense_model_returns_its_one_tensor_per_space_in_a_list(tiny_ckpt):
    from hybridkv.entrypoints import LLM

    llm = LLM(tiny_ckpt("llama"), dtype="float32", max_model_len=64)
    kv, caches = llm.engine.kv, llm.engine.runner.kv_caches
    assert set(caches) == set(kv.spaces)
    for name, ts in caches.items():
        (cache,) = ts
        assert cache.shape[-2] == kv.spaces[name].num_physical_pages * kv.spaces[name].spec.slots_per_page(kv.page_size)

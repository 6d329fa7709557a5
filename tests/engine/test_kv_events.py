"""KV cache events published over ZeroMQ in vLLM's format (kv_events_config).

Invariants checked, by a subscriber that decodes with vLLM's own event types (msgspec structs,
as vLLM's kv_events_subscriber example declares them):
- every whole page a prompt leaves in the prefix cache is announced once by a BlockStored whose
  token ids are the page's tokens and whose parent hash chains the pages in prompt order;
- the same prompt gets the same block hashes on another engine (what a router indexes by);
- pages evicted from the device are announced by BlockRemoved, and with a host tier the demoted
  pages by BlockStored on medium "CPU"; a reset of the prefix cache ends with AllBlocksCleared;
- replaying the events gives exactly the index's pages per tier at every point observed;
- sequence numbers count up from 0 without a gap; a bad config is refused before the model loads.
"""
from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import torch
import zmq

from hybridkv.entrypoints import LLM, SamplingParams
from redis_server import free_loopback_port


# vLLM's wire types, as its subscriber example declares them.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class Subscriber:
    """A SUB socket on the engine's endpoint that keeps every batch (sequence number, events)."""

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.batches: list[tuple[int, list]] = []

    def drain(self, settle_s: float = 0.3) -> list:
        """Receive until the socket has been quiet for settle_s; returns the new events."""
        new = []
        while self.socket.poll(int(settle_s * 1000)):
            _topic, seq, payload = self.socket.recv_multipart()
            events = self.decoder.decode(payload).events
            self.batches.append((int.from_bytes(seq, "big"), events))
            new += events
        return new

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


def _events_llm(path: str, endpoint: str, **kw) -> LLM:
    return LLM(path, dtype="float32", max_model_len=256,
               kv_events_config={"enable_kv_cache_events": True, "endpoint": endpoint}, **kw)


def _subscribed(llm: LLM, endpoint: str) -> Subscriber:
    """A subscriber that gets the engine's next events: ZeroMQ drops what a PUB socket sends
    before the subscription has reached it, so wait for it (a reset publishes nothing here)."""
    sub = Subscriber(endpoint)
    time.sleep(0.5)
    return sub


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (n,), generator=g).tolist()


def _replay(events: list, held: dict[str | None, set[int]]) -> None:
    for e in events:
        if isinstance(e, BlockStored):
            assert not held.setdefault(e.medium, set()) & set(e.block_hashes), "a page was stored twice"
            held[e.medium] |= set(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            assert set(e.block_hashes) <= held.get(e.medium, set()), "a page was removed that was never stored"
            held[e.medium] -= set(e.block_hashes)
        else:
            for pages in held.values():
                pages.clear()


def _index_pages(llm: LLM) -> dict[str | None, set[int]]:
    """The index's pages per tier, as event hashes (the first whole space's shadows)."""
    from hybridkv.block_manager.kv_events import block_hash

    index = llm.engine.kv.index
    ref = index.whole[0]
    out: dict[str | None, set[int]] = {None: set(), "CPU": set()}
    for nd in index.nodes():
        if nd.shadows[ref] is not None:
            out[None].add(block_hash(nd.chain))
        if nd.host.get(ref) is not None:
            out["CPU"].add(block_hash(nd.chain))
    return out


def test_prompt_pages_are_announced_in_vllm_format_and_hash_alike_across_engines(tiny_ckpt):
    path = tiny_ckpt("llama")
    endpoint = f"tcp://127.0.0.1:{free_loopback_port()}"
    llm = _events_llm(path, endpoint)
    sub = _subscribed(llm, endpoint)
    try:
        prompt = _prompt(70, seed=1)  # 4 whole pages of 16
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        events = sub.drain()
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert [e.token_ids for e in stored[:4]] == [prompt[i * 16:(i + 1) * 16] for i in range(4)]
        assert all(e.block_size == 16 and e.medium is None and e.lora_id is None for e in stored)
        hashes = [e.block_hashes[0] for e in stored[:4]]
        assert len(set(hashes)) == 4
        assert [e.parent_block_hash for e in stored[:4]] == [None] + hashes[:3], "parents must chain the pages"
        held: dict = {}
        _replay(events, held)
        assert held == {k: v for k, v in _index_pages(llm).items() if v}, "the events disagree with the index"
        assert [s for s, _ in sub.batches] == list(range(len(sub.batches))), "sequence numbers must count up from 0"
    finally:
        sub.close()
        llm.engine.shutdown()

    other_endpoint = f"tcp://127.0.0.1:{free_loopback_port()}"
    other = _events_llm(path, other_endpoint)
    sub = _subscribed(other, other_endpoint)
    try:
        other.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        again = [e.block_hashes[0] for e in sub.drain() if isinstance(e, BlockStored)][:4]
        assert again == hashes, "the same prefix must get the same hashes on every replica"
    finally:
        sub.close()
        other.engine.shutdown()


def test_eviction_demotion_and_reset_are_announced(tiny_ckpt):
    path = tiny_ckpt("llama")
    endpoint = f"tcp://127.0.0.1:{free_loopback_port()}"
    page_bytes = LLM(path, dtype="float32", max_model_len=256).engine.kv.specs["full"].bytes_per_page(16)
    llm = _events_llm(path, endpoint, kv_cache_memory_bytes=24 * page_bytes, enable_hierarchical_cache=True,
                      hicache_ratio=4.0, hicache_write_policy="write_back")
    sub = _subscribed(llm, endpoint)
    held: dict = {}
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        for i in range(6):  # 6 x 5 pages through a 24-page device pool: older prefixes go to the host
            llm.generate({"prompt_token_ids": _prompt(90, seed=10 + i)}, params, use_tqdm=False)
            _replay(sub.drain(), held)
            assert {k: v for k, v in held.items() if v} == {k: v for k, v in _index_pages(llm).items() if v}
        events = [e for _, batch in sub.batches for e in batch]
        assert any(isinstance(e, BlockRemoved) and e.medium is None for e in events), "no device removal announced"
        assert any(isinstance(e, BlockStored) and e.medium == "CPU" for e in events), "no host copy announced"
        llm.engine.reset_prefix_cache()
        last = sub.drain()
        assert isinstance(last[-1], AllBlocksCleared)
        _replay(last, held)
        assert not any(held.values())
    finally:
        sub.close()
        llm.engine.shutdown()


@pytest.mark.parametrize("config,match", [
    ({"enable_kv_cache_events": True, "publisher": "kafka"}, "publisher must be"),
    ({"enable_kv_cache_events": True, "endpoit": "tcp://127.0.0.1:1"}, "unknown kv_events_config field"),
    ('{"enable_kv_cache_events": tru', "not valid JSON"),
])
def test_a_bad_config_is_refused_before_the_model_loads(config, match):
    from hybridkv.engine.config import EngineConfig

    with pytest.raises(ValueError, match=match):
        EngineConfig(model="/nonexistent", kv_events_config=config)


def test_events_need_prefix_caching():
    from hybridkv.engine.config import EngineConfig

    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(model="/nonexistent", enable_prefix_caching=False,
                     kv_events_config={"enable_kv_cache_events": True})

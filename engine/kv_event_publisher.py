"""Publishing KV cache events over ZeroMQ, in vLLM's wire format.

`kv_events_config` (vLLM's `--kv-events-config`) turns it on. After every step the engine
drains the events the KV manager recorded (block_manager/kv_events.py) and hands them here as
one batch; a background thread encodes and sends it on a ZMQ PUB socket, so the engine never
waits on the network. Each message has vLLM's three frames: the topic, an 8-byte big-endian
sequence number, and the msgpack payload of an event batch: `[timestamp, [event, ...]]`, every
event an array that starts with its type's name (`["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium]`, `["BlockRemoved", block_hashes,
medium]`, `["AllBlocksCleared"]`): what msgspec's array-like tagged structs, which vLLM's
subscribers decode, look like on the wire. A subscriber that falls behind the socket's high
water mark loses batches (a gap in the sequence numbers says so); there is no replay socket.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, fields
from typing import Any

import msgspec

from hybridkv.block_manager.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from hybridkv.engine.json_config import json_object

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig fields that apply here (others are refused by name)."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"  # "zmq", or "null": recorded and dropped (what vLLM calls it)
    # Bound by the engine (a "*" host listens on every interface: say so explicitly).
    endpoint: str = "tcp://127.0.0.1:5557"
    topic: str = ""
    hwm: int = 100_000  # batches queued per subscriber before ZeroMQ drops them

    @classmethod
    def parse(cls, value: "KVEventsConfig | dict | str | None") -> "KVEventsConfig | None":
        """A config from a dict or JSON text (the CLI's); None when events are off."""
        if value is None or isinstance(value, KVEventsConfig):
            return value if value is None or value.enable_kv_cache_events else None
        value = json_object(value, "kv_events_config")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known - {"replay_endpoint", "buffer_steps", "max_queue_size"})
        if unknown:
            raise ValueError(f"unknown kv_events_config field(s) {unknown}; known: {sorted(known)}")
        if value.get("replay_endpoint"):
            raise ValueError("kv_events_config replay_endpoint is not supported: subscribers see gaps in the "
                             "sequence numbers instead")
        config = cls(**{k: v for k, v in value.items() if k in known})
        if config.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config publisher must be 'zmq' or 'null', got {config.publisher!r}")
        if not isinstance(config.hwm, int) or config.hwm < 1:
            raise ValueError(f"kv_events_config hwm must be an integer >= 1, got {config.hwm!r}")
        return config if config.enable_kv_cache_events else None


# The wire types: msgspec structs in vLLM's encoding (array-like; events tagged by class name).
class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _BlockStored(_Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class _BlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class _AllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


class _EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


def to_wire(event: KVCacheEvent) -> _Event:
    if isinstance(event, BlockStored):
        return _BlockStored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                            event.lora_id, event.medium)
    if isinstance(event, BlockRemoved):
        return _BlockRemoved(event.block_hashes, event.medium)
    if isinstance(event, AllBlocksCleared):
        return _AllBlocksCleared()
    raise TypeError(f"not a KV cache event: {event!r}")


def encode_batch(ts: float, events: list[KVCacheEvent]) -> bytes:
    return msgspec.msgpack.encode(_EventBatch(ts, [to_wire(e) for e in events]))


class KVEventPublisher:
    """A PUB socket bound to the config's endpoint, fed by a thread (ZMQ sockets are not
    thread-safe: only that thread touches it)."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self.published_batches = 0
        self._queue: queue.Queue[tuple[float, list[KVCacheEvent]] | None] = queue.Queue()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="hybridkv-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait(timeout=30)
        if self._error is not None:
            raise ValueError(f"cannot publish KV cache events on {config.endpoint}: {self._error}") from self._error
        logger.info("KV cache events: publishing on %s (topic %r)", config.endpoint, config.topic)

    def publish(self, events: list[KVCacheEvent]) -> None:
        if events:
            self._queue.put((time.time(), events))

    def close(self) -> None:
        """Send what is queued, then close the socket."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=10)

    def _run(self) -> None:
        import zmq

        context = zmq.Context()
        socket = context.socket(zmq.PUB)
        try:
            socket.setsockopt(zmq.SNDHWM, self.config.hwm)
            socket.bind(self.config.endpoint)
        except zmq.ZMQError as e:
            self._error = e
            socket.close(linger=0)
            context.term()
            self._ready.set()
            return
        self._ready.set()
        topic = self.config.topic.encode()
        seq = 0
        try:
            while (item := self._queue.get()) is not None:
                ts, events = item
                socket.send_multipart([topic, seq.to_bytes(8, "big"), encode_batch(ts, events)])
                seq += 1
                self.published_batches = seq
        finally:
            socket.close(linger=1000)
            context.term()


class NullPublisher:
    """publisher "null": events are recorded and dropped (vLLM's NullEventPublisher)."""

    published_batches = 0

    def publish(self, events: list[KVCacheEvent]) -> None:
        pass

    def close(self) -> None:
        pass


def make_publisher(config: KVEventsConfig | None) -> KVEventPublisher | NullPublisher | None:
    if config is None:
        return None
    return KVEventPublisher(config) if config.publisher == "zmq" else NullPublisher()

"""StorageBackend: the storage tier (HiCache's L3) behind batched exists / get / put.

The storage tier is a cache: a page it cannot read is recomputed, a write it cannot make is
dropped. So a backend never raises on I/O trouble -- a full disk, a dead or hung Redis, a file
deleted under it -- because an exception out of a background prefetch or write thread would
either crash serving or (worse, SGLang #9927) leak the caller's reservations. Trouble becomes a
miss or a dropped write, is counted in `stats.errors`, and is logged as a rate-limited warning (a
dead server must not print one line per key). What still raises is misuse by the caller: a
malformed key, or `put` with different numbers of keys and values -- those are bugs.

Keys start with two lowercase hex chars and continue in [0-9A-Za-z_.-] (page_keys.storage_key:
the hex SHA-256 chain over page tokens, then "-<space>"); they are file names and Redis keys as
they are, so nothing else -- no "/", no leading "." -- may appear. Values are opaque bytes
(framed and checksummed by page_record.py, so a backend need not trust itself).

`make_backend(name, extra_config)` chooses a backend by name the way SGLang's
`--hicache-storage-backend` / `--hicache-storage-backend-extra-config` do.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("file", "redis")

# 2..200 chars, the first two lowercase hex: the file backend shards by them and names files by
# the key (200 leaves room for the temp-file decoration under the usual 255-byte name limit).
KEY_PATTERN = re.compile(r"[0-9a-f]{2}[0-9A-Za-z_.-]{0,198}")

Buffer = bytes | bytearray | memoryview


@dataclass
class StorageStats:
    """Counters of one backend instance (read them with `StorageBackend.stats_snapshot()`).

    `errors` counts operations that failed for I/O trouble: one per key of a get or put that
    failed, one per exists call that could not answer. A failed get key is also a miss, a failed
    put key also a dropped write, so hits + misses == keys asked by get. A lookup is a key an
    exists call asked about: found (exists_keys_found) or missing (exists_keys_missing: absent,
    evicted, after the chain's first hole, or the store did not answer) -- the misses a reader
    sees before it ever calls get.
    """

    exists_calls: int = 0
    get_calls: int = 0
    put_calls: int = 0
    exists_keys_found: int = 0  # sum of what exists() returned
    exists_keys_missing: int = 0  # keys asked by exists() and not found
    hits: int = 0  # get keys that returned a value
    misses: int = 0  # get keys that returned None: absent, evicted, or unreadable
    keys_written: int = 0  # put keys stored
    writes_dropped: int = 0  # put keys not stored (error, too large, backend down)
    errors: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    exists_seconds: float = 0.0
    get_seconds: float = 0.0
    put_seconds: float = 0.0
    evictions: int = 0  # values the backend itself deleted for room (file backend's LRU)
    skipped_calls: int = 0  # calls answered without I/O because the backend is known down


@dataclass
class RateLimitedWarnings:
    """Logs the first warning of each kind, then at most one per `interval_s` with a count of
    the ones it held back -- a dead server must produce a few lines, not one per key."""

    log: logging.Logger
    interval_s: float = 30.0
    _last_logged: dict[str, float] = field(default_factory=dict)
    _held_back: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def warn(self, kind: str, message: str) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last_logged.get(kind)
            if last is not None and now - last < self.interval_s:
                self._held_back[kind] = self._held_back.get(kind, 0) + 1
                return
            held_back = self._held_back.pop(kind, 0)
            self._last_logged[kind] = now
        suffix = f" ({held_back} similar warnings held back in the last {self.interval_s:g} s)" if held_back else ""
        self.log.warning("%s%s", message, suffix)


ConfigT = TypeVar("ConfigT")


def parse_extra_config(extra_config: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """The backend settings as a dict: a JSON object string (as given on the command line), a
    mapping, or None / "" for none."""
    if extra_config is None:
        return {}
    if isinstance(extra_config, str):
        if not extra_config.strip():
            return {}
        try:
            parsed = json.loads(extra_config)
        except json.JSONDecodeError as exc:
            raise ValueError(f"hicache storage backend extra config is not valid JSON ({exc}): {extra_config!r}") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"hicache storage backend extra config must be a JSON object, got {extra_config!r}")
        return parsed
    if isinstance(extra_config, Mapping):
        return dict(extra_config)
    raise ValueError(f"hicache storage backend extra config must be a JSON string or a dict, got {type(extra_config).__name__}")


def config_from_mapping(config_cls: type[ConfigT], settings: Mapping[str, Any], backend_name: str) -> ConfigT:
    """Builds a backend's config dataclass from settings, naming the valid keys when a key is
    unknown (a typo must not silently fall back to a default) or a required one is missing."""
    fields = [f for f in dataclasses.fields(config_cls) if f.init]  # type: ignore[arg-type]
    valid = [f.name for f in fields]
    unknown = sorted(set(settings) - set(valid))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in the extra config of storage backend {backend_name!r}; valid keys: {valid}")
    required = [
        f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    missing = [k for k in required if k not in settings]
    if missing:
        raise ValueError(f"storage backend {backend_name!r} needs key(s) {missing} in its extra config; valid keys: {valid}")
    return config_cls(**settings)


def require_number(backend_name: str, key: str, value: Any, minimum: float = 0.0, integer: bool = False) -> None:
    """Config validation shared by the backends (bool is not a number here: `true` for a
    timeout is a mistake, not 1 second)."""
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or value < minimum:
        what = "an integer" if integer else "a number"
        raise ValueError(f"storage backend {backend_name!r}: {key} must be {what} >= {minimum:g}, got {value!r}")


class StorageBackend(ABC):
    """Batched exists / get / put over one store; thread-safe (the integration calls it from a
    prefetch thread and a write thread at once).

    Subclasses implement `_exists`, `_get` and `_put` and report per-key I/O trouble with
    `_record_error`; this class does argument checks, timing and counting, and turns anything a
    subclass still raises into misses / dropped writes, so no I/O error reaches the caller.
    """

    name: ClassVar[str] = "abstract"

    def __init__(self, warning_interval_s: float = 30.0) -> None:
        self.stats = StorageStats()
        self._stats_lock = threading.Lock()
        self._warnings = RateLimitedWarnings(logger, warning_interval_s)
        self._closed = False

    # -- public API ------------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> int:
        """How many LEADING keys are present: the length of the stored prefix of a hash chain
        (a hole means later pages are useless to a prefix match, so checking stops there)."""
        keys = self._checked_keys(keys)
        if not keys or self._closed:
            return 0
        started = time.perf_counter()
        try:
            found = self._exists(keys)
        except Exception as exc:  # the never-raise boundary (see the module docstring)
            self._record_error("exists", f"exists failed: {exc!r}")
            found = 0
        found = max(0, min(int(found), len(keys)))
        with self._stats_lock:
            self.stats.exists_calls += 1
            self.stats.exists_keys_found += found
            self.stats.exists_keys_missing += len(keys) - found
            self.stats.exists_seconds += time.perf_counter() - started
        return found

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """The stored value of each key, None for a miss (absent, evicted or unreadable)."""
        keys = self._checked_keys(keys)
        if not keys or self._closed:
            return [None] * len(keys)
        started = time.perf_counter()
        try:
            values = list(self._get(keys))
            if len(values) != len(keys):
                raise RuntimeError(f"backend returned {len(values)} values for {len(keys)} keys")
        except Exception as exc:
            self._record_error("get", f"get failed: {exc!r}", count=len(keys))
            values = [None] * len(keys)
        hits = sum(v is not None for v in values)
        read = sum(len(v) for v in values if v is not None)
        with self._stats_lock:
            self.stats.get_calls += 1
            self.stats.hits += hits
            self.stats.misses += len(keys) - hits
            self.stats.bytes_read += read
            self.stats.get_seconds += time.perf_counter() - started
        return values

    def put(self, keys: Sequence[str], values: Sequence[Buffer]) -> int:
        """Stores each value under its key (overwriting); returns how many were stored. A value
        not stored is dropped, never retried: the page is still in the host tier."""
        keys = self._checked_keys(keys)
        if len(values) != len(keys):
            raise ValueError(f"put got {len(keys)} keys and {len(values)} values")
        if not keys or self._closed:
            return 0
        views = [memoryview(v) for v in values]
        started = time.perf_counter()
        try:
            stored = list(self._put(keys, views))
            if len(stored) != len(keys):
                raise RuntimeError(f"backend returned {len(stored)} outcomes for {len(keys)} keys")
        except Exception as exc:
            self._record_error("put", f"put failed: {exc!r}", count=len(keys))
            stored = [False] * len(keys)
        n_stored = sum(bool(s) for s in stored)
        written = sum(v.nbytes for v, s in zip(views, stored) if s)
        with self._stats_lock:
            self.stats.put_calls += 1
            self.stats.keys_written += n_stored
            self.stats.writes_dropped += len(keys) - n_stored
            self.stats.bytes_written += written
            self.stats.put_seconds += time.perf_counter() - started
        return n_stored

    def close(self) -> None:
        """Releases connections / handles; later calls answer misses and store nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self._close()
        except Exception as exc:
            self._record_error("close", f"close failed: {exc!r}")

    def stats_snapshot(self) -> StorageStats:
        """A consistent copy of the counters (the live ones move under other threads)."""
        with self._stats_lock:
            return dataclasses.replace(self.stats)

    def __enter__(self) -> StorageBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- for subclasses ----------------------------------------------------------------------

    @abstractmethod
    def _exists(self, keys: list[str]) -> int: ...

    @abstractmethod
    def _get(self, keys: list[str]) -> list[bytes | None]: ...

    @abstractmethod
    def _put(self, keys: list[str], values: list[memoryview]) -> list[bool]: ...

    def _close(self) -> None:
        pass

    def _record_error(self, kind: str, message: str, count: int = 1) -> None:
        """Counts `count` failed operations and logs a rate-limited warning of this kind."""
        with self._stats_lock:
            self.stats.errors += count
        self._warnings.warn(kind, f"hicache storage ({self.name}): {message}")

    def _count(self, stat: str, amount: int = 1) -> None:
        with self._stats_lock:
            setattr(self.stats, stat, getattr(self.stats, stat) + amount)

    def _checked_keys(self, keys: Sequence[str]) -> list[str]:
        keys = list(keys)
        for key in keys:
            if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
                raise ValueError(
                    f"storage keys are 2-200 chars of [0-9A-Za-z_.-] starting with two lowercase hex chars, got {key!r}"
                )
        return keys


def make_backend(
    name: str,
    extra_config: str | Mapping[str, Any] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> StorageBackend:
    """The backend called `name` ("file" or "redis") with its extra config (JSON string or dict).

    `defaults` are settings the caller fills in from its own options (e.g. {"dir":
    hicache_storage_dir}); the extra config overrides them, and defaults a backend has no key
    for are ignored, so a caller can pass the same defaults whichever backend is chosen.
    """
    settings = parse_extra_config(extra_config)
    if name == "file":
        from hybridkv.block_manager.storage.file_backend import FileBackendConfig, FileStorageBackend

        config_cls: type = FileBackendConfig
        backend_cls: type = FileStorageBackend
    elif name == "redis":
        try:
            from hybridkv.block_manager.storage.redis_backend import RedisBackendConfig, RedisStorageBackend
        except ImportError as exc:
            raise ImportError(
                f"the redis storage backend needs the redis client ({exc}); install it with pip install 'redis' 'hiredis'"
            ) from exc
        config_cls = RedisBackendConfig
        backend_cls = RedisStorageBackend
    else:
        raise ValueError(f"unknown hicache storage backend {name!r}; choose one of {list(BACKEND_NAMES)}")
    known = {f.name for f in dataclasses.fields(config_cls)}
    merged = {k: v for k, v in (defaults or {}).items() if k in known and v is not None}
    merged.update(settings)
    return backend_cls(config_from_mapping(config_cls, merged, name))

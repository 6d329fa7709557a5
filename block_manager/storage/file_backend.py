"""FileStorageBackend: the default storage tier, one file per page in a local directory.

Layout: <dir>/<key[:2]>/<key>. Sharding by the first two hex chars keeps directories at 1/256
of the pages (a flat directory of millions of files makes every lookup and listing slow).

Why each mechanism:
- Atomic writes (a temp file in the same shard directory, then os.replace): a reader -- this
  process or another one on the same directory -- sees either no file or a whole one, never a
  half-written page. No fsync: after a power loss a page may be empty or garbage, and
  page_record's checksum turns that into a miss; paying a disk flush per page for a cache that
  can recompute would cost more than it saves.
- A capacity limit with LRU eviction (SGLang #26670: a file backend that never evicts fills the
  disk). Sizes and recency live in memory; at startup they are rebuilt from the directory,
  oldest mtime first, and reads bump a file's mtime (os.utime) so recency survives restarts.
  Total bytes stay <= capacity after every put.
- Restarts and neighbours: a new instance on the same directory indexes the files already
  there. Another live process on the same directory is tolerated: exists/get look at the disk,
  not only the index, and a file read that the index did not know is adopted. Each process
  enforces the capacity on its own view, so two writers may briefly exceed it together.
- exists() is one os.path.exists per key, stopping at the first miss: a prefix match asks it
  for long chains on the scheduler's path.
"""
from __future__ import annotations

import os
import secrets
import shutil
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from hybridkv.block_manager.storage.backend import KEY_PATTERN, StorageBackend, require_number

TEMP_PREFIX = ".tmp."
# Temp files older than this at startup belong to a writer that died mid-write; younger ones may
# be another live process's write in flight, so they are left alone.
STALE_TEMP_AGE_S = 600.0
# With no capacity_bytes: at most this, and at most half of what the disk has left for us
# (free space plus what our files already take), so an unconfigured cache never fills the disk.
DEFAULT_MAX_CAPACITY_BYTES = 64 << 30


@dataclass(frozen=True)
class FileBackendConfig:
    """extra_config of the file backend: {"dir": path, "capacity_bytes": N}."""

    dir: str
    capacity_bytes: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.dir, (str, os.PathLike)) or not str(self.dir):
            raise ValueError(f"storage backend 'file': dir must be a non-empty path, got {self.dir!r}")
        if self.capacity_bytes is not None:
            require_number("file", "capacity_bytes", self.capacity_bytes, minimum=1, integer=True)


class FileStorageBackend(StorageBackend):
    name = "file"

    def __init__(self, config: FileBackendConfig) -> None:
        super().__init__()
        self.config = config
        self.root = os.path.abspath(os.fspath(config.dir))
        self._lock = threading.Lock()  # guards _index, _total_bytes, and replace/remove of files
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> size, least recent first
        self._total_bytes = 0
        self._known_shards: set[str] = set()
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            # Not fatal: every get misses and every put is dropped and counted, and serving goes on.
            self._record_error("init", f"cannot create storage dir {self.root}: {exc!r}")
        self._rebuild_index()
        self.capacity_bytes = config.capacity_bytes or self._default_capacity()
        with self._lock:
            self._evict_to(self.capacity_bytes)

    # -- introspection (tests, metrics) -----------------------------------------------------

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return self._total_bytes

    @property
    def num_files(self) -> int:
        with self._lock:
            return len(self._index)

    def path_of(self, key: str) -> str:
        return os.path.join(self.root, key[:2], key)

    # -- StorageBackend ----------------------------------------------------------------------

    def _exists(self, keys: list[str]) -> int:
        found = 0
        for key in keys:
            if not os.path.exists(self.path_of(key)):
                break
            found += 1
        return found

    def _get(self, keys: list[str]) -> list[bytes | None]:
        return [self._read_one(key) for key in keys]

    def _put(self, keys: list[str], values: list[memoryview]) -> list[bool]:
        return [self._write_one(key, value) for key, value in zip(keys, values)]

    # -- one file ----------------------------------------------------------------------------

    def _read_one(self, key: str) -> bytes | None:
        path = self.path_of(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            with self._lock:  # evicted by another process, or deleted by hand
                self._forget(key)
            return None
        except OSError as exc:
            self._record_error("read", f"cannot read {path}: {exc!r}")
            return None
        with self._lock:
            if key in self._index:
                self._total_bytes += len(data) - self._index[key]
                self._index[key] = len(data)
                self._index.move_to_end(key)
            else:  # written by another process on the same directory: adopt it
                self._index[key] = len(data)
                self._total_bytes += len(data)
                self._evict_to(self.capacity_bytes, keep=key)
        try:
            os.utime(path)  # recency that a restart can rebuild from
        except OSError:
            pass  # evicted in between: the bytes read are still whole
        return data

    def _write_one(self, key: str, value: memoryview) -> bool:
        size = value.nbytes
        if size > self.capacity_bytes:
            self._warnings.warn(
                "too_large",
                f"hicache storage (file): a {size}-byte value exceeds capacity_bytes={self.capacity_bytes}; not stored",
            )
            return False
        shard = os.path.join(self.root, key[:2])
        temp_path = os.path.join(shard, f"{TEMP_PREFIX}{key}.{os.getpid()}.{secrets.token_hex(4)}")
        try:
            if shard not in self._known_shards:
                os.makedirs(shard, exist_ok=True)
                self._known_shards.add(shard)
            with open(temp_path, "wb") as f:
                f.write(value)
            with self._lock:  # rename and bookkeeping together: the index never lags the disk
                os.replace(temp_path, self.path_of(key))
                self._forget(key)
                self._index[key] = size
                self._total_bytes += size
                self._evict_to(self.capacity_bytes, keep=key)
            return True
        except OSError as exc:
            self._known_shards.discard(shard)  # it may have been removed under us
            self._record_error("write", f"cannot write {self.path_of(key)}: {exc!r}")
            try:
                os.remove(temp_path)
            except OSError:
                pass
            return False

    # -- index -------------------------------------------------------------------------------

    def _forget(self, key: str) -> None:
        """Drops key from the index (caller holds the lock)."""
        size = self._index.pop(key, None)
        if size is not None:
            self._total_bytes -= size

    def _evict_to(self, capacity: int, keep: str | None = None) -> None:
        """Deletes least recently used files until the total fits (caller holds the lock)."""
        while self._total_bytes > capacity and self._index:
            key, size = next(iter(self._index.items()))
            if key == keep:
                if len(self._index) == 1:
                    break
                self._index.move_to_end(key)
                continue
            del self._index[key]
            self._total_bytes -= size
            self._count("evictions")  # lock order: self._lock, then the stats lock
            try:
                os.remove(self.path_of(key))
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._record_error("evict", f"cannot delete {self.path_of(key)}: {exc!r}")

    def _rebuild_index(self) -> None:
        """Indexes the files already in the directory, least recently used (oldest mtime) first."""
        found: list[tuple[float, str, int]] = []
        now = time.time()
        try:
            shards = [e for e in os.scandir(self.root) if e.is_dir() and KEY_PATTERN.fullmatch(e.name) and len(e.name) == 2]
        except OSError as exc:
            self._record_error("scan", f"cannot list storage dir {self.root}: {exc!r}")
            return
        for shard in shards:
            self._known_shards.add(shard.path)
            try:
                entries = list(os.scandir(shard.path))
            except OSError as exc:
                self._record_error("scan", f"cannot list {shard.path}: {exc!r}")
                continue
            for entry in entries:
                try:
                    st = entry.stat()
                except OSError:
                    continue
                if entry.name.startswith(TEMP_PREFIX):
                    if now - st.st_mtime > STALE_TEMP_AGE_S:
                        try:
                            os.remove(entry.path)
                        except OSError:
                            pass
                    continue
                if entry.is_file() and KEY_PATTERN.fullmatch(entry.name) and entry.name[:2] == shard.name:
                    found.append((st.st_mtime, entry.name, st.st_size))
        found.sort()
        with self._lock:
            for _, key, size in found:
                self._index[key] = size
                self._total_bytes += size

    def _default_capacity(self) -> int:
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            return DEFAULT_MAX_CAPACITY_BYTES
        return max(1, min(DEFAULT_MAX_CAPACITY_BYTES, (free + self._total_bytes) // 2))

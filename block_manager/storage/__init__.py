"""The storage tier of HiCache (L3): pages kept in a local directory or a Redis server, so that
prefixes outlive a process and are shared between server instances.

backend.py       StorageBackend (batched exists / get / put, never raises on I/O), StorageStats,
                 make_backend(name, extra_config)
page_record.py   the framing of a stored page: header (fingerprint, space, shape) + checksum
file_backend.py  "file", the default: one file per page, atomic writes, LRU under a capacity
redis_backend.py "redis": a Redis server (imported only when chosen: the client is optional)
"""
from hybridkv.block_manager.storage.backend import (
    BACKEND_NAMES,
    StorageBackend,
    StorageStats,
    make_backend,
    parse_extra_config,
)

__all__ = ["BACKEND_NAMES", "StorageBackend", "StorageStats", "make_backend", "parse_extra_config"]

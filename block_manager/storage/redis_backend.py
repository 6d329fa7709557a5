"""RedisStorageBackend: the storage tier on a Redis server, shared by a fleet of instances.

One Redis string per page under key_prefix + key; values are binary (no decode_responses).
Batches go out as one round trip: MGET for get, a non-transactional pipeline of EXISTS / SET for
exists and put (a transaction would buy nothing: pages are independent and idempotent).

Failure model -- Redis down, restarted, hung, or evicting under maxmemory must never crash, hang
or change an output:
- Every socket operation has a timeout (socket_timeout, connect_timeout), so one call takes at
  most about connect_timeout + socket_timeout even against a server that accepts and never
  answers (a stopped process, a blackholed host).
- A lost connection is retried once at once (a connection that a server restart closed is
  only found stale when used; the reconnect is cheap, or refused at once). A timeout is never
  retried: that would multiply the bound.
- Any redis error becomes misses / dropped writes, counted in stats.errors. An unreachable
  server is logged once when it goes down and once when it answers again (an operator sees the
  outage's start and end, not a line per call); other errors are rate-limited warnings. After a
  connection error or a timeout the backend answers without I/O for
  down_backoff_s (counted in stats.skipped_calls), so a hung server costs one timeout per
  interval rather than one per call of the prefetch and write threads; the first call after
  that interval reconnects.
- A page evicted by maxmemory is simply absent: a miss, not an error. A SET refused for memory
  (maxmemory-policy noeviction) is a dropped write and an error.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from hybridkv.block_manager.storage.backend import StorageBackend, require_number

ResultT = TypeVar("ResultT")
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RedisBackendConfig:
    """extra_config of the redis backend."""

    url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "hybridkv:"
    socket_timeout: float = 2.0  # seconds per read / write on an open connection
    connect_timeout: float = 2.0  # seconds to open a connection
    down_backoff_s: float = 1.0  # after a connection error / timeout, skip the server this long

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"storage backend 'redis': url must be redis://, rediss:// or unix://, got {self.url!r}")
        if not isinstance(self.key_prefix, str):
            raise ValueError(f"storage backend 'redis': key_prefix must be a string, got {self.key_prefix!r}")
        require_number("redis", "socket_timeout", self.socket_timeout, minimum=0.001)
        require_number("redis", "connect_timeout", self.connect_timeout, minimum=0.001)
        require_number("redis", "down_backoff_s", self.down_backoff_s, minimum=0.0)


class RedisStorageBackend(StorageBackend):
    name = "redis"

    def __init__(self, config: RedisBackendConfig) -> None:
        super().__init__()
        self.config = config
        self._prefix = config.key_prefix.encode("utf-8")
        pool = redis.ConnectionPool.from_url(
            config.url,
            socket_timeout=config.socket_timeout,
            socket_connect_timeout=config.connect_timeout,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
            health_check_interval=0,
            client_name="hybridkv",
        )
        # Query-string options of the URL win over keyword arguments in redis-py; the values
        # must stay bytes whatever the URL says.
        pool.connection_kwargs["decode_responses"] = False
        self._client = redis.Redis(connection_pool=pool)
        self._down_until = 0.0  # time.monotonic() before which calls skip the server
        self._reachable = True  # the last round trip's outcome: a change is logged once
        # An early warning when the server is not there; serving starts anyway (all misses).
        self._call("connect", 0, self._client.ping, None)

    def _key(self, key: str) -> bytes:
        return self._prefix + key.encode("ascii")

    def _exists(self, keys: list[str]) -> int:
        def leading_present() -> int:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._key(key))
            found = 0
            for reply in pipe.execute(raise_on_error=False):
                if isinstance(reply, Exception):
                    self._record_error("exists", f"EXISTS failed: {type(reply).__name__}: {reply}")
                    break
                if not reply:
                    break
                found += 1
            return found

        return self._call("exists", 1, leading_present, 0)

    def _get(self, keys: list[str]) -> list[bytes | None]:
        def read() -> list[bytes | None]:
            return [v if isinstance(v, bytes) else None for v in self._client.mget([self._key(k) for k in keys])]

        return self._call("get", len(keys), read, [None] * len(keys))

    def _put(self, keys: list[str], values: list[memoryview]) -> list[bool]:
        def write() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for key, value in zip(keys, values):
                pipe.set(self._key(key), value)
            stored = []
            for reply in pipe.execute(raise_on_error=False):
                if isinstance(reply, Exception):  # e.g. OOM under maxmemory-policy noeviction
                    self._record_error("set", f"SET refused: {type(reply).__name__}: {reply}")
                    stored.append(False)
                else:
                    stored.append(bool(reply))
            return stored

        return self._call("put", len(keys), write, [False] * len(keys))

    def _close(self) -> None:
        self._client.close()
        self._client.connection_pool.disconnect()

    def _call(self, op: str, keys_affected: int, action: Callable[[], ResultT], fallback: ResultT) -> ResultT:
        """Runs one round trip, or answers `fallback` without I/O while the server is known
        down; a redis error becomes `fallback` plus a counted error and a warning."""
        if time.monotonic() < self._down_until:
            self._count("skipped_calls")
            return fallback
        try:
            result = action()
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            self._down_until = time.monotonic() + self.config.down_backoff_s
            with self._stats_lock:
                self.stats.errors += max(1, keys_affected)
            if self._reachable:  # logged once per outage (the errors count every failed call)
                self._reachable = False
                logger.warning("hicache storage (redis): %s is down (%s during %s: %s); reads miss and writes are "
                               "dropped until it answers", self._safe_url(), type(exc).__name__, op, exc)
        except redis.RedisError as exc:
            self._record_error(op, f"redis {op} failed: {type(exc).__name__}: {exc}", count=max(1, keys_affected))
        else:
            if not self._reachable:
                self._reachable = True
                logger.warning("hicache storage (redis): %s answers again; reads and writes resume", self._safe_url())
            return result
        return fallback

    def _safe_url(self) -> str:
        """The URL without a password, for logs."""
        kwargs: dict[str, Any] = self._client.connection_pool.connection_kwargs
        if "path" in kwargs:
            return f"unix://{kwargs['path']}"
        return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}/{kwargs.get('db', 0)}"

"""The Redis backend against a real redis-server: round trips, and a server that dies, hangs,
comes back or evicts under maxmemory gives misses and dropped writes within the timeouts --
never an exception, a hang, or another page's bytes."""
from __future__ import annotations

import logging
import os
import time

from hybridkv.block_manager.storage import make_backend, page_record
from hybridkv.block_manager.storage.redis_backend import RedisStorageBackend

FP = "tiny-llama|fp32|page4|tp0of1"
SPACE = "full_attn"
SOCKET_TIMEOUT_S = 0.5
CONNECT_TIMEOUT_S = 0.5
# One call may take a connect plus a read timeout (see redis_backend's failure model), plus
# scheduling noise on a shared CI machine.
CALL_BOUND_S = SOCKET_TIMEOUT_S + CONNECT_TIMEOUT_S + 1.0


def key(i: int) -> str:
    """A key of page_keys.storage_key's form: the hex chain, then the space."""
    return f"{i:064x}-{SPACE}"


def redis_backend(url: str, **overrides) -> RedisStorageBackend:
    config = {
        "url": url, "key_prefix": "test:", "socket_timeout": SOCKET_TIMEOUT_S,
        "connect_timeout": CONNECT_TIMEOUT_S, **overrides,
    }
    backend = make_backend("redis", config)
    assert isinstance(backend, RedisStorageBackend)
    return backend


def timed(call):
    started = time.monotonic()
    result = call()
    return result, time.monotonic() - started


def test_round_trip_exists_counts_leading_keys(redis_server):
    backend = redis_backend(redis_server.url)
    values = [os.urandom(50_000 + i) for i in range(4)]
    assert backend.put([key(i) for i in range(4)], values) == 4, "put must report every value stored"
    assert backend.get([key(i) for i in range(4)]) == values, "get must return exactly the bytes put stored"
    assert backend.get([key(0), key(99), key(2)]) == [values[0], None, values[2]], "a missing key is None, the rest hit"
    assert backend.exists([key(i) for i in range(4)]) == 4, "exists counts all present keys"
    assert backend.exists([key(0), key(1), key(99), key(3)]) == 2, "exists stops at the first missing key"
    assert backend.exists([key(99)]) == 0, "a missing first key means no leading keys"
    stats = backend.stats_snapshot()
    assert (stats.put_calls, stats.get_calls, stats.exists_calls) == (1, 2, 3), "every call is counted"
    assert (stats.hits, stats.misses, stats.errors) == (6, 1, 0), "hits and misses are counted per key, no errors"
    assert stats.bytes_written == sum(map(len, values)), "bytes written are counted"

    other_prefix = redis_backend(redis_server.url, key_prefix="other:")
    assert other_prefix.exists([key(0)]) == 0, "keys are namespaced by key_prefix: another prefix sees nothing"
    backend.close()
    other_prefix.close()


def test_a_second_client_on_the_same_server_gets_hits(redis_server):
    """Two server instances sharing one Redis: what one stored, the other reads."""
    writer = redis_backend(redis_server.url)
    reader = redis_backend(redis_server.url)
    blob = page_record.encode(FP, SPACE, (1000,), os.urandom(1000))
    writer.put([key(5)], [blob])
    assert reader.exists([key(5)]) == 1 and reader.get([key(5)]) == [blob], "a page one client stored is a hit for another"


def test_a_corrupted_value_in_redis_decodes_to_a_miss(redis_server):
    backend = redis_backend(redis_server.url)
    payload = os.urandom(4096)
    blob = bytearray(page_record.encode(FP, SPACE, (4096,), payload))
    blob[2000] ^= 0x01
    backend.put([key(1)], [bytes(blob)])  # as if the store had corrupted it
    (stored,) = backend.get([key(1)])
    assert stored is not None and page_record.decode(stored, FP, SPACE) is None, "a corrupted Redis value must decode to a miss"


def test_killed_server_gives_bounded_misses_then_hits_after_restart(redis_server, caplog):
    backend = redis_backend(redis_server.url, down_backoff_s=0.0)
    backend.put([key(1)], [b"before"])
    redis_server.kill()
    caplog.set_level(logging.WARNING, logger="hybridkv.block_manager.storage")
    for call, expected, what in [
        (lambda: backend.exists([key(1)]), 0, "exists"),
        (lambda: backend.get([key(1), key(2)]), [None, None], "get"),
        (lambda: backend.put([key(3)], [b"lost"]), 0, "put"),
    ]:
        result, seconds = timed(call)
        assert result == expected, f"{what} against a killed server must be a miss / dropped write, got {result!r}"
        assert seconds < CALL_BOUND_S, f"{what} against a killed server took {seconds:.2f} s (bound {CALL_BOUND_S} s)"
    for _ in range(50):
        backend.get([key(1)])
    errors_while_down = backend.stats_snapshot().errors
    assert errors_while_down == 1 + 2 + 1 + 50, f"every failed key / call must be counted as an error, got {errors_while_down}"
    assert len(caplog.records) == 1, f"an outage must be logged once, not in {len(caplog.records)} lines"
    assert "is down" in caplog.records[0].getMessage()

    redis_server.start()  # same port, empty: no persistence
    assert backend.put([key(4)], [b"after"]) == 1, "after a restart the next put must reconnect and store"
    assert len(caplog.records) == 2 and "answers again" in caplog.records[1].getMessage(), (
        "the server coming back must be logged once")
    assert backend.get([key(4), key(1)]) == [b"after", None], "after a restart new puts hit; the lost data misses"
    missing = backend.stats_snapshot().exists_keys_missing
    assert backend.exists([key(4), key(1), key(5)]) == 1, "exists works again after the restart"
    assert backend.stats_snapshot().exists_keys_missing == missing + 2, (
        "keys a lookup did not find (the restart lost them) are counted as lookup misses")
    assert backend.stats_snapshot().errors == errors_while_down, "calls after the restart must not count errors"
    assert len(caplog.records) == 2, "nothing more is logged while the server answers"


def test_hung_server_calls_are_bounded_by_the_timeout(redis_server):
    backend = redis_backend(redis_server.url, down_backoff_s=0.0)
    backend.put([key(1)], [b"x" * 1000])
    redis_server.pause()  # accepts connections (the kernel does), never answers
    big = os.urandom(8 << 20)  # more than the socket buffers: the send itself must time out
    try:
        for call, expected, what in [
            (lambda: backend.get([key(1)]), [None], "get"),
            (lambda: backend.exists([key(1)]), 0, "exists"),
            (lambda: backend.put([key(2), key(3)], [big, big]), 0, "put of 16 MB"),
            (lambda: backend.get([key(1)]), [None], "get on a fresh connection"),
        ]:
            result, seconds = timed(call)
            assert result == expected, f"{what} against a hung server must be a miss / dropped write, got {result!r}"
            assert SOCKET_TIMEOUT_S * 0.8 <= seconds < CALL_BOUND_S, (
                f"{what} against a hung server must end at the timeout, took {seconds:.2f} s (bound {CALL_BOUND_S} s)"
            )
    finally:
        redis_server.resume()
    assert backend.get([key(1)]) == [b"x" * 1000], "once the server answers again, reads hit"


def test_after_a_timeout_calls_skip_the_server_for_down_backoff_s(redis_server, caplog):
    backend = redis_backend(redis_server.url, down_backoff_s=30.0)
    backend.put([key(1)], [b"x" * 1000])
    redis_server.pause()
    try:
        _, seconds = timed(lambda: backend.get([key(1)]))
        assert seconds >= SOCKET_TIMEOUT_S * 0.8, "the first call pays the timeout"
        for call in (lambda: backend.get([key(1)]), lambda: backend.put([key(2)], [b"y"]), lambda: backend.exists([key(1)])):
            _, seconds = timed(call)
            assert seconds < 0.1, f"within down_backoff_s calls must skip the hung server at once, took {seconds:.2f} s"
    finally:
        redis_server.resume()
    stats = backend.stats_snapshot()
    assert stats.skipped_calls == 3 and stats.errors == 1, f"skipped calls are counted apart from the one error: {stats}"
    assert stats.misses == 2 and stats.writes_dropped == 1, "skipped calls are misses and dropped writes"


def test_server_down_at_startup_is_not_fatal(redis_server):
    port = redis_server.port
    redis_server.kill()
    backend, seconds = timed(lambda: redis_backend(f"redis://127.0.0.1:{port}/0", down_backoff_s=0.0))
    assert seconds < CALL_BOUND_S, "building a backend for a dead server must not hang"
    assert backend.get([key(1)]) == [None] and backend.put([key(1)], [b"x"]) == 0, "a dead server reads as misses"
    redis_server.start()
    assert backend.put([key(1)], [b"x"]) == 1 and backend.get([key(1)]) == [b"x"], "the server coming up later is used"


def test_maxmemory_eviction_gives_misses_not_errors(redis_server_factory):
    server = redis_server_factory("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
    backend = redis_backend(server.url)
    values = [os.urandom(64 * 1024) for _ in range(200)]  # 12.5 MB into a 4 MB server
    stored = sum(backend.put([key(i) for i in range(j, j + 10)], values[j : j + 10]) for j in range(0, 200, 10))
    assert stored == 200, "under allkeys-lru every SET succeeds (older keys are evicted instead)"
    got = backend.get([key(i) for i in range(200)])
    hits = [i for i, v in enumerate(got) if v is not None]
    assert 0 < len(hits) < 200, f"some pages must have been evicted and some kept, got {len(hits)} hits"
    assert all(got[i] == values[i] for i in hits), "every page still there must be the one stored under its key"
    assert backend.exists([key(i) for i in range(200)]) < 200, "exists must not report evicted leading pages"
    stats = backend.stats_snapshot()
    assert stats.errors == 0 and stats.misses == 200 - len(hits), "eviction is a miss, not an error"


def test_maxmemory_noeviction_refusals_are_dropped_writes(redis_server_factory):
    server = redis_server_factory("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    backend = redis_backend(server.url)
    stored = backend.put([key(i) for i in range(100)], [os.urandom(64 * 1024) for _ in range(100)])
    assert 0 <= stored < 100, "a server refusing writes for memory must drop some writes"
    stats = backend.stats_snapshot()
    assert stats.writes_dropped == 100 - stored and stats.errors == 100 - stored, "each refused SET is dropped and counted"
    hits = sum(v is not None for v in backend.get([key(i) for i in range(100)]))
    assert hits == stored, f"reads still work on a full server: the {stored} stored pages hit, got {hits}"


def test_two_replicas_writing_the_same_pages_at_once_never_corrupt_them(redis_server):
    """Two replicas that computed the same prefix write its pages concurrently: the payloads are
    equal (the key names the exact prefix and configuration), SET replaces a value whole, so a
    reader always gets one whole page (last writer wins, with identical bytes)."""
    import threading

    writers = [redis_backend(redis_server.url), redis_backend(redis_server.url)]
    reader = redis_backend(redis_server.url)
    pages = [page_record.encode(FP, SPACE, (100_000,), os.urandom(100_000)) for _ in range(8)]
    keys = [key(200 + i) for i in range(8)]
    stop = threading.Event()

    def keep_writing(backend) -> None:
        while not stop.is_set():
            backend.put(keys, pages)

    threads = [threading.Thread(target=keep_writing, args=(w,)) for w in writers]
    for t in threads:
        t.start()
    try:
        seen = 0
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            for got, want in zip(reader.get(keys), pages):
                assert got is None or got == want, "a page read during concurrent writes differs from what was written"
                seen += got is not None
        assert seen > 0, "the reader never saw a written page"
    finally:
        stop.set()
        for t in threads:
            t.join()
    for backend in writers + [reader]:
        backend.close()

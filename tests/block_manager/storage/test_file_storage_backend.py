"""The file backend: a directory of pages that survives restarts, never holds more than its
capacity, never shows a half-written page, and turns I/O trouble into misses."""
from __future__ import annotations

import os
import threading

import pytest

from hybridkv.block_manager.storage import make_backend, page_record
from hybridkv.block_manager.storage.file_backend import TEMP_PREFIX, FileStorageBackend

FP = "tiny-llama|fp32|page4|tp0of1"
SPACE = "full_attn"


def key(i: int) -> str:
    return f"{i:064x}"


def file_backend(directory, capacity_bytes: int | None = None) -> FileStorageBackend:
    config = {"dir": str(directory)}
    if capacity_bytes is not None:
        config["capacity_bytes"] = capacity_bytes
    backend = make_backend("file", config)
    assert isinstance(backend, FileStorageBackend)
    return backend


def files_on_disk(directory) -> dict[str, int]:
    """name -> size of every file under the directory (temp files included)."""
    return {name: os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(directory) for name in names}


def test_round_trip_exists_counts_leading_keys(tmp_path):
    backend = file_backend(tmp_path)
    values = [os.urandom(100 + i) for i in range(4)]
    assert backend.put([key(i) for i in range(4)], values) == 4, "put must report every value stored"
    assert backend.get([key(i) for i in range(4)]) == values, "get must return exactly what put stored"
    assert backend.get([key(0), key(99), key(2)]) == [values[0], None, values[2]], "a missing key is None, the rest hit"
    assert backend.exists([key(i) for i in range(4)]) == 4, "exists counts all present keys"
    assert backend.exists([key(0), key(1), key(99), key(3)]) == 2, "exists stops at the first missing key"
    assert backend.exists([key(99), key(0)]) == 0, "a missing first key means no leading keys"
    assert os.path.exists(os.path.join(tmp_path, key(1)[:2], key(1))), "files are named by key under a 2-char shard"
    stats = backend.stats_snapshot()
    assert (stats.put_calls, stats.get_calls, stats.exists_calls) == (1, 2, 3), "every call is counted"
    assert (stats.hits, stats.misses, stats.errors) == (6, 1, 0), "hits and misses are counted per key"
    assert stats.keys_written == 4 and stats.bytes_written == sum(map(len, values)), "written keys and bytes are counted"
    assert stats.bytes_read == sum(map(len, values)) + len(values[0]) + len(values[2]), "bytes read are counted"
    assert stats.get_seconds > 0 and stats.put_seconds > 0, "time spent in get / put is measured"


def test_overwrite_replaces_the_value_and_its_size(tmp_path):
    backend = file_backend(tmp_path)
    backend.put([key(1)], [b"a" * 100])
    backend.put([key(1)], [b"b" * 10])
    assert backend.get([key(1)]) == [b"b" * 10], "a second put of a key replaces its value"
    assert backend.total_bytes == 10 and backend.num_files == 1, "an overwrite must not double-count the key's bytes"


def test_corrupted_or_truncated_file_decodes_to_a_miss(tmp_path):
    backend = file_backend(tmp_path)
    payloads = [os.urandom(2048) for _ in range(3)]
    backend.put([key(i) for i in range(3)], [page_record.encode(FP, SPACE, (2048,), p) for p in payloads])
    with open(backend.path_of(key(0)), "r+b") as f:  # flip one byte in the middle of the payload
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0x40]))
    with open(backend.path_of(key(1)), "r+b") as f:
        f.truncate(1500)
    blobs = backend.get([key(i) for i in range(3)])
    decoded = [page_record.decode(b, FP, SPACE) for b in blobs]
    assert decoded[0] is None, "a stored file with a flipped byte must decode to a miss"
    assert decoded[1] is None, "a truncated stored file must decode to a miss"
    assert decoded[2] == payloads[2], "an intact neighbour must still decode to its payload"


def test_capacity_evicts_least_recently_used_and_total_stays_under(tmp_path):
    capacity = 10 * 1000
    backend = file_backend(tmp_path, capacity_bytes=capacity)
    for i in range(10):
        backend.put([key(i)], [bytes([i]) * 1000])
        assert backend.total_bytes <= capacity, f"total bytes must stay <= capacity after put {i}"
    assert backend.get([key(0)]) == [bytes([0]) * 1000], "key 0 is still there before the limit is hit"
    for i in range(10, 15):  # five more pages: the five least recently used must go, key 0 was just read
        backend.put([key(i)], [bytes([i]) * 1000])
        assert backend.total_bytes <= capacity, f"total bytes must stay <= capacity after put {i}"
        assert sum(files_on_disk(tmp_path).values()) <= capacity, "the bytes on disk must stay <= capacity too"
    present = [i for i in range(15) if backend.get([key(i)])[0] is not None]
    assert present == [0, 6, 7, 8, 9, 10, 11, 12, 13, 14], f"LRU must evict keys 1-5 and keep the re-read key 0, kept {present}"
    assert backend.stats_snapshot().evictions == 5, "each eviction is counted"
    assert backend.put([key(99)], [b"x" * (capacity + 1)]) == 0, "a value larger than the whole capacity is not stored"
    assert backend.stats_snapshot().errors == 0, "eviction and an oversized value are not I/O errors"


def test_a_new_instance_on_the_same_dir_gets_hits_and_keeps_recency(tmp_path):
    first = file_backend(tmp_path)
    first.put([key(i) for i in range(3)], [b"a" * 100, b"b" * 100, b"c" * 100])
    for i, age in enumerate((300, 200, 100)):  # key 0 oldest on disk ...
        os.utime(first.path_of(key(i)), (os.path.getmtime(first.path_of(key(i))) - age,) * 2)
    first.get([key(0)])  # ... until read: a read bumps its mtime
    first.close()
    second = file_backend(tmp_path, capacity_bytes=200)  # room for two: the LRU one (key 1) must go at startup
    assert second.total_bytes <= 200, "a restart with a smaller capacity must evict down to it"
    assert second.get([key(0), key(2)]) == [b"a" * 100, b"c" * 100], "a new instance must hit the pages a previous one stored"
    assert second.get([key(1)]) == [None], "recency must survive the restart: the least recently used page is evicted"


def test_a_second_live_process_on_the_dir_sees_new_pages(tmp_path):
    reader = file_backend(tmp_path)
    writer = file_backend(tmp_path)
    writer.put([key(7)], [b"shared"])
    assert reader.exists([key(7)]) == 1, "exists looks at the disk, not only at what this instance wrote"
    assert reader.get([key(7)]) == [b"shared"], "get finds a page another instance wrote after this one started"
    assert reader.num_files == 1 and reader.total_bytes == 6, "a page read that the index did not know is adopted"


def test_writes_are_atomic_and_leave_no_temp_files(tmp_path):
    backend = file_backend(tmp_path)
    backend.put([key(i) for i in range(20)], [os.urandom(5000) for _ in range(20)])
    leftovers = [n for n in files_on_disk(tmp_path) if n.startswith(TEMP_PREFIX)]
    assert not leftovers, f"a completed put must leave no temp files, found {leftovers}"

    # A reader racing a writer of the same key sees the old or the new page, never a partial one.
    pages = [page_record.encode(FP, SPACE, (200_000,), bytes([i]) * 200_000) for i in range(2)]
    backend.put([key(100)], [pages[0]])
    stop = threading.Event()

    def keep_writing() -> None:
        i = 0
        while not stop.is_set():
            backend.put([key(100)], [pages[i % 2]])
            i += 1

    writer = threading.Thread(target=keep_writing)
    writer.start()
    try:
        for _ in range(200):
            blob = backend.get([key(100)])[0]
            assert blob in pages, "a read during concurrent overwrites must return a whole page"
    finally:
        stop.set()
        writer.join()
    assert not [n for n in files_on_disk(tmp_path) if n.startswith(TEMP_PREFIX)], "no temp files after concurrent writes"


def test_failed_write_is_dropped_counted_and_cleaned_up(tmp_path, monkeypatch):
    backend = file_backend(tmp_path)

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    assert backend.put([key(1), key(2)], [b"x" * 10, b"y" * 10]) == 0, "a write that fails is dropped, not raised"
    monkeypatch.undo()
    stats = backend.stats_snapshot()
    assert stats.errors == 2 and stats.writes_dropped == 2, "each failed write is counted as an error and a drop"
    assert backend.exists([key(1)]) == 0 and backend.total_bytes == 0, "a failed write leaves nothing indexed or on disk"
    assert not files_on_disk(tmp_path), "a failed write removes its temp file"


def test_unusable_dir_gives_misses_not_exceptions(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_bytes(b"")
    backend = file_backend(blocker / "store")  # cannot create a directory under a file
    assert backend.put([key(1)], [b"x"]) == 0, "put into an unusable dir must drop the write"
    assert backend.get([key(1)]) == [None] and backend.exists([key(1)]) == 0, "an unusable dir reads as misses"
    assert backend.stats_snapshot().errors >= 2, "the trouble must be counted"


def test_stale_temp_files_are_removed_at_startup_and_fresh_ones_kept(tmp_path):
    shard = tmp_path / "ab"
    shard.mkdir()
    stale = shard / f"{TEMP_PREFIX}{'ab' * 32}.1.dead"
    fresh = shard / f"{TEMP_PREFIX}{'ab' * 32}.2.live"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"in flight")
    os.utime(stale, (1_000_000, 1_000_000))
    backend = file_backend(tmp_path)
    assert not stale.exists(), "a temp file of a writer that died long ago must be removed at startup"
    assert fresh.exists(), "a recent temp file may be another process's write in flight and must be kept"
    assert backend.num_files == 0, "temp files are never indexed as pages"


@pytest.mark.parametrize("capacity_bytes", [0, 1.5, "10"])
def test_bad_capacity_is_rejected(tmp_path, capacity_bytes):
    with pytest.raises(ValueError, match="capacity_bytes"):
        file_backend(tmp_path, capacity_bytes=capacity_bytes)

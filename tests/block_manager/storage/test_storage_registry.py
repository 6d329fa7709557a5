"""make_backend: backends chosen by name with SGLang-style extra config; misconfiguration is a
ValueError that names what is valid, never a silent fallback."""
from __future__ import annotations

import json
import logging

import pytest

from hybridkv.block_manager.storage import BACKEND_NAMES, StorageBackend, make_backend
from hybridkv.block_manager.storage.file_backend import FileStorageBackend
from hybridkv.block_manager.storage.redis_backend import RedisStorageBackend


def test_backends_by_name_with_json_or_dict_config(tmp_path, redis_server):
    with make_backend("file", json.dumps({"dir": str(tmp_path / "a"), "capacity_bytes": 1000})) as from_json:
        assert isinstance(from_json, FileStorageBackend), "name 'file' must build the file backend"
        assert from_json.capacity_bytes == 1000, "a JSON string extra config must be applied"
    with make_backend("file", {"dir": str(tmp_path / "b")}) as from_dict:
        assert from_dict.root == str(tmp_path / "b"), "a dict extra config must be applied"
        assert from_dict.capacity_bytes > 0, "without capacity_bytes the file backend must still have a limit"
    with make_backend("redis", {"url": redis_server.url, "key_prefix": "t:"}) as redis_backend:
        assert isinstance(redis_backend, RedisStorageBackend), "name 'redis' must build the redis backend"
        assert redis_backend.put(["aa"], [b"x"]) == 1 and redis_backend.get(["aa"]) == [b"x"], "redis round trip"


def test_caller_defaults_fill_in_and_are_overridden(tmp_path, redis_server):
    defaults = {"dir": str(tmp_path / "default")}
    with make_backend("file", None, defaults=defaults) as backend:
        assert backend.root == str(tmp_path / "default"), "the caller's default dir must be used when the config has none"
    with make_backend("file", {"dir": str(tmp_path / "mine")}, defaults=defaults) as backend:
        assert backend.root == str(tmp_path / "mine"), "the extra config must override the caller's defaults"
    with make_backend("redis", {"url": redis_server.url}, defaults=defaults) as backend:
        assert backend.exists(["ab"]) == 0, "defaults a backend has no key for (dir for redis) must be ignored"


@pytest.mark.parametrize(
    "name, extra, message",
    [
        ("s3", None, "choose one of"),
        ("file", "{not json", "not valid JSON"),
        ("file", "[1, 2]", "JSON object"),
        ("file", {"dir": "/tmp/x", "capacity": 5}, "valid keys"),
        ("file", {}, "needs key(s) ['dir']"),
        ("file", {"dir": "/tmp/x", "capacity_bytes": -1}, "capacity_bytes"),
        ("redis", {"url": "http://x"}, "url must be"),
        ("redis", {"socket_timeout": True}, "socket_timeout"),
        ("redis", {"host": "x"}, "valid keys"),
    ],
)
def test_misconfiguration_is_a_value_error_naming_the_choices(name, extra, message):
    with pytest.raises(ValueError) as info:
        make_backend(name, extra)
    assert message in str(info.value), f"the error must say {message!r}, got {info.value}"
    if name == "s3":
        assert all(n in str(info.value) for n in BACKEND_NAMES), "an unknown backend name must list the valid ones"


def test_caller_misuse_raises_but_io_trouble_does_not(tmp_path):
    with make_backend("file", {"dir": str(tmp_path)}) as backend:
        for bad_key in ("../etc/passwd", "ab/../../x", "ABCD", "a", "", "zz", "ab" * 101, "ab cd", 17):
            with pytest.raises(ValueError):
                backend.get([bad_key])
        space_key = "ab" * 32 + "-full_attn.v1"  # page_keys.storage_key's form: hex chain, then the space
        assert backend.put([space_key], [b"x"]) == 1 and backend.get([space_key]) == [b"x"], "hex-then-space keys work"
        with pytest.raises(ValueError):
            backend.put(["aa", "bb"], [b"x"])
        assert backend.get([]) == [] and backend.exists([]) == 0 and backend.put([], []) == 0, "empty batches are no-ops"


class ExplodingBackend(StorageBackend):
    """A backend whose every operation raises, to check the never-raise boundary of the base class."""

    name = "exploding"

    def _exists(self, keys):
        raise OSError("disk on fire")

    def _get(self, keys):
        raise OSError("disk on fire")

    def _put(self, keys, values):
        raise OSError("disk on fire")


def test_base_class_turns_any_backend_exception_into_misses_counted_and_warned_once(caplog):
    backend = ExplodingBackend()
    with caplog.at_level(logging.WARNING, logger="hybridkv.block_manager.storage.backend"):
        for _ in range(20):
            assert backend.exists(["aa", "bb"]) == 0, "a failing exists must report no keys present"
            assert backend.get(["aa", "bb"]) == [None, None], "a failing get must be all misses"
            assert backend.put(["aa"], [b"x"]) == 0, "a failing put must store nothing"
    stats = backend.stats_snapshot()
    assert stats.errors == 20 * (1 + 2 + 1), f"every failed operation must be counted, got {stats.errors}"
    assert stats.misses == 40 and stats.hits == 0 and stats.writes_dropped == 20, "failures are misses / dropped writes"
    assert len(caplog.records) == 3, f"warnings must be rate-limited to one per kind, got {len(caplog.records)} lines"
    backend.close()
    assert backend.get(["aa"]) == [None] and backend.stats_snapshot().errors == stats.errors, (
        "after close calls answer misses without touching the store"
    )

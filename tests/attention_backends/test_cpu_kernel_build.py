"""attention_backends/cpu_kernels/build.py: a build lock left by a killed build is removed once it
is older than any build takes, so the next process builds instead of waiting on it forever, also
a process that meets the lock while it is still fresh."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from hybridkv.attention_backends.cpu_kernels import build


def _lock(directory: Path, age_seconds: float) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / "lock"
    lock.touch()
    then = time.time() - age_seconds
    os.utime(lock, (then, then))
    return lock


def test_only_a_lock_older_than_any_build_is_removed(tmp_path):
    stale = _lock(tmp_path / "a", build.STALE_LOCK_SECONDS + 60)
    fresh = _lock(tmp_path / "b", 5)
    assert build.clear_stale_build_lock(stale.parent) and not stale.exists()
    assert not build.clear_stale_build_lock(fresh.parent) and fresh.exists(), "a running build's lock was removed"
    assert not build.clear_stale_build_lock(tmp_path / "c"), "no lock: nothing to remove"


def test_a_fresh_lock_is_waited_out_until_it_goes_or_goes_stale(tmp_path):
    # A killed build's lock, fresh when met: removed once it is older than the stale age.
    killed = _lock(tmp_path / "a", 9.5)
    start = time.monotonic()
    assert build.await_build_lock(killed.parent, max_age_seconds=10.0, poll_seconds=0.05) and not killed.exists()
    assert time.monotonic() - start < 5.0, "waited far past the stale age"
    # A running build's lock: waited for until its build removes it, never removed here.
    running = _lock(tmp_path / "b", 0.0)
    threading.Timer(0.3, running.unlink).start()
    start = time.monotonic()
    assert not build.await_build_lock(running.parent, max_age_seconds=60.0, poll_seconds=0.05)
    assert 0.2 < time.monotonic() - start < 5.0
    assert not build.await_build_lock(tmp_path / "c"), "no lock: no wait"


@pytest.mark.slow
def test_a_build_behind_a_killed_builds_lock_completes(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    source = tmp_path / "answer.cpp"
    source.write_text("int64_t answer() { return 42; }\n")
    name = "hybridkv_test_stale_lock"
    tag, _ = build.isa_flags()
    directory = build._build_directory(f"{name}_{tag}")
    assert directory is not None and str(directory).startswith(str(tmp_path))
    _lock(directory, build.STALE_LOCK_SECONDS + 60)  # what a build killed mid-way leaves
    result = {}
    worker = threading.Thread(
        target=lambda: result.update(module=build.build_cpu_extension(name, source, ["answer"], "test kernel")),
        daemon=True)  # without the fix it waits on the lock forever
    worker.start()
    worker.join(timeout=300)
    assert not worker.is_alive(), "the build waited on the stale lock"
    assert result["module"] is not None and result["module"].answer() == 42

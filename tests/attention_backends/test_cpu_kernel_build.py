"""attention_backends/cpu_kernels/build.py: a build lock left by a killed build is removed once it
is older than any build takes, so the next process builds instead of waiting on it forever, also
a process that meets the lock while it is still fresh."""
from __future__ import annotations

import logging
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
    directory = build._build_directory(build.module_name(name, build.extension_cflags()))
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


def test_the_build_key_names_the_environment(monkeypatch):
    """Two virtual environments (another interpreter prefix), another torch or another compiler get
    a module name of their own, so none rebuilds (or loads) another's build; the same environment
    gets the same name every time."""
    flags = build.extension_cflags()
    here = build.module_name("hybridkv_probe", flags)
    assert build.module_name("hybridkv_probe", flags) == here, "the key is not stable"
    assert build.module_name("hybridkv_probe", [*flags, "-ffp-contract=off"]) != here, "flags are not in the key"
    monkeypatch.setattr(build.sys, "prefix", "/elsewhere/venv")
    other_venv = build.module_name("hybridkv_probe", flags)
    assert other_venv != here, "a second virtual environment would share this one's build"
    monkeypatch.undo()
    monkeypatch.setattr(build.torch, "__version__", "0.0.0+other")
    assert build.module_name("hybridkv_probe", flags) not in (here, other_venv), "the torch version is not in the key"
    monkeypatch.undo()
    build.compiler_identity.cache_clear()
    monkeypatch.setenv("CXX", "a-compiler-that-is-not-there")
    try:
        assert build.module_name("hybridkv_probe", flags) != here, "the compiler is not in the key"
    finally:
        monkeypatch.undo()
        build.compiler_identity.cache_clear()
    tag, _ = build.isa_flags()
    assert here.startswith(f"hybridkv_probe_{tag}_"), "the ISA tag is not in the name"


@pytest.mark.slow
def test_a_second_environment_does_not_rebuild_the_first_ones_kernels(tmp_path, monkeypatch, caplog):
    """Environment A builds, environment B (another prefix, same cache folder) builds its own, and
    A's next start loads its module from the cache without compiling it again."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    source = tmp_path / "answer.cpp"
    source.write_text("int64_t answer() { return 7; }\n")
    name = "hybridkv_test_two_environments"
    directory_a = build._build_directory(build.module_name(name, build.extension_cflags()))

    def start(prefix: str):
        monkeypatch.setattr(build.sys, "prefix", prefix)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=build.__name__):
            module = build.build_cpu_extension(name, source, ["answer"], "test kernel")
        assert module is not None and module.answer() == 7
        return [r.getMessage() for r in caplog.records if "compiling" in r.getMessage()]

    real_prefix = build.sys.prefix
    assert start(real_prefix), "environment A's first start compiles"
    built_a = {p: p.stat().st_mtime_ns for p in directory_a.glob("*.so")}
    assert built_a, "no module was built for environment A"
    assert start("/elsewhere/venv"), "environment B's first start compiles its own"
    assert not start(real_prefix), "environment A compiled again after environment B built"
    assert {p: p.stat().st_mtime_ns for p in directory_a.glob("*.so")} == built_a, "A's module was rebuilt"


def test_concurrent_callers_wait_for_one_build(tmp_path, monkeypatch):
    """prebuild on threads and a caller on the main thread asking for the same module at once run
    one build; the caller gets its outcome."""
    from torch.utils import cpp_extension

    calls, release = [], threading.Event()

    def slow_build(*args, **kwargs):
        calls.append(kwargs["name"])
        release.wait(timeout=30)
        return "module"

    monkeypatch.setattr(cpp_extension, "load_inline", slow_build)
    monkeypatch.setattr(build, "_build_directory", lambda name: None)
    source = tmp_path / "answer.cpp"
    source.write_text("int64_t answer() { return 1; }\n")
    load = lambda: build.build_cpu_extension("hybridkv_test_concurrent", source, ["answer"], "test kernel")  # noqa: E731
    (done,) = build.prebuild([load])
    deadline = time.monotonic() + 10
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    waiter = threading.Thread(target=lambda: calls.append(load()), daemon=True)
    waiter.start()
    time.sleep(0.2)
    release.set()
    waiter.join(timeout=30)
    done.result(timeout=30)
    assert calls == [build.module_name("hybridkv_test_concurrent", build.extension_cflags()), "module"], calls

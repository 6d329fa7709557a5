"""Builds the C++ CPU kernels on the machine that runs them (first use), or says why it cannot.

torch.utils.cpp_extension compiles with the system g++ and ninja and caches the build under
TORCH_EXTENSIONS_DIR (~/.cache/torch_extensions by default). The flags carry the vector ISA of
this CPU as torch's own dispatch sees it. The module name carries the ISA and a key of the build
environment (build_environment_key: interpreter prefix, source checkout, torch version, compiler,
flags), so a cache shared between an AVX2 and an AVX-512 machine never hands one the other's code,
and two virtual environments or two checkouts on one machine keep a build each instead of
rebuilding each other's (their include paths differ, and ninja rebuilds on any change of its
command lines). torch_headers.h and cpu_math.h are
put in front of every source, so the build's version hash covers them. HYBRIDKV_CPU_KERNELS=0 switches every
kernel off (A/B runs, or a machine without g++); callers then keep their torch paths.

A caller that meets a build of the same module in progress on another thread waits for that build
and takes its outcome. prebuild() starts several builds at once on threads (each is a g++ process), which the
model runner does at load so that the first start compiles its modules side by side, overlapped
with the weight load, with one log line per module and its time.
"""
from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch

logger = logging.getLogger(__name__)

ENV_SWITCH = "HYBRIDKV_CPU_KERNELS"
_SHARED_HEADER = Path(__file__).with_name("cpu_math.h")
_TORCH_HEADERS = Path(__file__).with_name("torch_headers.h")
# torch's build lock (FileBaton: a `lock` file in the build directory, created when a build
# starts and removed when it ends) stays behind when the building process is killed, and every
# later process then waits on it forever. A build of these kernels takes well under a minute, so
# a lock this old belongs to no running build.
STALE_LOCK_SECONDS = 300.0


def switch_on(variable: str) -> bool:
    """An on-by-default environment switch: False only when it is 0/false/off/no."""
    return os.environ.get(variable, "1").strip().lower() not in ("0", "false", "off", "no")


def kernels_enabled() -> bool:
    """False when HYBRIDKV_CPU_KERNELS is 0/false/off/no."""
    return switch_on(ENV_SWITCH)


def isa_flags() -> tuple[str, list[str]]:
    """(tag, compiler flags) for the vector ISA this CPU has, as torch's own dispatch sees it."""
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT", ...
    if capability.startswith("AVX512"):
        return "avx512", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"]
    if capability == "AVX2":
        return "avx2", ["-mavx2", "-mfma", "-mf16c"]
    return "base", []


def clear_stale_build_lock(build_dir: Path, max_age_seconds: float = STALE_LOCK_SECONDS) -> bool:
    """Remove build_dir's torch build lock if it is older than any build takes; True if removed."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
        if age <= max_age_seconds:
            return False
        lock.unlink()
    except FileNotFoundError:
        return False
    logger.warning("removed a stale build lock (%.0f s old, left by a killed build): %s", age, lock)
    return True


def await_build_lock(build_dir: Path, max_age_seconds: float = STALE_LOCK_SECONDS, poll_seconds: float = 1.0) -> bool:
    """Wait until build_dir has no torch build lock, removing it once it is stale; True if one was
    removed. torch waits on a lock without end, so a lock left by a build killed a moment ago
    (a CI run stopped mid-build) used to hang every process that met it while it was fresh
    (seen: ten minutes, until it was removed by hand). Waiting here bounds that by the stale age;
    a running build's lock goes away when it finishes, well before."""
    while (build_dir / "lock").exists():
        if clear_stale_build_lock(build_dir, max_age_seconds):
            return True
        time.sleep(poll_seconds)
    return False


def _build_directory(module_name: str) -> Path | None:
    """Where torch builds module_name (its private helper; None if that moved)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return Path(_get_build_directory(module_name, verbose=False))
    except Exception:  # noqa: BLE001 - only the stale-lock check is lost
        return None


@lru_cache(maxsize=1)
def compiler_identity() -> str:
    """The first line of `$CXX --version` (c++ by default, what torch's build calls), or "" when
    there is none: part of the build key, so an upgraded compiler gets a build of its own."""
    compiler = os.environ.get("CXX", "c++")
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return (done.stdout.splitlines() or [""])[0].strip()


def build_environment_key(cflags: list[str] | tuple[str, ...]) -> str:
    """A short hex key of everything a build depends on besides its sources: the interpreter
    (its prefix: a virtual environment is one), the checkout the sources come from (two
    checkouts sharing one interpreter have different include paths), the torch build, the
    compiler and the flags (which carry the ISA). torch's own cache covers the sources (its
    version hash)."""
    checkout = str(Path(__file__).resolve().parents[2])
    parts = [sys.prefix, checkout, sys.version, torch.__version__, str(getattr(torch.version, "git_version", "")),
             compiler_identity(), *cflags]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def module_name(name: str, cflags: list[str] | tuple[str, ...]) -> str:
    """The name a module is built and cached under: `name`, the ISA tag, the environment key."""
    tag, _ = isa_flags()
    return f"{name}_{tag}_{build_environment_key(cflags)}"


def extension_cflags(extra_cflags: tuple[str, ...] = ()) -> list[str]:
    """The compiler flags of every kernel module: -O3, OpenMP, this CPU's ISA, then `extra_cflags`.
    -fno-trapping-math lets g++ if-convert selects and divisions, which the omp simd loops over
    exp_nonpositive need to vectorize at all; it changes no result (no FP traps are on)."""
    _, isa = isa_flags()
    return ["-O3", "-fopenmp", "-fno-trapping-math", *isa, *extra_cflags]


# Per module name, for the whole process: the builds in progress, which a caller on another thread
# waits for instead of starting its own. Outcomes are kept by the loaders' own caches (one attempt
# per loader; a loader whose cache is cleared tries again).
_BUILDS_GUARD = threading.Lock()
_IN_FLIGHT: dict[str, Future] = {}


def build_cpu_extension(name: str, source: Path, functions: list[str], what: str,
                        extra_cflags: tuple[str, ...] = (), headers: tuple[Path, ...] = ()) -> ModuleType | None:
    """Compile `source` (with torch_headers.h and cpu_math.h in front) exposing `functions`; None,
    logged, when switched off or when the build fails (`what` names it in the log). A build of the
    same module in progress on another thread is waited for and its outcome returned."""
    if not kernels_enabled():
        logger.info("%s off (%s=0): the torch path runs instead", what, ENV_SWITCH)
        return None
    tag, _ = isa_flags()
    cflags = extension_cflags(extra_cflags)
    full_name = module_name(name, cflags)
    with _BUILDS_GUARD:
        in_flight = _IN_FLIGHT.get(full_name)
        if in_flight is None:
            mine = _IN_FLIGHT[full_name] = Future()
    if in_flight is not None:
        return in_flight.result()
    module = None
    try:
        module = _compile(full_name, source, functions, what, cflags, headers, tag)
    finally:
        with _BUILDS_GUARD:
            del _IN_FLIGHT[full_name]
        mine.set_result(module)
    return module


# A module found in the cache loads in well under this; longer means torch rebuilt it (its sources
# changed since), which the log then reports like a first build.
CACHED_LOAD_SECONDS = 3.0


def _compile(full_name: str, source: Path, functions: list[str], what: str, cflags: list[str],
             headers: tuple[Path, ...], tag: str) -> ModuleType | None:
    start = time.perf_counter()
    try:
        from torch.utils import cpp_extension

        build_dir = _build_directory(full_name)
        cached = build_dir is not None and any(build_dir.glob(f"{full_name}*.so"))
        if not cached:
            logger.info("%s: compiling for %s (once per build environment)", what, tag)
        if build_dir is not None:
            await_build_lock(build_dir)
        module = cpp_extension.load_inline(
            name=full_name,
            cpp_sources=["\n".join(h.read_text() for h in (_TORCH_HEADERS, _SHARED_HEADER, *headers, source))],
            functions=functions,
            no_implicit_headers=True,  # torch_headers.h instead of <torch/extension.h>
            extra_cflags=cflags,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 - no compiler, a failed build: the torch path still works
        logger.warning("%s unavailable (%s: %s); the torch path runs instead", what, type(e).__name__,
                       str(e).splitlines()[0] if str(e) else "")
        return None
    seconds = time.perf_counter() - start
    if cached and seconds < CACHED_LOAD_SECONDS:
        logger.debug("%s loaded from the build cache (%.1f s)", what, seconds)
    else:
        logger.info("%s built for %s in %.1f s", what, tag, seconds)
    return module


def prebuild(loaders: list[Callable[[], object]], workers: int | None = None) -> list[Future]:
    """Call every loader (each builds its module, see build_cpu_extension) on a pool of threads,
    `workers` at a time (default: one per core, at most 4); returns their futures (wait for them
    with concurrent.futures.wait). Callers that need a module meanwhile wait for its build only."""
    if not kernels_enabled() or not loaders:
        return []
    pool = ThreadPoolExecutor(max_workers=workers or max(1, min(4, os.cpu_count() or 1)),
                              thread_name_prefix="hybridkv-kernel-build")
    futures = [pool.submit(loader) for loader in loaders]
    pool.shutdown(wait=False)  # the threads end with their builds
    return futures

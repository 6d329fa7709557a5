"""Builds the C++ CPU kernels on the machine that runs them (first use), or says why it cannot.

torch.utils.cpp_extension compiles with the system g++ and ninja and caches the build under
TORCH_EXTENSIONS_DIR (~/.cache/torch_extensions by default). The flags carry the vector ISA of
this CPU as torch's own dispatch sees it, and the module name carries it too, so a cache shared
between an AVX2 and an AVX-512 machine never hands one the other's code. cpu_math.h is put in
front of every source, so the build's version hash covers it. HYBRIDKV_CPU_KERNELS=0 switches every kernel off
(A/B runs, or a machine without g++); callers then keep their torch paths.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

ENV_SWITCH = "HYBRIDKV_CPU_KERNELS"
_SHARED_HEADER = Path(__file__).with_name("cpu_math.h")
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


def build_cpu_extension(name: str, source: Path, functions: list[str], what: str,
                        extra_cflags: tuple[str, ...] = (), headers: tuple[Path, ...] = ()) -> ModuleType | None:
    """Compile `source` (with cpu_math.h in front) exposing `functions`; None, logged once by the
    caller's cache, when switched off or when the build fails (`what` names it in the log)."""
    if not kernels_enabled():
        logger.info("%s off (%s=0): the torch path runs instead", what, ENV_SWITCH)
        return None
    try:
        from torch.utils import cpp_extension

        tag, isa = isa_flags()
        build_dir = _build_directory(f"{name}_{tag}")
        if build_dir is not None:
            await_build_lock(build_dir)
        # -fno-trapping-math lets g++ if-convert selects and divisions, which the omp simd loops
        # over exp_nonpositive need to vectorize at all; it changes no result (no FP traps are on).
        module = cpp_extension.load_inline(
            name=f"{name}_{tag}",
            cpp_sources=["\n".join(h.read_text() for h in (_SHARED_HEADER, *headers, source))],
            functions=functions,
            extra_cflags=["-O3", "-fopenmp", "-fno-trapping-math", *isa, *extra_cflags],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 - no compiler, a failed build: the torch path still works
        logger.warning("%s unavailable (%s: %s); the torch path runs instead", what, type(e).__name__,
                       str(e).splitlines()[0] if str(e) else "")
        return None
    logger.info("%s built for %s", what, tag)
    return module

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
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

ENV_SWITCH = "HYBRIDKV_CPU_KERNELS"
_SHARED_HEADER = Path(__file__).with_name("cpu_math.h")


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

"""Which OpenMP runtime runs torch's and hybridkv's CPU threads: Intel's (libiomp5) where it is installed.

Why: torch's CPU wheel ships GNU libgomp. Alone in a process it serves well, but a server shares
its cores with the HTTP threads and, in the benchmarks, with the load generator, and a worker that
lost its core holds every join of the step until the scheduler gives it back (served steps were
measured ~60% slower than the same steps in process). Intel's runtime, as documented, yields while it
waits for work; that it loses fewer joins that way is the likely reason, not measured directly.
Measured on the 2-core Intel AMX VM (bf16 demo
model, `vllm bench serve`, 64 x (512 in, 64 out) at concurrency 16; alternating runs of one
sitting): 1.90 / 2.09 req/s and a 113 / 104 ms mean TPOT with libgomp (HYBRIDKV_OPENMP=gnu), 3.39
/ 3.41 req/s and 64 / 62 ms with libiomp5. Offline, alone on the cores, it changes little (an LD_PRELOAD
A/B): workload a 6% faster, b 1-3%, c the same. vLLM's CPU build preloads the same library (its env.sh).

How: `select()` runs first thing in `import hybridkv`, before anything imports torch. It loads
libiomp5 (the `intel-openmp` wheel puts it in the environment's lib/) with RTLD_GLOBAL, so when
torch and the kernels built with -fopenmp are loaded next, their GOMP_* and omp_* references bind
to Intel's runtime, which implements the GNU entry points; one runtime and one thread pool serve
the whole process. Nothing is loaded when torch was imported first (its libgomp already runs, and
two runtimes in one process would each start their own threads), when HYBRIDKV_OPENMP=gnu, or
when the library is absent (a CPU other than x86-64, an install without the wheel): then libgomp
serves as before. The choice is logged when the engine starts.

This module imports no torch and nothing from hybridkv.
"""
from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass
from pathlib import Path

ENV_SWITCH = "HYBRIDKV_OPENMP"  # "intel" (the default) or "gnu"
LIBRARY = "libiomp5.so"


@dataclass(frozen=True)
class OpenMPRuntime:
    name: str  # "intel" or "gnu"
    library: str | None  # the libiomp5 loaded, when name == "intel"
    reason: str  # why this runtime, for the startup log

    def describe(self) -> str:
        return f"OpenMP runtime: {self.name} ({self.reason})"


def intel_library() -> Path | None:
    """libiomp5.so from the `intel-openmp` wheel (installed under the environment's lib/), if present."""
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        candidate = Path(prefix) / "lib" / LIBRARY
        if candidate.is_file():
            return candidate
    return None


def _already_loaded(name: str) -> bool:
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            return any(name in line for line in maps)
    except OSError:
        return False


def select() -> OpenMPRuntime:
    """Load Intel's OpenMP runtime into the process when that is still possible; say which runtime serves."""
    wanted = os.environ.get(ENV_SWITCH, "intel").strip().lower()
    if wanted not in ("intel", "gnu"):
        raise ValueError(f"{ENV_SWITCH}={wanted!r}: expected 'intel' or 'gnu'")
    if _already_loaded(LIBRARY):  # LD_PRELOAD, or a second call
        return OpenMPRuntime("intel", LIBRARY, "already loaded in this process")
    if wanted == "gnu":
        return OpenMPRuntime("gnu", None, f"{ENV_SWITCH}=gnu")
    if "torch" in sys.modules:
        return OpenMPRuntime("gnu", None, "torch was imported before hybridkv, so its libgomp already runs; "
                                          "import hybridkv first to use Intel's runtime")
    library = intel_library()
    if library is None:
        return OpenMPRuntime("gnu", None, f"{LIBRARY} not installed (pip install intel-openmp on x86-64 Linux)")
    try:
        ctypes.CDLL(str(library), mode=os.RTLD_GLOBAL)
    except OSError as e:
        return OpenMPRuntime("gnu", None, f"{library} did not load: {e}")
    return OpenMPRuntime("intel", str(library), f"{library}")

"""C++ attention kernels for the CPU, compiled on this machine on first use.

`paged_attention` (paged_attention.cpp) attends short query groups -- decodes, and short prefill
chunks after a prefix -- by reading K/V in place through the block table: no gather of every key
slot into a temporary, and no per-key slot list built on the host each step. The torch-only
path (attention_backends/torch_native.py's decode tiles) stays as the fallback and as the
reference the tests hold this kernel to.

Built with torch.utils.cpp_extension (g++ and ninja; the build is cached per machine under
TORCH_EXTENSIONS_DIR, ~/.cache/torch_extensions by default), with the ISA flags of the CPU it
runs on (torch's CPU capability), which are also in the module name, so a cache shared between an AVX2 and
an AVX-512 machine never hands one the other's code. When there is no compiler, the build fails,
or HYBRIDKV_CPU_KERNELS=0 is set, `load_paged_attention()` returns None (logged once) and the
backend keeps the torch path.
"""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Callable

import torch

logger = logging.getLogger(__name__)

ENV_SWITCH = "HYBRIDKV_CPU_KERNELS"
_SOURCE = Path(__file__).with_name("paged_attention.cpp")


def kernels_enabled() -> bool:
    """False when HYBRIDKV_CPU_KERNELS is 0/false/off (A/B runs, or a machine without g++)."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def _isa_flags() -> tuple[str, list[str]]:
    """(tag, compiler flags) for the vector ISA this CPU has, as torch's own dispatch sees it."""
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT", ...
    if capability.startswith("AVX512"):
        return "avx512", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"]
    if capability == "AVX2":
        return "avx2", ["-mavx2", "-mfma", "-mf16c"]
    return "base", []


@functools.lru_cache(maxsize=1)
def load_paged_attention() -> Callable[..., torch.Tensor] | None:
    """The compiled `paged_attention(q, k_cache, v_cache, block_table, group_start, group_row,
    positions, page_size, window, scale) -> out`, or None when it cannot be built here."""
    if not kernels_enabled():
        logger.info("CPU attention kernels off (%s=0): decode gathers its keys in torch", ENV_SWITCH)
        return None
    try:
        from torch.utils import cpp_extension

        tag, isa = _isa_flags()
        module = cpp_extension.load_inline(
            name=f"hybridkv_paged_attention_{tag}",
            cpp_sources=[_SOURCE.read_text()],
            functions=["paged_attention"],
            extra_cflags=["-O3", "-fopenmp", *isa],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 - no compiler, a failed build: the torch path still works
        logger.warning("CPU paged-attention kernel unavailable (%s: %s); decode gathers its keys in torch",
                       type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None
    logger.info("CPU paged-attention kernel built for %s", tag)
    return module.paged_attention

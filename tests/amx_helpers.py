"""The AMX kernels' tests skip on CPUs without AMX and must run on CPUs with it: one rule, here."""
from __future__ import annotations

import pytest
import torch


def cpu_has_amx() -> bool:
    """AMX tiles as torch itself probes them (the kernels' loaders ask the same probe)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe is not None and probe())


def require_amx(*built: object, what: str) -> None:
    """Skip when a kernel module is missing on a CPU without AMX; fail when the CPU has AMX,
    because there a missing module is a broken build, not an absent feature."""
    if any(b is None for b in built):
        assert not cpu_has_amx(), f"this CPU has AMX but {what} did not build"
        pytest.skip("no AMX on this CPU")

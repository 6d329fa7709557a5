"""What the CPU can compute natively, detected once: the ISA level and native bf16 / fp16.

These machines are not all the same CPU: AMD Zen 5 has AVX-512 with native bf16 dot products
(avx512_bf16), Zen 3 has AVX2 only, where torch's bf16 matmuls fall to slow paths (measured
there: F.linear 1024x576x1536 at 20 GFLOP/s in bf16 vs 138 in fp32). `dtype="auto"` uses this
to keep a bf16 checkpoint in float32 on CPUs without native bf16 (checkpoint.resolve_dtype),
and benchmarks print `describe()` next to every figure.

It sits at the package root, below every layer, because both model_executor (dtypes, which
linear kernel serves a weight) and attention_backends (which prefill kernel serves bf16) ask it,
and attention_backends may not import model_executor.
"""
from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CpuFeatures:
    model_name: str
    family: str  # /proc/cpuinfo "cpu family" (AMD: 25 = Zen 3/4, 26 = Zen 5)
    model: str
    flags: frozenset[str]
    torch_capability: str  # torch's own dispatch level: "AVX2", "AVX512", "DEFAULT", ...
    vendor: str = ""  # /proc/cpuinfo "vendor_id": "GenuineIntel", "AuthenticAMD", ...

    @property
    def isa(self) -> str:
        if "amx_tile" in self.flags:
            return "AMX"
        if "avx512f" in self.flags:
            return "AVX-512"
        if "avx2" in self.flags:
            return "AVX2"
        return "baseline"

    @property
    def native_bf16(self) -> bool:
        """bf16 dot products in hardware (AVX-512 BF16 or AMX-BF16): oneDNN's fast bf16 GEMMs."""
        return bool({"avx512_bf16", "amx_bf16"} & self.flags)

    @property
    def native_fp16(self) -> bool:
        return bool({"avx512_fp16", "amx_fp16"} & self.flags)

    def native(self, dtype: torch.dtype) -> bool:
        """Whether matmuls in `dtype` run at the CPU's native rate (float32 always does)."""
        if dtype == torch.bfloat16:
            return self.native_bf16
        if dtype == torch.float16:
            return self.native_fp16
        return True

    def describe(self) -> str:
        """e.g. 'AMD EPYC (family 25 model 1, AVX2)': the model name alone does not tell Zen 3
        from Zen 5."""
        extra = "".join(f", {f}" for f in ("avx512_bf16", "amx_bf16", "avx512_fp16") if f in self.flags)
        return f"{self.model_name} (family {self.family} model {self.model}, {self.isa}{extra})"


def parse_cpuinfo(text: str, torch_capability: str = "") -> CpuFeatures:
    """CpuFeatures from the text of /proc/cpuinfo (its first processor's block)."""
    info: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if info:
                break  # the first processor is enough: every core of these machines is alike
            continue
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    return CpuFeatures(
        model_name=info.get("model name", platform.processor() or "unknown CPU"),
        family=info.get("cpu family", "?"),
        model=info.get("model", "?"),
        flags=frozenset(info.get("flags", "").split()),
        torch_capability=torch_capability,
        vendor=info.get("vendor_id", ""),
    )


@functools.lru_cache(maxsize=1)
def cpu_features() -> CpuFeatures:
    """This machine's CpuFeatures, read once per process (no flags where /proc/cpuinfo is absent)."""
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        capability = ""
    try:
        with open("/proc/cpuinfo") as f:
            return parse_cpuinfo(f.read(), capability)
    except OSError:
        return parse_cpuinfo("", capability)

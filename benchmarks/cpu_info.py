"""The CPU line every benchmark prints: figures are only comparable on the same CPU, and VMs
often report a bare vendor name ("AMD EPYC"), so the family and model numbers come with it."""
from __future__ import annotations


def cpu_name() -> str:
    """/proc/cpuinfo's model name, family and model."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        return "unknown CPU"
    return f"{info.get('model name', 'unknown')}, family {info.get('cpu family', '?')} model {info.get('model', '?')}"

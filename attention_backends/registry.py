"""Attention backends by name (EngineConfig.attention_backend / LLM(attention_backend=...)).

  torch_native  the CPU reference (torch ops only; runs on any device)
  triton        Triton paged kernels (hybridkv.attention_backends.triton_attention); CUDA, or the
                CPU under TRITON_INTERPRET=1 (how CI checks the kernels)
  xformers      xformers.ops.memory_efficient_attention for prefill, the Triton decode kernel
                for decode (hybridkv.attention_backends.xformers_attention); CUDA only
  auto          "triton" on CUDA when the `triton` package imports, else "torch_native"

Nothing here imports triton or xformers at module load: a backend is a "module:Class" string,
imported when it is asked for, after check_attention_backend has said what it needs (a CUDA
device, a package) in an error raised before the model is loaded. Models with their own
attention math (DeepSeek-V4's hybrid layers) bind their own backend in allocate_kv_cache; the
resolved name reaches them as ModelRunner.attention_backend_name / model.attention_backend_name.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import os

import torch

logger = logging.getLogger(__name__)

AUTO = "auto"
_BACKENDS: dict[str, str] = {
    "torch_native": "hybridkv.attention_backends.torch_native:TorchNativeAttention",
    "triton": "hybridkv.attention_backends.triton_attention.backend:TritonAttention",
    "xformers": "hybridkv.attention_backends.xformers_attention:XformersAttention",
}
# Every value attention_backend= accepts (EngineConfig validates against it, the CLI offers it).
ATTENTION_BACKEND_CHOICES: tuple[str, ...] = (AUTO, *_BACKENDS)


def available_attention_backends() -> list[str]:
    """Every registered backend name (whether or not it can run on this machine)."""
    return sorted(_BACKENDS)


def _unknown(name) -> ValueError:
    return ValueError(f"unknown attention backend {name!r}; choose one of: {', '.join(ATTENTION_BACKEND_CHOICES)}")


def validate_attention_backend_name(name) -> str:
    if not isinstance(name, str) or name not in ATTENTION_BACKEND_CHOICES:
        raise _unknown(name)
    return name


def _package_error(package: str) -> str | None:
    """None when `package` imports, else why not (ImportError text, or the exception's)."""
    try:
        importlib.import_module(package)
    except ImportError as e:
        return str(e) or type(e).__name__
    except Exception as e:  # noqa: BLE001 - a broken install (e.g. a CUDA lib missing) is "not usable" too
        return f"{type(e).__name__}: {e}"
    return None


def triton_interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _on_cuda(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


def attention_backend_problem(name: str, device: torch.device | str = "cpu") -> str | None:
    """Why backend `name` (not "auto") cannot run on `device` here, or None when it can."""
    device = torch.device(device)
    if name == "torch_native":
        return None
    if name == "triton":
        why = _package_error("triton")
        if why is not None:
            return f"attention_backend='triton' needs the `triton` package: pip install triton ({why})"
        if not _on_cuda(device) and not triton_interpreter_on():
            return (f"attention_backend='triton' needs a CUDA device; this runner is on {device.type} "
                    "(set TRITON_INTERPRET=1 to run the Triton kernels on the CPU interpreter, slowly)")
        return None
    if name == "xformers":
        if not _on_cuda(device):
            return f"attention_backend='xformers' needs a CUDA device; this runner is on {device.type}"
        why = _package_error("xformers.ops")
        if why is not None:
            return f"attention_backend='xformers' needs the `xformers` package: pip install xformers ({why})"
        return None
    raise _unknown(name)


def check_attention_backend(name: str, device: torch.device | str = "cpu") -> None:
    """Raise what resolve_attention_backend would (an unknown name, a backend that cannot run on
    `device`), without resolving, logging or building anything: the first check at start."""
    validate_attention_backend_name(name)
    if name != AUTO and (problem := attention_backend_problem(name, device)) is not None:
        raise RuntimeError(problem)


def resolve_attention_backend(name: str, device: torch.device | str = "cpu") -> str:
    """The concrete backend `name` stands for on `device`; raises ValueError for an unknown name
    and RuntimeError naming what is missing for one that cannot run here. Logs the choice."""
    validate_attention_backend_name(name)
    device = torch.device(device)
    if name == AUTO:
        resolved = "torch_native"
        why = "no CUDA device" if not _on_cuda(device) else None
        if why is None:
            problem = attention_backend_problem("triton", device)
            if problem is None and not _in_build("triton"):
                problem = "its module is not in this build"
            if problem is None:
                resolved, why = "triton", "CUDA and the triton package"
            else:
                why = f"triton backend unusable: {problem}"
        logger.info("attention backend: auto -> %s (%s, device %s)", resolved, why, device)
        return resolved
    problem = attention_backend_problem(name, device)
    if problem is not None:
        raise RuntimeError(problem)
    logger.info("attention backend: %s (device %s)", name, device)
    return name


def _in_build(name: str) -> bool:
    try:
        return importlib.util.find_spec(_BACKENDS[name].partition(":")[0]) is not None
    except ImportError:
        return False


def _load_class(name: str):
    module_name, _, cls_name = _BACKENDS[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):  # the backend's own module is not in this build
            raise RuntimeError(f"attention_backend={name!r}: {module_name} is not in this build") from e
        raise
    return getattr(module, cls_name)


def get_attention_backend(name: str, device: torch.device | str = "cpu"):
    """A new instance of backend `name` ("auto" is resolved first) for `device`. Unknown names
    raise ValueError listing the choices; a backend that cannot run here, RuntimeError."""
    resolved = resolve_attention_backend(name, device)
    cls = _load_class(resolved)
    if "device" in inspect.signature(cls).parameters:
        return cls(device=torch.device(device))
    return cls()

"""What config.json says about a checkpoint's quantization, validated once.

DeepSeek-V3/V4 and the HF "-FP8" checkpoints (Qwen3, Llama, Mistral) all declare the same
fine-grained FP8 format::

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                            "weight_block_size": [128, 128], "activation_scheme": "dynamic"}

and DeepSeek-V4 adds ``expert_dtype`` ("fp4": MXFP4 routed experts, "fp8": FP8 blocks like
the rest), at the top level of config.json (V4) or inside ``quantization_config`` (V4.1).
Everything else hybridkv does not run is refused here, before any weight is read, with a
message naming the field and what is supported, because a silently misread format would
produce a model that loads and talks nonsense.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_QUANT_METHODS = ("fp8",)
SUPPORTED_FMTS = ("e4m3",)
# None / "float": scales are plain numbers (float32 in DeepSeek-V3, Qwen3-FP8);
# "ue8m0": scales are powers of two (stored as float8_e8m0fnu bytes, or as float32 values).
SUPPORTED_SCALE_FMTS = (None, "float", "ue8m0")
SUPPORTED_EXPERT_DTYPES = (None, "fp8", "fp4")
SUPPORTED_ACTIVATION_SCHEMES = (None, "dynamic")
MXFP4_GROUP_SIZE = 32  # one ue8m0 scale per 32 e2m1 values along the input dimension


@dataclass(frozen=True)
class QuantizationConfig:
    """A checkpoint's quantization, as far as loading it needs to know.

    ``weight_block`` is (rows, cols) of one FP8 scale block. ``expert_dtype`` says whether
    packed FP4 (e2m1) weights may appear: only then is an int8/uint8 weight with a scale read
    as MXFP4 rather than refused. ``dequantize`` is the checkpoint's own request (HF's
    FineGrainedFP8Config field) to expand the weights at load instead of keeping them compressed.
    """

    quant_method: str
    fmt: str
    scale_fmt: str | None
    weight_block: tuple[int, int]
    expert_dtype: str | None = None
    dequantize: bool = False

    @property
    def allows_fp4(self) -> bool:
        return self.expert_dtype == "fp4"

    def describe(self) -> str:
        scales = self.scale_fmt or "float"
        experts = f", experts {self.expert_dtype}" if self.expert_dtype else ""
        return (f"{self.quant_method} {self.fmt} {self.weight_block[0]}x{self.weight_block[1]} blocks, "
                f"{scales} scales{experts}")


def _field_error(field: str, value: Any, supported: tuple) -> ValueError:
    shown = ", ".join("unset" if s is None else repr(s) for s in supported)
    return ValueError(
        f"config.json quantization_config has {field}={value!r}, which hybridkv cannot load; supported: {shown}"
    )


def parse_quantization_config(raw: Any, top_level_expert_dtype: Any = None) -> QuantizationConfig:
    """Validate a ``quantization_config`` dict (as stored in config.json)."""
    if not isinstance(raw, dict):
        raise ValueError(f"config.json quantization_config must be a JSON object, found {type(raw).__name__}")
    method = raw.get("quant_method")
    if method not in SUPPORTED_QUANT_METHODS:
        raise ValueError(
            f"config.json quantization_config has quant_method={method!r}; hybridkv loads only "
            f"{', '.join(repr(m) for m in SUPPORTED_QUANT_METHODS)} (fine-grained block-scaled FP8, with "
            "optional MXFP4 experts as DeepSeek-V4 ships them). Use such a checkpoint or an unquantized one"
        )
    fmt = raw.get("fmt", "e4m3")
    if fmt not in SUPPORTED_FMTS:
        raise _field_error("fmt", fmt, SUPPORTED_FMTS)
    scale_fmt = raw.get("scale_fmt")
    if scale_fmt not in SUPPORTED_SCALE_FMTS:
        raise _field_error("scale_fmt", scale_fmt, SUPPORTED_SCALE_FMTS)
    scheme = raw.get("activation_scheme")
    if scheme not in SUPPORTED_ACTIVATION_SCHEMES:
        raise ValueError(
            f"config.json quantization_config has activation_scheme={scheme!r}; hybridkv dequantizes weights "
            "only and computes activations in the model dtype, so only 'dynamic' activation scaling (no "
            "stored activation scales) is supported"
        )
    block = raw.get("weight_block_size")
    if block is None:
        raise ValueError(
            "config.json quantization_config (quant_method 'fp8') has no weight_block_size; hybridkv loads "
            "block-scaled FP8 (e.g. [128, 128]), not per-tensor FP8"
        )
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(
            f"config.json quantization_config has weight_block_size={block!r}; expected two positive integers "
            "[rows, cols], e.g. [128, 128]"
        )
    expert_dtype = raw.get("expert_dtype", top_level_expert_dtype)
    if expert_dtype not in SUPPORTED_EXPERT_DTYPES:
        raise _field_error("expert_dtype", expert_dtype, SUPPORTED_EXPERT_DTYPES)
    dequantize = raw.get("dequantize", False)
    if not isinstance(dequantize, bool):
        raise ValueError(f"config.json quantization_config has dequantize={dequantize!r}; expected true or false")
    return QuantizationConfig(
        quant_method=method, fmt=fmt, scale_fmt=scale_fmt, weight_block=(block[0], block[1]),
        expert_dtype=expert_dtype, dequantize=dequantize,
    )


def quantization_config_of(model_config) -> QuantizationConfig | None:
    """The quantization of a loaded transformers config (None: an unquantized checkpoint).

    transformers keeps ``quantization_config`` as the raw dict when it loads a config (it only
    builds its own quantizer objects in from_pretrained), so the dict from config.json is read.
    """
    raw = getattr(model_config, "quantization_config", None)
    if raw is None:
        return None
    if hasattr(raw, "to_dict"):
        raw = raw.to_dict()
    return parse_quantization_config(raw, getattr(model_config, "expert_dtype", None))

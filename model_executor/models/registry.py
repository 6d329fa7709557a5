"""Model registry keyed by config.json's `architectures`."""
from __future__ import annotations

from hybridkv.model_executor.models.base import CausalLM
from hybridkv.model_executor.models.deepseek_v4 import DeepseekV4ForCausalLM
from hybridkv.model_executor.models.gemma3 import Gemma3ForCausalLM
from hybridkv.model_executor.models.llama import LlamaForCausalLM

_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "DeepseekV4ForCausalLM": DeepseekV4ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def resolve_model_class(config) -> type[CausalLM]:
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in _REGISTRY:
            return _REGISTRY[arch]
    raise ValueError(
        f"unsupported model architecture {archs or '(none listed in config.json)'}; "
        f"hybridkv supports: {', '.join(supported_architectures())}"
    )

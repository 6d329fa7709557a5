"""DeepSeek-V4 (transformers model_type "deepseek_v4") over hybridkv's block spaces."""
from hybridkv.model_executor.models.deepseek_v4.model import DeepseekV4ForCausalLM

__all__ = ["DeepseekV4ForCausalLM"]

"""Loading block-quantized checkpoints and computing with them compressed (weight-only).

  config.py   quantization_config from config.json -> QuantizationConfig (or a clear refusal)
  codecs.py   e4m3 / e2m1 / e8m0 decoding with vectorised integer ops
  tensor.py   BlockQuantizedTensor: codes + per-block scales, validated against each other
  pairing.py  the checkpoint stream with each weight paired with its `.scale`/`.weight_scale_inv`
  matmul.py   x @ W.T dequantizing W one row tile at a time (the portable kernel)
  linear.py   QuantizedLinear, the nn.Linear drop-in that keeps W compressed
  install.py  swapping a model's nn.Linear layers for QuantizedLinear during a load
  summary.py  formats, tensors and weight memory for the startup log
"""
from hybridkv.model_executor.quantization.config import QuantizationConfig, parse_quantization_config, quantization_config_of
from hybridkv.model_executor.quantization.install import QuantizedWeightInstaller
from hybridkv.model_executor.quantization.linear import QuantizedLinear, quantized_linears, quantized_weight_numel
from hybridkv.model_executor.quantization.pairing import attach_block_scales
from hybridkv.model_executor.quantization.summary import (
    checkpoint_bytes, describe_weights, weight_inventory, weight_memory_bytes,
)
from hybridkv.model_executor.quantization.tensor import BlockQuantizedTensor, block_quantized_from_checkpoint

__all__ = [
    "BlockQuantizedTensor",
    "QuantizationConfig",
    "QuantizedLinear",
    "QuantizedWeightInstaller",
    "attach_block_scales",
    "block_quantized_from_checkpoint",
    "checkpoint_bytes",
    "describe_weights",
    "parse_quantization_config",
    "quantization_config_of",
    "quantized_linears",
    "quantized_weight_numel",
    "weight_inventory",
    "weight_memory_bytes",
]

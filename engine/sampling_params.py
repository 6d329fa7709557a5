"""SamplingParams lives with the model executor (the sampler consumes it and model_executor never
imports engine); re-exported here so `hybridkv.engine.sampling_params` keeps working."""
from hybridkv.model_executor.sampling_params import RequestOutputKind, SamplingParams
from hybridkv.model_executor.structured_outputs import StructuredOutputsParams

__all__ = ["RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]

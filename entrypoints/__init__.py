"""User surfaces of hybridkv: the offline LLM class, the CLI and the OpenAI-compatible HTTP server (openai/)."""
from hybridkv.engine.outputs import CompletionOutput, Logprob, RequestOutput
from hybridkv.engine.sampling_params import SamplingParams, StructuredOutputsParams
from hybridkv.entrypoints.llm import LLM

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob"]

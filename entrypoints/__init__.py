"""User surfaces of hybridkv: the offline LLM class, the CLI and (later) the HTTP server."""
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import SamplingParams
from entrypoints.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]

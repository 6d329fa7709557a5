"""The xformers attention backend (name "xformers"; CUDA only).

bias.py     the attention biases and key layouts, a pure function of the step's metadata
            (checked on the CPU through xformers' materialize())
backend.py  XformersAttention: memory_efficient_attention for prefill, Triton decode

Importing this package imports neither xformers nor triton.
"""
from hybridkv.attention_backends.xformers_attention.backend import XformersAttention

__all__ = ["XformersAttention"]

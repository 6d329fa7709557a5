"""Triton paged-attention kernels: the dense models' (Llama, Qwen, Mistral, Gemma-3: kv_write,
decode_attention, prefill_attention, backend) and DeepSeek-V4's hybrid layers (hybrid_v4).

The only package of hybridkv that imports triton: nothing else may import it at module load,
so the engine runs where triton is not installed. The backend is reached by name through the
registry ("triton" -> backend.TritonAttention).

Kernels are chosen compiled or interpreted when they are decorated, i.e. when this package's
modules are first imported: set TRITON_INTERPRET=1 before that import to run them on CPU
tensors (the tests do).
"""

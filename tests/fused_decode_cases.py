"""The Llama-family and Gemma 3 shapes the fused decode (and so the decode burst) covers, as
tiny_ckpt(arch, **overrides) arguments; shared by the tests that hold both to the layer path."""

FUSED_DECODE_CASES = {
    "llama": ("llama", {}),
    "qwen2 (q/k/v biases)": ("qwen2", {}),
    "qwen3 (per-head q/k norms)": ("qwen3", {}),
    "mistral (every layer windowed)": ("mistral", {}),
    "qwen2, a full and a windowed layer (two block spaces)": (
        "qwen2", {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 1}),
    "gemma3 (unit-offset sandwich norms, GELU-tanh, two RoPE tables and block spaces, final softcap)": (
        "gemma3_text", {}),
}

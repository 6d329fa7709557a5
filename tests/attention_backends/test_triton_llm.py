"""End to end: tiny checkpoints served with attention_backend="triton" (Triton's CPU interpreter)
compute the same logits as with "torch_native" at every position, 1e-4 in float32, and generate
the same greedy tokens. The batch mixes decodes with prefill chunks (a small token budget cuts the
prompts into chunks beside running decodes); Gemma-3 adds sliding layers (window 24, crossed by
the prompts) beside full ones, i.e. two spaces with their own block tables, and its own scale.
"""
from __future__ import annotations

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported (decorated)
pytest.importorskip("triton")

from hybridkv.entrypoints import LLM, SamplingParams  # noqa: E402

ATOL = 1e-4
PROMPT_LENS = (5, 30, 50)
MAX_TOKENS = 8


def _run(path: str, backend: str) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    """The logits of every computed position per sequence (keyed by the engine's sequence ids,
    the same in two fresh engines), and each prompt's greedy tokens."""
    llm = LLM(path, dtype="float32", max_model_len=128, max_num_batched_tokens=16, attention_backend=backend)
    assert llm.engine.runner.backend.name == backend
    vocab = llm.engine.runner.config.vocab_size
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    runner = llm.engine.runner
    runner.captured_logits = {}
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    logits = {sid: torch.cat(chunks) for sid, chunks in runner.captured_logits.items()}
    runner.captured_logits = None
    return logits, [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_triton_backend_matches_torch_native_end_to_end(tiny_ckpt, arch):
    path = tiny_ckpt(arch)
    ref_logits, ref_tokens = _run(path, "torch_native")
    logits, tokens = _run(path, "triton")
    assert tokens == ref_tokens
    assert logits.keys() == ref_logits.keys()
    # every prompt position and every generated token but the last was computed
    assert sorted(x.shape[0] for x in logits.values()) == [n + MAX_TOKENS - 1 for n in PROMPT_LENS]
    for sid, ref in ref_logits.items():
        torch.testing.assert_close(logits[sid], ref, atol=ATOL, rtol=0)

"""DeepSeek-V4's MTP layer against a reference built from transformers' modules (float32,
tests/mtp_reference.py: transformers' decoder layer holding the checkpoint's mtp.0.* tensors,
fed the main model's final streams). Our MTP logits of every row of the draft extend (the
runner's capture hook) must match to ATOL (1e-4; measured 3e-6), with the prompt in one chunk or
in chunks, and over sampled decode steps. The release formats (FP8 / MXFP4) load the layer
compressed.
"""
from __future__ import annotations

import pytest
import torch

from hybridkv.engine.sampling_params import SamplingParams
from hybridkv.entrypoints import LLM
from hybridkv.model_executor.models.deepseek_v4.weights import canonical_name
from mtp_reference import ReferenceMTP
from tiny_deepseek_v4 import build_v4_checkpoint, single_thread

ATOL = 1e-4
KW = dict(dtype="float32", block_size=32, max_model_len=256, max_num_seqs=2,
          speculative_config={"method": "mtp", "num_speculative_tokens": 2})


@pytest.fixture(autouse=True)
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return build_v4_checkpoint(str(tmp_path_factory.mktemp("v4mtp")), mtp=True)


@pytest.fixture(scope="module")
def reference(ckpt) -> ReferenceMTP:
    return ReferenceMTP(ckpt)


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _captured(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[list[int], torch.Tensor]:
    """Our MTP logits of every row the draft extend ran for the request, and its full sequence."""
    drafter = llm.engine.runner.mtp_drafter
    drafter.captured_logits = {}
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    llm.engine.check_invariants()
    (rows,) = drafter.captured_logits.values()
    return prompt + list(out.outputs[0].token_ids), torch.cat(rows)


@pytest.mark.parametrize("chunk", [None, 24], ids=["one_chunk", "chunks_of_24"])
def test_mtp_logits_of_a_prompt_match_the_reference(ckpt, reference, chunk):
    """A 70-token prompt (window 16, pages of 32): rows 0..69, the last one reading the sampled token."""
    llm = LLM(ckpt, **KW, **({"max_num_batched_tokens": chunk} if chunk else {}))
    prompt = _prompt(llm.engine.runner.config.vocab_size, 70, seed=1)
    seq, ours = _captured(llm, prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    want = reference.logits(seq)
    assert ours.shape == want.shape == (70, llm.engine.runner.config.vocab_size)
    assert (ours - want).abs().max().item() < ATOL


def test_mtp_logits_over_decode_steps_match_the_reference(ckpt, reference):
    """A sampled request drafts nothing: every decode step's row is extended alone (its K/V on
    the pages of earlier steps)."""
    llm = LLM(ckpt, **KW)
    prompt = _prompt(llm.engine.runner.config.vocab_size, 20, seed=2)
    seq, ours = _captured(llm, prompt, SamplingParams(temperature=1.0, seed=7, max_tokens=30, ignore_eos=True))
    assert llm.engine.stats["spec_drafts"] == 0
    want = reference.logits(seq)[: ours.shape[0]]
    assert ours.shape[0] == len(seq) - 1
    assert (ours - want).abs().max().item() < ATOL


def test_mtp_checkpoint_names_map_onto_the_layer():
    """Release and save_pretrained names land on the MTP module; without the MTP they are skipped."""
    for prefix in ("mtp.0.", "model.mtp.0."):
        assert canonical_name(prefix + "attn.wq_a.weight", mtp=True) == "mtp.attn.wq_a.weight"
        assert canonical_name(prefix + "hc_attn_fn", mtp=True) == "mtp.hc_attn.fn"
        assert canonical_name(prefix + "hc_head_scale", mtp=True) == "mtp.hc_head.hc_scale"
        assert canonical_name(prefix + "e_proj.weight", mtp=True) == "mtp.e_proj.weight"
        assert canonical_name(prefix + "ffn.gate.bias", mtp=True) == "mtp.ffn.gate.bias"
        assert canonical_name(prefix + "attn.wq_a.weight") is None
    assert canonical_name("hc_head_fn") == "hc_head.hc_fn"
    with pytest.raises(ValueError, match="only one MTP layer"):
        canonical_name("mtp.1.e_proj.weight", mtp=True)


@pytest.mark.parametrize("naming", ["original", "hf"])
def test_release_format_mtp_stays_compressed_and_computes_the_expanded_layer(tmp_path, naming):
    """FP8 projections and MXFP4 experts, release or save_pretrained naming, two shards: the MTP
    layer's linears stay compressed, and its logits equal those of the same checkpoint expanded at
    load (dequantize_weights=True); greedy tokens equal plain decoding."""
    from hybridkv.model_executor.quantization import QuantizedLinear
    from tiny_quantized import build_release_v4_checkpoint

    path = build_release_v4_checkpoint(str(tmp_path / "q"), "fp4", naming, mtp=True)
    kw = dict(KW, block_size=128, max_num_batched_tokens=32)  # HCA ratio 128
    compressed, expanded = LLM(path, **kw), LLM(path, dequantize_weights=True, **kw)
    mtp = compressed.engine.runner.model.mtp
    assert isinstance(mtp.attn.wq_a, QuantizedLinear) and isinstance(mtp.e_proj, QuantizedLinear)
    assert mtp.ffn.experts[0].w1.format_names[0].startswith("MXFP4")
    assert not isinstance(expanded.engine.runner.model.mtp.attn.wq_a, QuantizedLinear)
    prompt = _prompt(compressed.engine.runner.config.vocab_size, 40, seed=3)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    seq, ours = _captured(compressed, prompt, params)
    seq_ref, ref = _captured(expanded, prompt, params)
    assert seq == seq_ref and ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < ATOL
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = LLM(path, **{k: v for k, v in kw.items() if k != "speculative_config"})
    want = plain.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0].outputs[0].token_ids
    got = compressed.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
    assert compressed.engine.stats["spec_draft_tokens"] > 0

"""CPU weight prepacking: the prepacked oneDNN path is taken only where the CPU supports it for
the weight's dtype (model_executor.layers.packing_supported decides); elsewhere models keep plain
F.linear weights, so every dtype loads on every x86 CPU (bfloat16 packing needs AVX-512 or
AVX-NE-CONVERT; AVX2-only CPUs such as AMD Zen 3 raised at load before)."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from hybridkv import LLM, SamplingParams
from hybridkv.model_executor import layers
from hybridkv.model_executor.layers import PackedLinearWeight, cpu_supports_prepack, pack_linear_weights
from tiny_deepseek_v4 import build_v4_checkpoint, single_thread

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def no_avx512(monkeypatch):
    """Pretend the CPU cannot prepack any dtype and has no native bfloat16/float16 compute
    (what an AVX2-only CPU such as AMD Zen 3 reports)."""
    asked: list[torch.dtype] = []

    def unsupported(dtype: torch.dtype) -> bool:
        asked.append(dtype)
        return False

    monkeypatch.setattr(layers, "cpu_supports_prepack", unsupported)
    monkeypatch.setattr(layers, "cpu_computes_natively", lambda dtype: dtype == torch.float32)
    monkeypatch.setattr(layers, "blocked_linear_for", lambda weight: None)  # AVX2: no blocked linear
    monkeypatch.setattr(layers, "amx_linear_for", lambda weight: None)  # nor AMX
    return asked


def _packed_linears(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.Linear) and isinstance(m.__dict__.get("forward"), PackedLinearWeight)]


def test_probe_agrees_with_packing_on_this_cpu():
    """The cached probe is the ground truth: it says yes exactly when packing a weight works here."""
    for dtype in (torch.float32, torch.bfloat16):
        try:
            PackedLinearWeight(torch.randn(16, 8, dtype=dtype))(torch.randn(2, 8, dtype=dtype))
            works = True
        except RuntimeError:
            works = False
        assert cpu_supports_prepack(dtype) == works, dtype
    assert layers.packing_supported(torch.zeros(4, 4, dtype=torch.float16)) is False  # oneDNN packing is not used for fp16


def test_unsupported_cpu_keeps_plain_linear_and_logs_it(no_avx512, monkeypatch, caplog):
    """No prepacking, but native bfloat16 compute: plain F.linear."""
    monkeypatch.setattr(layers, "cpu_computes_natively", lambda dtype: True)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)).to(torch.bfloat16)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    want = model(x)
    with caplog.at_level(logging.INFO, logger="hybridkv.model_executor.layers"):
        assert pack_linear_weights(model) == 0
    assert not _packed_linears(model)
    assert torch.equal(model(x), want)
    assert "2 torch.bfloat16 layer(s) use plain F.linear" in caplog.text
    assert no_avx512 == [torch.bfloat16, torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_weights_without_native_compute_are_widened_for_many_rows(no_avx512, caplog, dtype):
    """No native half compute (Zen 3): weights stay in half precision; inputs of few rows take
    plain F.linear (bandwidth-bound, half the bytes), inputs of >= WIDEN_MIN_ROWS rows multiply
    in float32 and round once to the input dtype."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)).to(dtype)
    few = torch.randn(3, 8, dtype=dtype)
    many = torch.randn(2, layers.WIDEN_MIN_ROWS, 8, dtype=dtype)
    want_few = model(few)
    lin = model[0]
    want_many = nn.functional.linear(many.float(), lin.weight.float(), lin.bias.float()).to(dtype)
    with caplog.at_level(logging.INFO, logger="hybridkv.model_executor.layers"):
        assert pack_linear_weights(model) == 0
    assert all(isinstance(m.__dict__.get("forward"), layers.WidenedLinearWeight) for m in model)
    assert lin.weight.dtype == dtype  # kept in half precision
    assert torch.equal(model(few), want_few)
    assert torch.equal(lin(many), want_many) and lin(many).dtype == dtype
    assert f"2 {dtype} layer(s) kept in {dtype}, widened to float32" in caplog.text


@pytest.mark.skipif(not cpu_supports_prepack(torch.float32), reason="this CPU cannot prepack float32 weights")
def test_supported_dtype_is_prepacked_and_logged(caplog, monkeypatch):
    monkeypatch.setattr(layers, "blocked_linear_for", lambda weight: None)  # as on an AVX2 CPU
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    x = torch.randn(3, 8)
    want = model(x)
    with caplog.at_level(logging.INFO, logger="hybridkv.model_executor.layers"):
        assert pack_linear_weights(model) == 2
    assert len(_packed_linears(model)) == 2
    torch.testing.assert_close(model(x), want)
    assert "2 torch.float32 layer(s) prepacked for oneDNN" in caplog.text


def test_bfloat16_llama_loads_and_generates_without_avx512(tiny_ckpt, no_avx512, caplog):
    """A tiny Llama in bfloat16 on a CPU that (pretends it) lacks AVX-512: it loads, no
    projection is prepacked, the projections and the logits matrix keep bfloat16 weights widened
    for prefill-sized inputs, and greedy generation matches the float32 run on its first token
    and is deterministic."""
    path = tiny_ckpt("llama")
    with caplog.at_level(logging.INFO, logger="hybridkv"):
        llm = LLM(path, dtype="bfloat16", max_model_len=128, max_num_seqs=2)
    model = llm.engine.runner.model
    assert llm.engine.runner.dtype == torch.bfloat16
    assert not _packed_linears(model) and isinstance(model._packed_logits, layers.WidenedLinearWeight)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.bfloat16 in no_avx512
    assert "widened to float32" in caplog.text
    prompts = [{"prompt_token_ids": [3, 17, 42, 99, 7]}, "the quick brown fox"]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in again]
    # The plain bfloat16 path computes the same model: its first greedy token matches float32's.
    ref = LLM(path, dtype="float32", max_model_len=128, max_num_seqs=2)
    want = ref.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids[0] for o in outs] == [o.outputs[0].token_ids[0] for o in want]


def test_deepseek_v4_goes_through_the_same_decision(tmp_path, no_avx512):
    """DeepSeek-V4 packs through pack_linear_weights, which asks the same packing_supported for
    each of its Linear layers (the CPU probe is consulted once per layer), and in bfloat16 on an
    unsupported CPU it loads and generates with plain weights."""
    path = build_v4_checkpoint(str(tmp_path / "v4"))
    with single_thread():
        llm = LLM(path, dtype="bfloat16", max_model_len=256, max_num_seqs=2)
        model = llm.engine.runner.model
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        assert linears and len(no_avx512) == len(linears)
        assert not _packed_linears(model)
        assert torch.bfloat16 in no_avx512
        out = llm.generate({"prompt_token_ids": list(range(3, 40))}, GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 6


@pytest.mark.slow
def test_demo_model_loads_in_bfloat16_on_this_cpu():
    """No monkeypatching: whatever this CPU supports, LLM(dtype="bfloat16") loads the demo model
    and generates (before, AVX2-only CPUs raised mkldnn_reorder_linear_weight at load)."""
    llm = LLM(dtype="bfloat16", max_model_len=256, max_num_seqs=2)
    assert llm.engine.runner.dtype == torch.bfloat16
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert 1 <= len(out.outputs[0].token_ids) <= 4 and out.outputs[0].text


@pytest.mark.skipif(layers.blocked_linear_for(torch.zeros(1, 1)) is None,
                    reason="the blocked linear serves AVX-512 CPUs with a compiler")
def test_float32_weights_take_the_blocked_linear_on_avx512_and_it_is_logged(caplog):
    """On an AVX-512 CPU float32 projections (and the logits matrix) go through the column-block
    kernel instead of a oneDNN copy, and compute F.linear."""
    model = nn.Sequential(nn.Linear(8, 40), nn.Linear(40, 4, bias=False))
    x = torch.randn(2, 3, 8)
    want = model(x)
    with caplog.at_level(logging.INFO, logger="hybridkv.model_executor.layers"):
        assert pack_linear_weights(model) == 2
    assert all(isinstance(m.__dict__.get("forward"), layers.BlockedLinearWeight) for m in model)
    assert not _packed_linears(model), "no oneDNN copy beside the blocks"
    torch.testing.assert_close(model(x), want)
    assert "2 torch.float32 layer(s) in column blocks" in caplog.text


def test_an_untied_head_is_packed_once(tiny_ckpt):
    """The logits of an untied head (an nn.Linear, which pack_linear_weights packs) go through
    that same packed copy, not a second one of vocab x hidden."""
    llm = LLM(tiny_ckpt("llama"), dtype="float32", max_model_len=128)
    model = llm.engine.runner.model
    assert model.lm_head is not None, "the tiny llama checkpoint is untied"
    packed = model.lm_head.__dict__.get("forward")
    if packed is None:
        pytest.skip("no packed linear for float32 on this CPU")
    assert model._packed_logits is packed
    hidden = torch.randn(3, model.config.hidden_size)
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ model.lm_head.weight.t(), rtol=1e-5, atol=1e-4)


def test_a_prefill_chunk_that_samples_no_row_runs_in_bfloat16(tiny_ckpt):
    """A middle prefill chunk samples nothing, so the last layer's MLP gets 0 rows: the fused
    bfloat16 SiLU path must handle them (a -1 in a 0-element view is ambiguous), and the chunked
    prompt gives the greedy tokens of the whole one."""
    from hybridkv.entrypoints import LLM, SamplingParams

    prompt = {"prompt_token_ids": list(range(5, 30))}
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    path = tiny_ckpt("llama")
    whole = LLM(path, dtype="bfloat16", max_model_len=128).generate(prompt, greedy, use_tqdm=False)
    chunked = LLM(path, dtype="bfloat16", max_model_len=128, max_num_batched_tokens=7).generate(prompt, greedy,
                                                                                                use_tqdm=False)
    assert chunked[0].outputs[0].token_ids == whole[0].outputs[0].token_ids

"""fused_decode: a step of decodes runs every Llama-family (or Gemma 3) layer in one C++ call and
gives the layer-by-layer path's logits bit for bit; steps and models it cannot run exactly as the
layers would (prefill chunks, an activation it does not have, the off switch) go layer by layer."""
import pytest
import torch

from hybridkv.entrypoints import LLM, SamplingParams
from hybridkv.model_executor import fused_decode
from hybridkv.model_executor.fused_decode import FusedDecode

from fused_decode_cases import FUSED_DECODE_CASES


def _logits(llm: LLM, prompts: list[list[int]], max_tokens: int, fused: bool) -> list[torch.Tensor]:
    """Every logits row per prompt (the prompt's rows, then one per decode step), with the
    model's fused decode on or off."""
    model, runner = llm.engine.runner.model, llm.engine.runner
    saved = model._fused_decode
    model._fused_decode = saved if fused else None
    runner.captured_logits = {}
    try:
        llm.reset_prefix_cache()
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
        return [torch.cat(c) for _, c in sorted(runner.captured_logits.items())]
    finally:
        runner.captured_logits = None
        model._fused_decode = saved


CASES = FUSED_DECODE_CASES


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_steps_give_the_layer_by_layer_logits_bit_for_bit(tiny_ckpt, monkeypatch, case, dtype):
    arch, overrides = CASES[case]
    llm = LLM(tiny_ckpt(arch, **overrides), dtype=dtype, max_model_len=256)
    if llm.engine.runner.model._fused_decode is None:
        pytest.skip(f"no fused decode for {dtype} on this CPU (its linears are not the blocked kernels)")
    if "two block spaces" in case or "two RoPE tables" in case:
        assert len({layer.self_attn.space for layer in llm.engine.runner.model.layers}) == 2
    if "two RoPE tables" in case:
        assert len(llm.engine.runner.model._fused_decode.rope_keys) == 2
    calls = []
    original = FusedDecode.__call__
    monkeypatch.setattr(FusedDecode, "__call__", lambda self, *a: calls.append(1) or original(self, *a))
    g = torch.Generator().manual_seed(3)
    vocab = llm.engine.runner.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (9, 40, 70)]
    fused = _logits(llm, prompts, 12, fused=True)
    assert len(calls) == 11, f"one fused call per decode-only step (11), got {len(calls)}: prefill steps must not take it"
    layers = _logits(llm, prompts, 12, fused=False)
    assert len(calls) == 11
    for prompt, f, ref in zip(prompts, fused, layers):
        assert f.shape == ref.shape == (len(prompt) + 11, vocab)
        assert torch.equal(f, ref), "the fused decode changed the logits"


def test_models_and_switches_the_fused_decode_does_not_take(tiny_ckpt, monkeypatch):
    """A Gemma 3 whose MLP gate is exact GELU (not GELU-tanh) is not in decode_layers.cpp: layer by
    layer. HYBRIDKV_FUSED_DECODE=0 turns it off for a model it would take."""
    exact_gelu = LLM(tiny_ckpt("gemma3_text", hidden_activation="gelu"), dtype="float32", max_model_len=128)
    assert exact_gelu.engine.runner.model._fused_decode is None
    llm = LLM(tiny_ckpt("llama"), dtype="float32", max_model_len=128)
    if llm.engine.runner.model._fused_decode is None:
        pytest.skip("no fused decode for float32 on this CPU")
    monkeypatch.setenv(fused_decode.ENV_SWITCH, "0")
    assert FusedDecode.for_model(llm.engine.runner.model) is None


def test_the_fused_kernel_refuses_lists_that_do_not_match_its_layers(tiny_ckpt):
    llm = LLM(tiny_ckpt("llama"), dtype="float32", max_model_len=128)
    fused = llm.engine.runner.model._fused_decode
    if fused is None:
        pytest.skip("no fused decode for float32 on this CPU")
    one = torch.zeros(1, dtype=torch.int32)
    rope = (torch.zeros(1, 1, 16), torch.zeros(1, 1, 16))

    def call(weights, tables, windows, layer_space, ids=torch.zeros(1, dtype=torch.long), context_lens=one,
             ropes=rope, layer_rope=(0, 0)):
        fused.op(ids, fused.embedding, fused.kernels, weights, fused.out_features, [one] * 4, tables, windows,
                 layer_space, context_lens, list(ropes), list(layer_rope), 4, 2, 16, 16, 0.25, 1e-6,
                 fused.final_norm, 1e-6, False, 1.0)

    with pytest.raises(RuntimeError, match="per-layer lists"):
        call(fused.weights[:-1], [one, one], [-1], [0, 0])
    with pytest.raises(RuntimeError, match="per-space lists"):
        call(fused.weights, [one], [-1], [0, 0])
    with pytest.raises(RuntimeError, match="block space 1 is not one of 1"):
        call(fused.weights, [one, one], [-1], [0, 1])
    with pytest.raises(RuntimeError, match="ids must be"):
        call(fused.weights, [one, one], [-1], [0, 0], ids=one)
    with pytest.raises(RuntimeError, match="context_lens must be"):  # one per row, int32
        call(fused.weights, [one, one], [-1], [0, 0], context_lens=torch.ones(2, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="ropes .cos, sin per table. and layer_rope"):
        call(fused.weights, [one, one], [-1], [0, 0], ropes=rope[:1])
    with pytest.raises(RuntimeError, match="ropes .cos, sin per table. and layer_rope"):
        call(fused.weights, [one, one], [-1], [0, 0], layer_rope=(0,))
    with pytest.raises(RuntimeError, match="RoPE table 1 is not one of 1"):
        call(fused.weights, [one, one], [-1], [0, 0], layer_rope=(0, 1))
    with pytest.raises(RuntimeError, match="no layers"):
        call([], [one, one], [-1], [], layer_rope=())


def test_a_step_with_host_tier_load_backs_goes_layer_by_layer(tiny_ckpt, monkeypatch):
    """Host-tier load-backs (meta.kv_loads) are waited for inside each layer's attention: a step
    that carries them is not one the fused call may take, even when it is all decodes."""
    llm = LLM(tiny_ckpt("llama"), dtype="float32", max_model_len=128)
    fused = llm.engine.runner.model._fused_decode
    if fused is None:
        pytest.skip("no fused decode for float32 on this CPU")
    seen = []
    original = FusedDecode.takes
    monkeypatch.setattr(FusedDecode, "takes", lambda self, h, meta: seen.append((h, meta)) or original(self, h, meta))
    llm.generate([{"prompt_token_ids": [3, 17, 42, 99, 7]}],
                 SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    hidden, meta = seen[-1]  # a decode step's
    assert fused.takes(hidden, meta), "a plain decode step must be taken"
    meta.kv_loads = object()
    assert not fused.takes(hidden, meta), "a step with load-backs must go layer by layer"

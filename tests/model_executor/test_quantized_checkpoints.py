"""Block-quantized checkpoints as they are released load, stay compressed, and compute the
model transformers computes on the same weights dequantized.

The reference weights come from `reference_dequantize` below, written independently of
hybridkv's codecs (torch's own float8 conversion, a 16-entry e2m1 table, 2**(e - 127) for
ue8m0, blocks expanded with repeat_interleave), and transformers runs them in float32.
"""
from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridkv.engine.sampling_params import SamplingParams
from hybridkv.entrypoints import LLM
from hybridkv.model_executor.quantization import QuantizedLinear, quantized_linears, weight_memory_bytes
from tiny_deepseek_v4 import single_thread
from tiny_quantized import build_hf_fp8_checkpoint, build_release_v4_checkpoint, dense_config, hf_name_of_release

ATOL = 1e-4
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
SCALE_SUFFIXES = (".weight_scale_inv", ".scale")


# --------------------------------------------------------------------------- the reference


def reference_dequantize(weight: torch.Tensor, scale: torch.Tensor, fp8_block=(128, 128)) -> torch.Tensor:
    """float32 weight from a checkpoint (codes, scale) pair, by the format's definition."""
    if weight.dtype == torch.float8_e4m3fn:
        values, (br, bc) = weight.float(), fp8_block
    else:  # MXFP4: e2m1 codes, two per byte, low nibble first; one scale per 32 along K
        b = weight.view(torch.uint8).long()
        values, (br, bc) = torch.stack((E2M1[b & 15], E2M1[b >> 4]), dim=-1).flatten(-2), (1, 32)
    if scale.dtype == torch.float8_e8m0fnu:
        s = torch.exp2(scale.view(torch.uint8).float() - 127.0)
    else:
        s = scale.float()
    rows, cols = values.shape
    s = s.repeat_interleave(br, dim=0)[:rows].repeat_interleave(bc, dim=1)[:, :cols]
    return values * s


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, f)))
    return tensors


def reference_state(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a quantized checkpoint, dense: each (weight, scale) pair dequantized."""
    raw = read_checkpoint(path)
    dense = {}
    for name, t in raw.items():
        if name.endswith(SCALE_SUFFIXES):
            continue
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        scale = next((raw[module + s] for s in SCALE_SUFFIXES if module and module + s in raw), None)
        dense[name] = reference_dequantize(t, scale) if scale is not None else t
    return dense


def v4_reference_folder(quantized: str, dst: str) -> str:
    """transformers-loadable folder (save_pretrained names, no quantization) of the dequantized weights."""
    os.makedirs(dst, exist_ok=True)
    state = {hf_name_of_release(n): (t.long() if n.endswith("tid2eid") else t.float()).contiguous()
             for n, t in reference_state(quantized).items() if ".mtp." not in f".{n}"}
    save_file(state, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(quantized, "config.json")) as f:
        config = dense_config(json.load(f))
    config["torch_dtype"] = "float32"
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def dense_reference_folder(quantized: str, dst: str) -> str:
    """The dequantized checkpoint of a dense architecture, same names, tokenizer copied."""
    shutil.copytree(quantized, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({n: t.float().contiguous() for n, t in reference_state(quantized).items()},
              os.path.join(dst, "model.safetensors"))
    with open(os.path.join(quantized, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config")
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


# --------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True)
def _one_thread():
    with single_thread():
        yield


def _prompt(n: int, vocab: int, seed: int = 1) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine_logits(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[torch.Tensor, list[int]]:
    runner = llm.engine.runner
    runner.captured_logits = {}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    (chunks,) = runner.captured_logits.values()
    runner.captured_logits = None
    return torch.cat(chunks), out.outputs[0].token_ids


def _hf_logits(folder: str, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module")
def v4_release(tmp_path_factory):
    """(expert_dtype, naming) -> quantized checkpoint folder (built once per module)."""
    built: dict[tuple[str, str], str] = {}

    def get(expert_dtype: str = "fp4", naming: str = "original") -> str:
        key = (expert_dtype, naming)
        if key not in built:
            built[key] = build_release_v4_checkpoint(
                str(tmp_path_factory.mktemp(f"v4_{expert_dtype}_{naming}")), expert_dtype, naming)
        return built[key]

    return get


# --------------------------------------------------------------------------- DeepSeek-V4


@pytest.mark.parametrize("expert_dtype,naming", [("fp4", "original"), ("fp8", "original"), ("fp4", "hf")])
def test_release_v4_logits_equal_transformers_on_dequantized_weights(v4_release, tmp_path, expert_dtype, naming):
    """FP8 projections + MXFP4 (or FP8) experts, original (`.scale`, ue8m0) or HF
    (`weight_scale_inv`, float32) naming, two shards: every position's logits (prefill past an
    HCA-128 window, then decode) equal transformers' on the reference-dequantized weights."""
    path = v4_release(expert_dtype, naming)
    llm = LLM(path, dtype="float32", max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64)
    model = llm.engine.runner.model
    experts = model.layers[1].ffn.experts[0]
    assert isinstance(experts.w1, QuantizedLinear) and isinstance(model.layers[0].attn.wo_a, QuantizedLinear)
    want_expert = "MXFP4" if expert_dtype == "fp4" else "FP8"
    assert experts.w1.format_names[0].startswith(want_expert)
    assert not isinstance(model.layers[1].attn.compressor.wkv, QuantizedLinear)  # shipped BF16
    prompt = _prompt(150, model.cfg.vocab_size)
    logits, generated = _engine_logits(llm, prompt, max_tokens=5)
    ref = _hf_logits(v4_reference_folder(path, str(tmp_path / "ref")), (prompt + generated)[:-1])
    assert logits.shape == ref.shape
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
    assert generated == ref[len(prompt) - 1 :].argmax(-1).tolist()


def test_dequantize_at_load_computes_the_same_model(v4_release, monkeypatch):
    """HYBRIDKV_DEQUANTIZE_WEIGHTS=1 expands every weight once at load (plain nn.Linear, no
    QuantizedLinear left) and gives the logits of the compressed model; the scheduler's cost
    model counts the compressed weights (buffers, not parameters) the same."""
    path = v4_release("fp4", "original")
    prompt = _prompt(40, 300, seed=2)
    compressed = LLM(path, dtype="float32", max_model_len=128, max_num_seqs=1)
    want, _ = _engine_logits(compressed, prompt, max_tokens=3)
    monkeypatch.setenv("HYBRIDKV_DEQUANTIZE_WEIGHTS", "1")
    expanded = LLM(path, dtype="float32", max_model_len=128, max_num_seqs=1)
    assert not list(quantized_linears(expanded.engine.runner.model))
    got, _ = _engine_logits(expanded, prompt, max_tokens=3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    monkeypatch.delenv("HYBRIDKV_DEQUANTIZE_WEIGHTS")
    by_option = LLM(path, dtype="float32", max_model_len=128, max_num_seqs=1, dequantize_weights=True)
    assert not list(quantized_linears(by_option.engine.runner.model)), "LLM(dequantize_weights=True) kept codes"
    assert compressed.engine.runner.step_cost == expanded.engine.runner.step_cost


def test_resident_weight_memory_is_the_checkpoint_size(v4_release, caplog):
    """Loaded in bfloat16 (the checkpoint's dtype), the model holds its weights in about the
    bytes the checkpoint's tensors take. The startup log names the FP8 / FP4 tensors and the
    weight memory."""
    path = v4_release("fp4", "original")
    files = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")]
    file_bytes = sum(os.path.getsize(f) for f in files)
    tensor_bytes = sum(t.nbytes for n, t in read_checkpoint(path).items() if not n.startswith("mtp."))
    with caplog.at_level(logging.INFO, logger="hybridkv"):
        llm = LLM(path, dtype="bfloat16", max_model_len=128, max_num_seqs=1)  # auto would be float32 without native bf16
    runner = llm.engine.runner
    assert runner.dtype == torch.bfloat16
    resident = weight_memory_bytes(runner.model)
    print(f"\nresident {resident} B, checkpoint tensors {tensor_bytes} B (excl. MTP), files {file_bytes} B")
    # The only growth: tid2eid (int32 on disk) is held as int64, FP8 block scales (one per
    # 16,384 weights) as float32 instead of ue8m0 bytes.
    assert tensor_bytes <= resident <= 1.02 * tensor_bytes
    assert resident <= file_bytes
    text = caplog.text
    assert "weights kept FP8 e4m3 (128x128 blocks, ue8m0 scales)" in text
    assert "layers.*.attn.wq_a (x4)" in text
    assert "weights kept MXFP4 e2m1 (1x32 groups, ue8m0 scales): 48 linear layer(s)" in text
    assert "layers.*.ffn.experts.*.w1 (x16)" in text
    assert "weight memory" in text and "checkpoint files" in text


def test_dequantized_memory_is_larger(v4_release, monkeypatch):
    """Dequantized at load, the same bfloat16 model holds its FP8 weights at 2 bytes and its
    FP4 experts at 2 bytes instead of 1 and 0.5 (plus scales)."""
    path = v4_release("fp4", "original")
    compressed = weight_memory_bytes(LLM(path, dtype="bfloat16", max_model_len=128, max_num_seqs=1).engine.runner.model)
    monkeypatch.setenv("HYBRIDKV_DEQUANTIZE_WEIGHTS", "1")
    dense = weight_memory_bytes(LLM(path, dtype="bfloat16", max_model_len=128, max_num_seqs=1).engine.runner.model)
    print(f"\nbfloat16 weight memory: compressed {compressed} B, dequantized at load {dense} B")
    assert dense > 1.5 * compressed


# --------------------------------------------------------------------------- HF fine-grained FP8


@pytest.fixture(scope="module")
def fp8_dense(tmp_path_factory):
    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in built:
            folder = str(tmp_path_factory.mktemp(f"fp8_{name}"))
            if name == "qwen3":  # tiny widths: every block partial, q/k/v shards kept apart
                built[name] = build_hf_fp8_checkpoint(folder, "qwen3")
            else:  # 128-multiples: q/k/v and gate/up merge into one quantized shard; FP8 head too
                built[name] = build_hf_fp8_checkpoint(
                    folder, "llama", quantize_lm_head=True, hidden_size=256, num_attention_heads=2,
                    num_key_value_heads=1, intermediate_size=384)
        return built[name]

    return get


@pytest.mark.parametrize("name,chunk", [("qwen3", None), ("qwen3", 7), ("llama", None)])
def test_hf_fp8_logits_equal_transformers_on_dequantized_weights(fp8_dense, tmp_path, name, chunk):
    path = fp8_dense(name)
    llm = LLM(path, dtype="float32", max_model_len=128, max_num_batched_tokens=chunk)
    model = llm.engine.runner.model
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear) and isinstance(model.layers[0].mlp.down_proj, QuantizedLinear)
    assert len(qkv.layout) == (3 if name == "qwen3" else 1)
    assert isinstance(model.lm_head, QuantizedLinear) == (name == "llama")
    prompt = _prompt(50, model.config.vocab_size, seed=3)
    logits, generated = _engine_logits(llm, prompt, max_tokens=8)
    ref = _hf_logits(dense_reference_folder(path, str(tmp_path / "ref")), (prompt + generated)[:-1])
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
    assert generated == ref[len(prompt) - 1 :].argmax(-1).tolist()


def test_step_cost_counts_quantized_weights_like_dense_ones(fp8_dense, tmp_path):
    path = fp8_dense("llama")
    dense = dense_reference_folder(path, str(tmp_path / "dense"))
    q = LLM(path, dtype="float32", max_model_len=64).engine.runner
    d = LLM(dense, dtype="float32", max_model_len=64).engine.runner
    assert q.model.token_params() == d.model.token_params()
    assert q.model.logits_params() == d.model.logits_params()


# --------------------------------------------------------------------------- broken checkpoints


def _rewrite(src: str, dst: str, edit_tensors=None, edit_config=None) -> str:
    shutil.copytree(src, dst)
    if edit_tensors is not None:
        path = os.path.join(dst, "model.safetensors")
        tensors = load_file(path)
        edit_tensors(tensors)
        save_file(tensors, path)
    if edit_config is not None:
        with open(os.path.join(dst, "config.json")) as f:
            config = json.load(f)
        edit_config(config)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(config, f)
    return dst


Q_PROJ = "model.layers.0.self_attn.q_proj"


def test_missing_scale_names_the_weight(fp8_dense, tmp_path):
    path = _rewrite(fp8_dense("qwen3"), str(tmp_path / "c"), edit_tensors=lambda t: t.pop(Q_PROJ + ".weight_scale_inv"))
    with pytest.raises(ValueError, match=rf"missing the block scale of 1 quantized weight\(s\): '{Q_PROJ}.weight'"):
        LLM(path, dtype="float32", max_model_len=64)


def test_scale_of_the_wrong_shape_names_the_scale_and_the_expected_shape(fp8_dense, tmp_path):
    def edit(t):
        t[Q_PROJ + ".weight_scale_inv"] = torch.ones(2, 1)

    path = _rewrite(fp8_dense("qwen3"), str(tmp_path / "c"), edit_tensors=edit)
    with pytest.raises(ValueError, match=rf"block scale '{Q_PROJ}.weight_scale_inv' has shape \(2, 1\).*"
                                         r"\[64, 64\] in 128x128 FP8 blocks needs scale shape \[1, 1\]"):
        LLM(path, dtype="float32", max_model_len=64)


@pytest.mark.parametrize("field,value,message", [
    ("fmt", "e5m2", r"fmt='e5m2'.*supported: 'e4m3'"),
    ("quant_method", "awq", r"quant_method='awq'; hybridkv loads only 'fp8'"),
    ("scale_fmt", "e4m3", r"scale_fmt='e4m3'.*supported: unset, 'float', 'ue8m0'"),
    ("activation_scheme", "static", r"activation_scheme='static'"),
    ("weight_block_size", [128], r"weight_block_size=\[128\]"),
])
def test_unsupported_quantization_config_is_refused_before_loading(fp8_dense, tmp_path, field, value, message):
    def edit(config):
        config["quantization_config"][field] = value

    path = _rewrite(fp8_dense("qwen3"), str(tmp_path / "c"), edit_config=edit)
    with pytest.raises(ValueError, match=message):
        LLM(path, dtype="float32", max_model_len=64)


def test_quantized_weights_without_quantization_config_are_refused(fp8_dense, tmp_path):
    path = _rewrite(fp8_dense("qwen3"), str(tmp_path / "c"), edit_config=lambda c: c.pop("quantization_config"))
    with pytest.raises(ValueError, match=r"is stored as torch.float8_e4m3fn, a quantized format, but config.json "
                                         r"has no quantization_config|is an FP8 block scale, but config.json has no"):
        LLM(path, dtype="float32", max_model_len=64)


def test_fp8_nan_codes_are_refused(fp8_dense, tmp_path):
    def edit(t):
        w = t[Q_PROJ + ".weight"].view(torch.uint8).clone()
        w[0, 0] = 0x7F
        t[Q_PROJ + ".weight"] = w.view(torch.float8_e4m3fn)

    path = _rewrite(fp8_dense("qwen3"), str(tmp_path / "c"), edit_tensors=edit)
    with pytest.raises(ValueError, match=rf"'{Q_PROJ}.weight' holds 1 FP8 NaN code"):
        LLM(path, dtype="float32", max_model_len=64)


def test_fused_projection_with_mixed_formats_is_refused(fp8_dense, tmp_path):
    """q_proj FP8 but k_proj dense: qkv_proj cannot be half compressed."""
    def edit(t):
        k = "model.layers.0.self_attn.k_proj"
        t[k + ".weight"] = t[k + ".weight"].float() * t.pop(k + ".weight_scale_inv")[0, 0]

    path = _rewrite(fp8_dense("qwen3"), str(tmp_path / "c"), edit_tensors=edit)
    with pytest.raises(ValueError, match=r"'layers.0.self_attn.qkv_proj' is fused from checkpoint weights stored in "
                                         r"different formats"):
        LLM(path, dtype="float32", max_model_len=64)

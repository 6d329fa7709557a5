"""Quantized checkpoints as users reach them: `hybridkv serve` and `hybridkv generate` on a folder of
FP8 block-scaled weights (HF's fine-grained format) and on DeepSeek-V4 as released (FP8
projections, MXFP4 experts), with no extra option: the server answers with the same greedy
tokens as the offline LLM on the same folder, and generate's startup log names what stayed
compressed. (Numerics against transformers: tests/model_executor/test_quantized_checkpoints.py.)"""
from __future__ import annotations

import logging

import pytest
import torch

from hybridkv.entrypoints.cli import main
from hybridkv.entrypoints.llm import LLM
from hybridkv.engine.sampling_params import SamplingParams
from server_harness import MODEL, launch
from tiny_quantized import build_hf_fp8_checkpoint, build_release_v4_checkpoint


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    return {
        "hf_fp8_qwen3": build_hf_fp8_checkpoint(str(tmp_path_factory.mktemp("fp8_qwen3")), "qwen3"),
        "v4_release_fp4": build_release_v4_checkpoint(str(tmp_path_factory.mktemp("v4_fp4")), expert_dtype="fp4"),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf_fp8_qwen3", "v4_release_fp4"])
def test_serve_answers_with_the_offline_greedy_tokens(quantized, name):
    path = quantized[name]
    prompt = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    want = LLM(path, dtype="float32", max_model_len=256, max_num_seqs=4).generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].token_ids
    srv = launch(path, api_key=None, dtype="float32")
    try:
        client = srv.client()
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        assert got.usage.completion_tokens == 6
        ids = got.choices[0].model_extra["token_ids"]
        assert ids == list(want), f"served {ids}, offline {list(want)}"
        client.close()
        srv.engine.check_idle()
    finally:
        srv.stop()


def test_generate_on_an_fp8_folder_logs_what_stayed_compressed(quantized, capsys, caplog):
    with caplog.at_level(logging.INFO, logger="hybridkv"):
        rc = main(["generate", "hello there", "--model", quantized["hf_fp8_qwen3"], "--max-tokens", "3"])
    assert rc == 0
    assert "### hello there" in capsys.readouterr().out
    assert "weights kept FP8 e4m3 (128x128 blocks" in caplog.text and "weight memory" in caplog.text

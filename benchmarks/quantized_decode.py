"""Decode tok/s of a block-quantized checkpoint kept compressed vs the same model dense.

Builds one model in HF's fine-grained FP8 format (Llama layout, every projection FP8 e4m3 with
128x128 float32 block scales; `--model v4`: a DeepSeek-V4 release-format checkpoint, FP8
projections + MXFP4 experts) and the same weights dequantized into a dense checkpoint, then
times single-sequence greedy decode steps of

  dense fp32        the dequantized checkpoint in float32 (the baseline of the ratios)
  dense bf16        the same in bfloat16
  FP8 fp32          the quantized checkpoint, weights kept compressed, float32 activations
  FP8 bf16          the same with bfloat16 activations
  FP8 expanded      the quantized checkpoint dequantized once at load (HYBRIDKV_DEQUANTIZE_WEIGHTS=1)

Variants are measured in interleaved rounds in one process (this VM's speed drifts between
runs), reported as the median over rounds, with the weight memory each one holds and the
memory a fresh process grows by when it loads that variant (after, and at the peak). Nothing is
asserted: the figures are what this CPU does (its model name is printed; on an AVX2-only CPU
such as AMD Zen 3 bfloat16 matmuls have no native instructions).

    python benchmarks/quantized_decode.py [--model llama|v4] [--hidden 1024] [--layers 8]
                                          [--steps 24] [--rounds 3] [--threads 1]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from hybridkv.engine.sampling_params import SamplingParams  # noqa: E402
from hybridkv.entrypoints import LLM  # noqa: E402
from hybridkv.model_executor.checkpoint import iter_weights, weight_files  # noqa: E402
from hybridkv.cpu_features import cpu_features  # noqa: E402
from hybridkv.model_executor.quantization import (  # noqa: E402
    attach_block_scales, checkpoint_bytes, parse_quantization_config, weight_memory_bytes,
)

PROMPT_TOKENS = 32


def build_quantized(path: str, model: str, hidden: int, layers: int) -> str:
    if model == "llama":
        from tiny_quantized import build_hf_fp8_checkpoint

        return build_hf_fp8_checkpoint(
            path, "llama", hidden_size=hidden, intermediate_size=hidden * 11 // 4 // 128 * 128,
            num_hidden_layers=layers, num_attention_heads=hidden // 128, num_key_value_heads=max(1, hidden // 512),
            head_dim=128, max_position_embeddings=1024)
    from tiny_quantized import build_release_v4_checkpoint

    return build_release_v4_checkpoint(
        path, "fp4", "original", num_shards=1, hidden_size=hidden, num_hidden_layers=layers,
        compress_ratios=[0, 4, 128, 4][:layers] + [0] * max(0, layers - 4) + [0], moe_intermediate_size=hidden // 2,
        n_routed_experts=8, num_attention_heads=8, head_dim=128, qk_rope_head_dim=32, q_lora_rank=hidden // 2,
        o_lora_rank=hidden // 4, index_head_dim=64, sliding_window=128)


def build_dense_copy(quantized: str, path: str) -> str:
    """The same weights dequantized (float32), config without quantization, tokenizer copied."""
    import shutil

    shutil.copytree(quantized, path, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    with open(os.path.join(quantized, "config.json")) as f:
        config = json.load(f)
    quant = parse_quantization_config(config.pop("quantization_config"), config.pop("expert_dtype", None))
    tensors = {name: t.contiguous() for name, t in attach_block_scales(iter_weights(quantized), quant, dequantize=True)}
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


@contextlib.contextmanager
def env(name: str, value: str | None):
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


_RSS_PROBE = """
import sys, torch
import transformers, safetensors.torch  # imported before the baseline: not the model's memory
from transformers import AutoConfig
from hybridkv.model_executor.model_runner import ModelRunner
from hybridkv.model_executor.models import registry
AutoConfig.from_pretrained(sys.argv[1], local_files_only=True)
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * 4096
def peak():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM:'):
            return int(line.split()[1]) * 1024
with open('/proc/self/clear_refs', 'w') as f:  # Linux: "5" resets the peak RSS (VmHWM)
    f.write('5')
before = rss()
runner = ModelRunner(sys.argv[1], dtype=sys.argv[2], max_model_len=256)
print(before, rss(), peak())
"""


def load_rss(folder: str, dtype: str, dequantize: bool = False) -> tuple[int, int]:
    """(RSS growth after load, peak RSS growth during load) of loading `folder` in a fresh process."""
    import subprocess

    environment = dict(os.environ, HYBRIDKV_DEQUANTIZE_WEIGHTS="1" if dequantize else "0")
    out = subprocess.run([sys.executable, "-c", _RSS_PROBE, folder, dtype], capture_output=True, text=True,
                         env=environment, check=True).stdout.split()
    before, after, peak = (int(v) for v in out[-3:])
    return after - before, peak - before


def decode_tok_s(llm: LLM, steps: int, seed: int) -> float:
    """Prefill a short prompt, then time `steps` single-sequence decode steps."""
    eng = llm.engine
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, eng.runner.config.vocab_size, (PROMPT_TOKENS,), generator=g).tolist()
    eng.add_request(f"r{seed}", {"prompt_token_ids": prompt},
                    SamplingParams(temperature=0, max_tokens=steps + 3, ignore_eos=True))
    req = eng.scheduler.waiting[0]
    while req.num_output_tokens < 2:  # prefill + one warm decode step
        eng.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    dt = time.perf_counter() - t0
    while eng.has_unfinished_requests():
        eng.step()
    return steps / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["llama", "v4"], default="llama")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        quantized = build_quantized(os.path.join(tmp, "fp8"), args.model, args.hidden, args.layers)
        dense = build_dense_copy(quantized, os.path.join(tmp, "dense"))
        print(f"built {args.model} hidden={args.hidden} layers={args.layers} in {time.perf_counter() - t0:.0f}s; "
              f"files: quantized {checkpoint_bytes(weight_files(quantized)) / 2**20:.1f} MiB, "
              f"dense fp32 {checkpoint_bytes(weight_files(dense)) / 2**20:.1f} MiB")
        kw = dict(max_model_len=256, max_num_seqs=1)
        variants = {
            "dense fp32": lambda: LLM(dense, dtype="float32", **kw),
            "dense bf16": lambda: LLM(dense, dtype="bfloat16", **kw),
            "FP8 fp32": lambda: LLM(quantized, dtype="float32", **kw),
            "FP8 bf16": lambda: LLM(quantized, dtype="bfloat16", **kw),
        }
        llms = {name: make() for name, make in variants.items()}
        with env("HYBRIDKV_DEQUANTIZE_WEIGHTS", "1"):
            llms["FP8 expanded fp32"] = LLM(quantized, dtype="float32", **kw)
        memory = {name: weight_memory_bytes(llm.engine.runner.model) for name, llm in llms.items()}
        speeds: dict[str, list[float]] = {name: [] for name in llms}
        for r in range(args.rounds):
            for name, llm in llms.items():
                speeds[name].append(decode_tok_s(llm, args.steps, seed=r))
        del llms
        rss = {
            "dense fp32": load_rss(dense, "float32"),
            "dense bf16": load_rss(dense, "bfloat16"),
            "FP8 fp32": load_rss(quantized, "float32"),
            "FP8 bf16": load_rss(quantized, "bfloat16"),
            "FP8 expanded fp32": load_rss(quantized, "float32", dequantize=True),
        }

    print(f"CPU: {cpu_features().describe()}, torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{args.threads} thread(s); {args.steps} decode steps x {args.rounds} rounds, batch 1")
    base = statistics.median(speeds["dense fp32"])
    bf16 = statistics.median(speeds["dense bf16"])
    print(f"{'variant':<20}{'tok/s':>9}{'vs fp32':>9}{'vs bf16':>9}{'weights MiB':>13}{'RSS +MiB':>10}"
          f"{'peak +MiB':>11}")
    for name, values in speeds.items():
        tok_s = statistics.median(values)
        grown, peak = rss[name]
        print(f"{name:<20}{tok_s:9.2f}{tok_s / base:8.2f}x{tok_s / bf16:8.2f}x{memory[name] / 2**20:13.1f}"
              f"{grown / 2**20:10.1f}{peak / 2**20:11.1f}")
    print("weights = parameters + buffers the model holds; RSS / peak = process memory growth after / during "
          "the load (fresh process, includes the fp32 oneDNN-packed copies of dense weights)")
    fp8 = statistics.median(speeds["FP8 fp32"])
    print(f"RESULT fp8_vs_fp32={fp8 / base:.3f} fp8_vs_bf16={fp8 / bf16:.3f} "
          f"memory_fp8_vs_fp32={memory['FP8 fp32'] / memory['dense fp32']:.3f}")


if __name__ == "__main__":
    main()

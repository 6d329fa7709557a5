"""Tensor parallelism against one process on the same machine, in the same sitting: the same
greedy workload (prompts decoded together) with tensor_parallel_size=1 and =2, tokens checked
equal, throughput of each, and where the two-rank step's time goes: rank 0's seconds in the
forward's collectives (all-reduces, the logits gather) and in the step's broadcast of the batch
and its KV plan, per step. On a 2-core machine two ranks share the cores one process would
use, so two ranks are expected to be slower; the figure says how much the communication costs.

    python benchmarks/tensor_parallel.py [--layers 8] [--hidden 512] [--prompts 4] [--tokens 32]

A Llama-shaped float32 checkpoint with random weights is built in a temporary folder (the demo
model's 9 attention heads do not split over 2 ranks). The last line is machine-readable:
    RESULT tp1_tok_s=<f> tp2_tok_s=<f> ratio=<tp2/tp1> comm_ms_per_step=<f> broadcast_ms_per_step=<f>
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from hybridkv import LLM, SamplingParams  # noqa: E402


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "unknown CPU")


def run(path: str, tp: int, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], float, dict]:
    llm = LLM(path, dtype="float32", max_model_len=1024, tensor_parallel_size=tp, num_scheduler_steps=1)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:1]], SamplingParams(max_tokens=2), use_tqdm=False)
    runner = llm.engine.runner
    comm = getattr(getattr(runner, "driver", runner), "parallel", None)
    before = (comm.comm.seconds if comm else 0.0, getattr(getattr(runner, "workers", None), "broadcast_seconds", 0.0))
    steps0 = llm.engine.stats["steps"]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    steps = llm.engine.stats["steps"] - steps0
    after = (comm.comm.seconds if comm else 0.0, getattr(getattr(runner, "workers", None), "broadcast_seconds", 0.0))
    detail = {"steps": steps, "comm_s": after[0] - before[0], "broadcast_s": after[1] - before[1]}
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], wall, detail


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args(argv)
    from tiny_checkpoints import build_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(os.path.join(tmp, "llama"), "llama", hidden_size=args.hidden,
                                intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                                num_attention_heads=8, num_key_value_heads=4)
        prompts = [[(37 * i + 11 * j) % 200 + 3 for i in range(args.prompt_tokens)] for j in range(args.prompts)]
        total = args.prompts * args.tokens
        ref, wall1, _ = run(path, 1, prompts, args.tokens)
        got, wall2, d = run(path, 2, prompts, args.tokens)
    assert got == ref, "two ranks gave other greedy tokens than one process"
    tps1, tps2 = total / wall1, total / wall2
    steps = max(1, d["steps"])
    print(f"{cpu_name()}; llama {args.layers} layers x {args.hidden}, float32; {args.prompts} prompts of "
          f"{args.prompt_tokens} tokens, {args.tokens} new tokens each (prefill included)")
    print(f"  1 process : {tps1:8.1f} tok/s")
    print(f"  2 ranks   : {tps2:8.1f} tok/s ({tps2 / tps1:.2f}x); per step {wall2 / steps * 1000:.1f} ms, of which "
          f"collectives {d['comm_s'] / steps * 1000:.1f} ms and the step broadcast "
          f"{d['broadcast_s'] / steps * 1000:.1f} ms (rank 0)")
    print(f"RESULT tp1_tok_s={tps1:.2f} tp2_tok_s={tps2:.2f} ratio={tps2 / tps1:.4f} "
          f"comm_ms_per_step={d['comm_s'] / steps * 1000:.3f} broadcast_ms_per_step={d['broadcast_s'] / steps * 1000:.3f}")


if __name__ == "__main__":
    main()

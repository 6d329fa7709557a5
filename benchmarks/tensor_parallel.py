"""Tensor parallelism against one process on the same machine, in the same sitting: the same
greedy workload (prompts decoded together) with tensor_parallel_size=1 and =2, tokens checked
equal, throughput of each, and where the two-rank step's time goes: rank 0's seconds in the
forward's collectives (all-reduces, the logits gather) and in the step's broadcast of the batch
and its KV plan, per step. On a 2-core machine two ranks share the cores one process would
use, so two ranks are expected to be slower; the figure says how much the communication costs.

    python benchmarks/tensor_parallel.py [--model llama|v4] [--layers 8] [--hidden 512] [--prompts 4] [--tokens 32]

A float32 checkpoint with random weights is built in a temporary folder (the demo model's 9
attention heads do not split over 2 ranks): Llama-shaped, or (--model v4) a DeepSeek-V4 with 8
routed experts, run a third time with expert parallelism (each rank holds 4 whole experts
instead of half of every expert). The last line is machine-readable:
    RESULT tp1_tok_s=<f> tp2_tok_s=<f> ratio=<tp2/tp1> comm_ms_per_step=<f> broadcast_ms_per_step=<f>
           [ep_tok_s=<f> ep_ratio=<ep/tp1> ep_comm_ms_per_step=<f>]
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
from cpu_info import cpu_name  # noqa: E402  (benchmarks/ is the script's folder)


def run(path: str, tp: int, prompts: list[list[int]], tokens: int, **kw) -> tuple[list[list[int]], float, dict]:
    llm = LLM(path, dtype="float32", max_model_len=1024, tensor_parallel_size=tp, num_scheduler_steps=1, **kw)
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


def build(tmp: str, args) -> tuple[str, str]:
    """The checkpoint's folder and a one-line description."""
    if args.model == "v4":
        from tiny_deepseek_v4 import build_v4_checkpoint

        path = build_v4_checkpoint(os.path.join(tmp, "v4"), hidden_size=args.hidden, num_hidden_layers=args.layers,
                                   layer_types=(["sliding_attention", "compressed_sparse_attention",
                                                 "heavily_compressed_attention"] * args.layers)[:args.layers],
                                   mlp_layer_types=["moe"] * args.layers, moe_intermediate_size=args.hidden,
                                   n_routed_experts=8, num_attention_heads=8, head_dim=64, q_lora_rank=args.hidden // 2,
                                   o_groups=4, o_lora_rank=64)
        return path, f"DeepSeek-V4 {args.layers} layers x {args.hidden}, 8 routed experts (2 per token)"
    from tiny_checkpoints import build_checkpoint

    path = build_checkpoint(os.path.join(tmp, "llama"), "llama", hidden_size=args.hidden,
                            intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                            num_attention_heads=8, num_key_value_heads=4)
    return path, f"llama {args.layers} layers x {args.hidden}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["llama", "v4"], default="llama")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        path, what = build(tmp, args)
        prompts = [[(37 * i + 11 * j) % 200 + 3 for i in range(args.prompt_tokens)] for j in range(args.prompts)]
        total = args.prompts * args.tokens
        ref, wall1, _ = run(path, 1, prompts, args.tokens)
        got, wall2, d = run(path, 2, prompts, args.tokens)
        ep = run(path, 2, prompts, args.tokens, enable_expert_parallel=True) if args.model == "v4" else None
    assert got == ref, "two ranks gave other greedy tokens than one process"
    assert ep is None or ep[0] == ref, "expert parallelism gave other greedy tokens than one process"
    tps1, tps2 = total / wall1, total / wall2
    steps = max(1, d["steps"])
    print(f"{cpu_name()}; {what}, float32; {args.prompts} prompts of {args.prompt_tokens} tokens, "
          f"{args.tokens} new tokens each (prefill included)")
    print(f"  1 process : {tps1:8.1f} tok/s")
    print(f"  2 ranks   : {tps2:8.1f} tok/s ({tps2 / tps1:.2f}x); per step {wall2 / steps * 1000:.1f} ms, of which "
          f"collectives {d['comm_s'] / steps * 1000:.1f} ms and the step broadcast "
          f"{d['broadcast_s'] / steps * 1000:.1f} ms (rank 0)")
    result = (f"RESULT tp1_tok_s={tps1:.2f} tp2_tok_s={tps2:.2f} ratio={tps2 / tps1:.4f} "
              f"comm_ms_per_step={d['comm_s'] / steps * 1000:.3f} broadcast_ms_per_step={d['broadcast_s'] / steps * 1000:.3f}")
    if ep is not None:
        _, wall3, d3 = ep
        tps3, steps3 = total / wall3, max(1, d3["steps"])
        print(f"  2 ranks EP: {tps3:8.1f} tok/s ({tps3 / tps1:.2f}x); per step {wall3 / steps3 * 1000:.1f} ms, of which "
              f"collectives {d3['comm_s'] / steps3 * 1000:.1f} ms")
        result += f" ep_tok_s={tps3:.2f} ep_ratio={tps3 / tps1:.4f} ep_comm_ms_per_step={d3['comm_s'] / steps3 * 1000:.3f}"
    print(result)


if __name__ == "__main__":
    main()

"""FP8 KV cache against the model-dtype cache on the demo model: accuracy and decode speed, one run.

Accuracy, teacher-forced: the source of a few stdlib modules (argparse, json, textwrap, by
default), tokenized and cut into --chunk-token prompts, each run once with prompt_logprobs=1 on
an engine with kv_cache_dtype="auto" and on one per FP8 format. Every position's top-1 token and
the log-probability of the text's actual next token are compared: next-token agreement (the top-1
tokens equal) and mean / max |delta logprob| over all positions.

Speed: greedy decode tokens/s at batch 1 and 32, prompts of --context tokens of the same text,
--decode-tokens generated each, engines alternating over --rounds rounds (best round each), the
decode time from the last first token to the last token (every prompt is prefilled in one step).

--tiny-v4 measures accuracy only, on a tiny random DeepSeek-V4 built in a temp dir (the test
suite's config: sliding, CSA, HCA and CSA layers; its swa, c4, c128 and indexer pools FP8, the
compressor state float32), with the same text through that checkpoint's tokenizer. Random weights
have flatter next-token distributions than a trained model, so its agreement is a lower bound on
what the kernels' rounding costs, not a model-quality figure.

Prints the CPU, a table, and a machine-readable last line:
    RESULT agree_fp8=<frac> dlogp_mean_fp8=<> dlogp_max_fp8=<> b1_ratio_fp8=<fp8/auto> b32_ratio_fp8=<...> ...

    python benchmarks/kv_cache_dtype.py [--dtype auto|bfloat16] [--formats fp8,fp8_e5m2] [--rounds 2]
    python benchmarks/kv_cache_dtype.py --tiny-v4 [--dtype float32|bfloat16]
"""
from __future__ import annotations

import argparse
import inspect
import importlib
import os
import sys
import tempfile

import hybridkv  # noqa: F401  (before torch: the OpenMP runtime the engine uses)
from hybridkv import LLM, SamplingParams
from cpu_info import cpu_name  # noqa: E402  (benchmarks/ is the script's folder)


def build_tiny_v4(tmp: str) -> str:
    """The test suite's tiny DeepSeek-V4 (tests/tiny_deepseek_v4.py), long enough for the chunks."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from tiny_deepseek_v4 import build_v4_checkpoint

    return build_v4_checkpoint(os.path.join(tmp, "v4"), max_position_embeddings=4096)


def corpus_tokens(llm: LLM, modules: list[str]) -> list[int]:
    text = "\n".join(inspect.getsource(importlib.import_module(m)) for m in modules)
    return llm.get_tokenizer().encode(text)


def teacher_forced(llm: LLM, chunks: list[list[int]]) -> list[tuple[int, float]]:
    """(top-1 token, logprob of the actual next token) at every position after each chunk's first."""
    llm.reset_prefix_cache()
    outs = llm.generate([{"prompt_token_ids": c} for c in chunks], SamplingParams(max_tokens=1, prompt_logprobs=1),
                        use_tqdm=False)
    rows = []
    for chunk, out in zip(chunks, outs):
        for token, entry in zip(chunk[1:], out.prompt_logprobs[1:]):
            top = next(t for t, lp in entry.items() if lp.rank == 1)
            rows.append((top, entry[token].logprob))
    return rows


def decode_rate(llm: LLM, prompts: list[list[int]], tokens: int) -> float:
    """Greedy decode tokens/s of the batch: from the step that gave the last first token to the end."""
    llm.reset_prefix_cache()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    start = max(o.metrics["first_token_time"] for o in outs)
    end = max(o.metrics["last_token_time"] for o in outs)
    return len(outs) * (tokens - 1) / (end - start)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the built-in demo model")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--formats", default="fp8,fp8_e5m2", help="the FP8 kv_cache_dtype values to compare")
    ap.add_argument("--modules", default="argparse,json.decoder,textwrap", help="stdlib modules whose source is the text")
    ap.add_argument("--chunk-tokens", type=int, default=1024, help="prompt length of the accuracy run")
    ap.add_argument("--positions", type=int, default=5120, help="positions compared (at most)")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens of the decode runs")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tiny-v4", action="store_true", help="accuracy only, on a tiny random DeepSeek-V4")
    args = ap.parse_args(argv)
    print(f"CPU: {cpu_name()}")
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny_v4:
            args.model = build_tiny_v4(tmp)
        run(args)


def run(args: argparse.Namespace) -> None:
    kinds = ["auto"] + args.formats.split(",")
    extra = dict(block_size=128) if args.tiny_v4 else {}
    engines = {k: LLM(args.model, dtype=args.dtype, kv_cache_dtype=k, max_num_seqs=32, **extra,
                      max_num_batched_tokens=32 * args.context,
                      max_model_len=max(args.chunk_tokens + 1, args.context + 2 * args.decode_tokens))
               for k in kinds}
    auto = engines["auto"].engine
    print(f"model dtype {auto.runner.dtype}; KV pools: "
          + ", ".join(f"{k} {e.engine.runner.kv_dtype}" for k, e in engines.items()))
    tokens = corpus_tokens(engines["auto"], args.modules.split(","))
    n = min(len(tokens), args.positions + args.positions // args.chunk_tokens + 1)
    chunks = [tokens[i:min(n, i + args.chunk_tokens)] for i in range(0, n, args.chunk_tokens)]
    chunks = [c for c in chunks if len(c) > 1]
    forced = {k: teacher_forced(llm, chunks) for k, llm in engines.items()}
    result = {}
    print(f"\naccuracy, teacher-forced over {len(forced['auto'])} positions of {args.modules} "
          f"({len(chunks)} prompts of <= {args.chunk_tokens} tokens):")
    print("| kv_cache_dtype | next-token agreement | mean abs delta logprob | max abs delta logprob |")
    print("|---|---|---|---|")
    for k in kinds[1:]:
        pairs = list(zip(forced["auto"], forced[k]))
        agree = sum(a[0] == b[0] for a, b in pairs) / len(pairs)
        deltas = [abs(a[1] - b[1]) for a, b in pairs]
        mean, worst = sum(deltas) / len(deltas), max(deltas)
        result.update({f"agree_{k}": agree, f"dlogp_mean_{k}": mean, f"dlogp_max_{k}": worst})
        print(f"| {k} | {agree:.4f} | {mean:.4f} | {worst:.3f} |")
    if args.tiny_v4:
        print("RESULT " + " ".join(f"{key}={value:.4g}" for key, value in result.items()))
        return

    prompts = [tokens[i * 97:i * 97 + args.context] for i in range(32)]
    for llm in engines.values():  # warm-up: kernels, pages touched
        decode_rate(llm, prompts[:2], 4)
    best: dict[tuple[str, int], float] = {}
    for _ in range(args.rounds):
        for batch in (1, 32):
            for k, llm in engines.items():
                rate = decode_rate(llm, prompts[:batch], args.decode_tokens * (2 if batch == 1 else 1))
                best[k, batch] = max(best.get((k, batch), 0.0), rate)
    print(f"\ndecode tokens/s (best of {args.rounds} alternating rounds; {args.context}-token prompts):")
    print("| kv_cache_dtype | batch 1 | ratio | batch 32 | ratio |")
    print("|---|---|---|---|---|")
    for k in kinds:
        r1, r32 = best[k, 1] / best["auto", 1], best[k, 32] / best["auto", 32]
        print(f"| {k} | {best[k, 1]:.1f} | {r1:.2f} | {best[k, 32]:.1f} | {r32:.2f} |")
        if k != "auto":
            result.update({f"b1_ratio_{k}": r1, f"b32_ratio_{k}": r32})
    print("RESULT " + " ".join(f"{key}={value:.4g}" for key, value in result.items()))


if __name__ == "__main__":
    main()

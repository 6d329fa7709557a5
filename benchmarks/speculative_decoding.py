"""N-gram speculative decoding against plain decoding on the demo model, in one run.

Three engines on the same model: plain (the offline default, decode bursts on), plain with one
step a call (num_scheduler_steps=1: what speculation runs beside, as it turns bursts off) and
with speculative_config={"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2,
"prompt_lookup_max": 3}. Workloads, chat prompts decoded greedily: "copy" (4 prompts whose answer
repeats or edits text given in the prompt: where drafts are right), "copy1" (the first of them
alone: one stream) and "open" (4 free answers: drafts mostly absent or rejected, the cost side).
Prints the CPU, tokens/s of each engine per workload (best of --rounds), the acceptance (accepted
/ proposed draft tokens, tokens per verified step), and checks that all engines gave the same
tokens. Last line, machine-readable:
    RESULT copy_ratio=<spec/plain tok/s> copy1_ratio=<...> open_ratio=<...> acceptance=<copy's>

    python benchmarks/speculative_decoding.py [--k 4] [--max-tokens 96] [--rounds 2] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import time

import hybridkv  # noqa: F401  (before torch: the OpenMP runtime the engine uses)
from hybridkv import LLM, SamplingParams
from cpu_info import cpu_name  # noqa: E402  (benchmarks/ is the script's folder)

TEXT = ("def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n"
        "        subtotal += item.price * item.quantity\n    return subtotal * (1 + tax_rate)\n")
COPY = [f"Repeat this code exactly, renaming total_price to order_total:\n{TEXT}",
        f"Copy this text word for word: {TEXT}",
        "Repeat this sentence three times: The quick brown fox jumps over the lazy dog.",
        "Rewrite this list in the same order, one item per line: apples, pears, plums, figs, dates, limes."]
OPEN = ["Write a short story about a lighthouse keeper.", "Explain why the sky is blue.",
        "Give three tips for learning a new language.", "What makes a good cup of coffee?"]


def timed(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[float, list[list[int]]]:
    llm.reset_prefix_cache()
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    msgs = [[{"role": "user", "content": p}] for p in prompts]
    t = time.perf_counter()
    outs = llm.chat(msgs, sp, use_tqdm=False)
    return time.perf_counter() - t, [o.outputs[0].token_ids for o in outs]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the built-in demo model")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="the model dtype (auto: the checkpoint's, float32 on the demo model)")
    args = ap.parse_args(argv)
    print(f"CPU: {cpu_name()}")
    spec_config = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    kw = dict(dtype=args.dtype)
    engines = {"plain": LLM(args.model, **kw), "plain1": LLM(args.model, num_scheduler_steps=1, **kw),
               "spec": LLM(args.model, speculative_config=spec_config, **kw)}
    print(f"dtype {engines['plain'].engine.runner.dtype}; k={args.k}, {args.max_tokens} tokens")
    for llm in engines.values():  # warm-up: kernels built, pages touched
        timed(llm, OPEN[:1], 8)
    ratios = {}
    for name, prompts in (("copy", COPY), ("copy1", COPY[:1]), ("open", OPEN)):
        st = engines["spec"].engine.stats
        before = dict(st, spec_accepted_per_position=None)
        best: dict[str, float] = {}
        for _ in range(args.rounds):
            tokens = {}
            for kind, llm in engines.items():
                seconds, tokens[kind] = timed(llm, prompts, args.max_tokens)
                rate = sum(map(len, tokens[kind])) / seconds
                best[kind] = max(best.get(kind, 0.0), rate)
            same = tokens["plain"] == tokens["spec"] == tokens["plain1"]
        proposed = st["spec_draft_tokens"] - before["spec_draft_tokens"]
        accepted = st["spec_accepted_tokens"] - before["spec_accepted_tokens"]
        verified = st["spec_drafts"] - before["spec_drafts"]
        ratios[name] = best["spec"] / best["plain"]
        print(f"{name}: plain {best['plain']:.1f} tok/s, one step a call {best['plain1']:.1f}, "
              f"spec {best['spec']:.1f} (x{ratios[name]:.2f} plain, x{best['spec'] / best['plain1']:.2f} one step); "
              f"drafts accepted {accepted}/{proposed} ({accepted / max(1, proposed):.0%}), "
              f"{(accepted + verified) / max(1, verified):.2f} tokens per verified step; same tokens: {same}")
        if name == "copy":
            acceptance = accepted / max(1, proposed)
    print(f"RESULT copy_ratio={ratios['copy']:.3f} copy1_ratio={ratios['copy1']:.3f} open_ratio={ratios['open']:.3f} "
          f"acceptance={acceptance:.3f}")


if __name__ == "__main__":
    main()

"""A long prompt prefilled beside a stream, in process: the step times the stream sees.

One interactive stream decodes; then a long prompt (8,000 tokens by default) arrives and is
prefilled in chunks sized to the step-time target (`target_step_seconds`, the server's 0.25 s by
default), as `hybridkv serve` does. Printed per 1,000 tokens of the prompt's context: steps, the
median chunk, and the median and longest step (each step is one gap of the stream). The last line
is the prompt's whole prefill time.

--ignore-page-runs is an A/B switch for this benchmark only: pages are taken from the front of
the free list as before run continuation (block_space.py), so a prompt prefilled beside a
decode gets scattered pages and attention gathers them every step.

    python benchmarks/prompt_beside_stream.py [--prompt-tokens 8000] [--ignore-page-runs]
"""
from __future__ import annotations

import argparse
import statistics
import time

from hybridkv import LLM, SamplingParams
from hybridkv.block_manager.block_space import BlockSpace
from hybridkv.cpu_features import cpu_features


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=8000)
    ap.add_argument("--target-step-seconds", type=float, default=0.25)
    ap.add_argument("--ignore-page-runs", action="store_true")
    args = ap.parse_args(argv)
    allocate = BlockSpace.allocate
    if args.ignore_page_runs:
        BlockSpace.allocate = lambda self, n, after=None, tail=False: allocate(self, n)
    try:
        return _run(args)
    finally:
        BlockSpace.allocate = allocate


def _run(args: argparse.Namespace) -> int:
    cpu = cpu_features().describe()
    llm = LLM(max_model_len=max(8192, args.prompt_tokens + 64), target_step_seconds=args.target_step_seconds)
    engine = llm.engine
    engine.add_request("stream", {"prompt_token_ids": [100, 200, 300, 400]},
                       SamplingParams(max_tokens=args.prompt_tokens, temperature=0, ignore_eos=True))
    for _ in range(32):  # the step timer learns this machine from the stream's first steps
        engine.step()
    prompt = [(37 * i) % 40000 + 100 for i in range(args.prompt_tokens)]
    engine.add_request("long", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, temperature=0),
                       interactive=False)
    sched = engine.scheduler
    steps: list[tuple[int, int, float]] = []  # (context before, chunk, seconds)
    t0 = time.perf_counter()
    while True:
        req = next((r for r in [*sched.running, *sched.waiting] if len(r.prompt_token_ids) == len(prompt)), None)
        if req is None:
            break
        before = req.num_computed_tokens
        t = time.perf_counter()
        engine.step()
        steps.append((before, req.num_computed_tokens - before, time.perf_counter() - t))
    total = time.perf_counter() - t0
    engine.abort_request("stream")
    engine.kv.assert_idle()  # every page free or cached once both requests are gone

    print(f"CPU: {cpu}; page runs {'ignored' if args.ignore_page_runs else 'kept'}; "
          f"target {args.target_step_seconds} s")
    print(f"{'context':>12} {'steps':>6} {'chunk p50':>9} {'step p50':>9} {'longest':>8}")
    for lo in range(0, args.prompt_tokens, 1000):
        band = [s for s in steps if lo <= s[0] < lo + 1000]
        if band:
            print(f"{lo:>5}-{lo + 1000:<6} {len(band):>6} {statistics.median(s[1] for s in band):>9.0f} "
                  f"{statistics.median(s[2] for s in band):>8.3f}s {max(s[2] for s in band):>7.3f}s")
    print(f"RESULT prompt_seconds={total:.1f} steps={len(steps)} longest_step={max(s[2] for s in steps):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

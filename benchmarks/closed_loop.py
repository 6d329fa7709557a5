"""The online load of online_peer.py in process: a closed loop of streamed requests against one engine.

Like `vllm bench serve` with the random dataset (`online_peer.py` runs that through the HTTP
server): N prompts of random tokens, at most C in flight, a new one added as soon as one
finishes; every request is interactive (streamed), as the server's are. No server, so what it
shows is the engine's scheduling and step cost alone, step by step:

  * duration, request throughput, mean TTFT and mean TPOT (TTFT from add_request to the step
    that returned the first token; TPOT over the rest);
  * how the steps were spent: steps that computed prompt tokens (mean prompt tokens, decodes
    riding along, seconds) and decode-only steps (mean batch, seconds);
  * the streams' gaps (every step a stream decodes in is one): p50, p99 and the longest.

    python benchmarks/closed_loop.py                                  # the serving defaults
    python benchmarks/closed_loop.py --target-step-seconds 0 --max-num-batched-tokens 1024
    python benchmarks/closed_loop.py --stagger 0.3    # the first wave arrives over 0.3 s, as HTTP clients do
    python benchmarks/closed_loop.py --stagger 0.3 --max-step-seconds 0   # every step held to the target

Nothing is asserted; one warm-up pass of C requests runs before the measured one.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import hybridkv  # noqa: F401  (before torch: the OpenMP runtime the CLI gets, see hybridkv/openmp_runtime.py)
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from online_peer import add_load_args  # noqa: E402

from hybridkv import LLM, SamplingParams  # noqa: E402
from hybridkv.entrypoints.cli import SERVE_TARGET_STEP_SECONDS, step_target  # noqa: E402


def run(llm: LLM, prompts: list[list[int]], output_len: int, concurrency: int, tag: str, stagger: float = 0.0) -> dict:
    """stagger > 0: the first `concurrency` requests arrive evenly spread over `stagger` seconds
    (as requests through an HTTP server do) instead of all at once; a request's TTFT counts from
    its arrival. Later ones still arrive the moment a request finishes."""
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    schedule = eng.scheduler.schedule
    last = {}

    def recording_schedule():
        last["out"] = schedule()
        return last["out"]

    eng.scheduler.schedule = recording_schedule
    pending = list(enumerate(prompts))
    added, first, done, tokens, steps = {}, {}, {}, {}, []
    t0 = time.perf_counter()
    # Request k < concurrency arrives at arrive[k] (all at t0 when stagger is 0); every later
    # one when a request in flight finishes.
    arrive = [t0 + k * stagger / concurrency for k in range(concurrency)]
    try:
        while pending or eng.has_unfinished_requests():
            while pending and len(added) - len(done) < concurrency:
                k = len(added)
                if k < concurrency and time.perf_counter() < arrive[k]:
                    if eng.has_unfinished_requests():
                        break  # it arrives during a later step
                    time.sleep(arrive[k] - time.perf_counter())  # idle until it arrives
                i, p = pending.pop(0)
                rid = f"{tag}{i}"
                eng.add_request(rid, {"prompt_token_ids": p}, sp, interactive=True)
                # A first-wave request waited from its arrival (a server queues it then).
                added[rid] = arrive[k] if k < concurrency else time.perf_counter()
            ts = time.perf_counter()
            outs = eng.step()
            now = time.perf_counter()
            scheduled = last["out"].scheduled
            decodes = sum(1 for s in scheduled if s.end - s.start == 1 and s.request.output_token_ids)
            steps.append((decodes, sum(s.end - s.start for s in scheduled) - decodes, now - ts))
            for o in outs:
                if o.outputs[0].token_ids and o.request_id not in first:
                    first[o.request_id] = now
                if o.finished:
                    done[o.request_id], tokens[o.request_id] = now, len(o.outputs[0].token_ids)
    finally:
        eng.scheduler.schedule = schedule
    duration = time.perf_counter() - t0
    prefill = [s for s in steps if s[1]]
    decode = [s for s in steps if not s[1] and s[0]]
    # Every step a stream decodes in is one gap between two of its tokens.
    gaps = sorted(t for d, _, t in steps for _ in range(d))
    return dict(
        duration=duration, req_s=len(done) / duration,
        ttft=statistics.mean(first[r] - added[r] for r in done),
        tpot=statistics.mean((done[r] - first[r]) / (tokens[r] - 1) for r in done if tokens[r] > 1),
        prefill_steps=len(prefill), decode_steps=len(decode),
        prefill_tokens=statistics.mean(s[1] for s in prefill) if prefill else 0.0,
        prefill_decodes=statistics.mean(s[0] for s in prefill) if prefill else 0.0,
        prefill_step_s=statistics.mean(s[2] for s in prefill) if prefill else 0.0,
        decode_batch=statistics.mean(s[0] for s in decode) if decode else 0.0,
        decode_step_s=statistics.mean(s[2] for s in decode) if decode else 0.0,
        gap_p50=gaps[len(gaps) // 2] if gaps else 0.0,
        gap_p99=gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else 0.0,
        gap_max=gaps[-1] if gaps else 0.0,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_load_args(ap)  # the same load as online_peer.py's
    ap.add_argument("--target-step-seconds", type=step_target, default=SERVE_TARGET_STEP_SECONDS,
                    help=f"the scheduler's step target, seconds or 'auto' (default: serve's, "
                         f"{SERVE_TARGET_STEP_SECONDS}; 0 = off)")
    ap.add_argument("--max-step-seconds", type=float, default=None,
                    help="the longest step while streams decode (default: serve's: with 'auto' derived from "
                         "the target, else the target; 0 = the target: every step held to it)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the engine's")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--stagger", type=float, default=0.0,
                    help="spread the first wave's arrivals over this many seconds (HTTP clients starting one "
                         "after another; 0 = all at once)")
    args = ap.parse_args(argv)
    llm = LLM(args.model, dtype=args.dtype, seed=0, num_threads=args.threads,
              target_step_seconds=args.target_step_seconds or None,
              max_step_seconds=(args.max_step_seconds or None) if args.target_step_seconds else None,
              max_num_batched_tokens=args.max_num_batched_tokens)
    vocab = llm.engine.runner.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, vocab - 100, (args.input_len,), generator=g).tolist()
               for _ in range(args.num_prompts + args.concurrency)]
    run(llm, prompts[args.num_prompts:], args.output_len, args.concurrency, "warm")
    r = run(llm, prompts[: args.num_prompts], args.output_len, args.concurrency, "req", args.stagger)
    budget = llm.engine.config.max_num_batched_tokens or "engine default"
    gaps = llm.engine.scheduler.gaps  # the target in force at the end ("auto" follows the machine)
    target = f"{gaps.target_seconds:.3f} s, longest step {gaps.max_seconds:.3f} s" if gaps else "off"
    print(f"{args.num_prompts} requests of {args.input_len} in / {args.output_len} out, concurrency "
          f"{args.concurrency}; step target {target}{' (auto)' if args.target_step_seconds == 'auto' else ''}, "
          f"max_num_batched_tokens {budget}; "
          f"first wave {'staggered over ' + format(args.stagger, 'g') + ' s' if args.stagger else 'all at once'}")
    print(f"  duration {r['duration']:.1f} s, {r['req_s']:.3f} req/s, mean TTFT {r['ttft']:.2f} s, "
          f"mean TPOT {r['tpot'] * 1e3:.0f} ms")
    print(f"  steps with prompt tokens: {r['prefill_steps']} (mean {r['prefill_tokens']:.0f} prompt tokens, "
          f"{r['prefill_decodes']:.1f} decodes, {r['prefill_step_s'] * 1e3:.0f} ms); decode-only steps: "
          f"{r['decode_steps']} (mean batch {r['decode_batch']:.1f}, {r['decode_step_s'] * 1e3:.0f} ms)")
    print(f"  stream gaps (a step each decoding stream waited through): p50 {r['gap_p50'] * 1e3:.0f} ms, "
          f"p99 {r['gap_p99'] * 1e3:.0f} ms, longest {r['gap_max'] * 1e3:.0f} ms")
    print("RESULT " + " ".join(f"{k}={v:.4g}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

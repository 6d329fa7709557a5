"""Multi-turn conversations with and without the host tier (HiCache L2), at equal device memory.

Modelled on SGLang's benchmark/hicache/bench_multiturn.py. C conversations x T turns, all in
flight at once through one engine driven by engine.step() (closed loop: a conversation submits
its next turn when its previous turn finished). Every conversation starts with the same shared
system prompt (token ids); each turn appends U new user tokens (random ids, fixed seed) to the
conversation's history (history = previous prompt + previous output + new user tokens) and
generates O tokens (greedy, ignore_eos).

The working set is the sum over conversations of the pages of their final history (last prompt
+ last output). The device KV budget (kv_cache_memory_bytes) holds 1/8 of it: for a dense model
that is 1/8 of its bytes; for DeepSeek-V4 the whole-history spaces (c4, c128, indexer) get 1/8
of the working set's pages and the windowed ones (swa, state) the engine's usual share for C
running windows (a cached history needs no more of them on the device). So without a host tier
most of a conversation's history has been evicted by the others by the time its next turn
arrives, and is recomputed; with the host tier (hicache_size: the whole working set in every
space, write_through) it is loaded back instead. Both runs see identical workloads in the same
sitting, after a warm-up on a probe engine, and must produce identical output tokens on every
turn (exit 1 if not: a cache must never change outputs).

Printed per run: input throughput (prompt tokens / wall second), TTFT (first token time minus
the turn's submission) mean / p50 / p99, prompt tokens by where they came from (device cache,
host tier, computed; at admission), load-back bytes and the seconds the tier copies took
(both directions), preemptions, steps; then L1+L2 vs L1: throughput x and mean-TTFT reduction. Nothing
is asserted about timings (the issue's targets, >= 3x input throughput and >= 56% lower mean
TTFT, are printed next to the figures).

    python benchmarks/hicache_multiturn.py                   # demo model (SmolLM2-135M), ~2.5 minutes
    python benchmarks/hicache_multiturn.py --model v4-tiny   # tiny DeepSeek-V4 (page 32), built in a temp dir; ~30 s
    python benchmarks/hicache_multiturn.py --quick           # ~35 s (a smoke test)
    [--conversations 16 --turns 10 --system-tokens 128 --user-tokens 32 --output-tokens 4
     --device-fraction 0.125 --host-fraction 1.25 --threads N --model PATH --block-size P]

Last line: RESULT model=... throughput_x=... ttft_mean_reduction_pct=... outputs_identical=0|1 ...
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402

from hybridkv import LLM, SamplingParams  # noqa: E402

TARGET_THROUGHPUT_X = 3.0
TARGET_TTFT_REDUCTION_PCT = 56.0


@dataclass
class Workload:
    system: list[int]
    user: list[list[list[int]]]  # [conversation][turn] -> new user tokens
    output_tokens: int

    @property
    def conversations(self) -> int:
        return len(self.user)

    @property
    def turns(self) -> int:
        return len(self.user[0])

    def final_history_tokens(self, c: int) -> int:
        """Last prompt + last output of conversation c (lengths do not depend on the outputs)."""
        return len(self.system) + sum(len(u) for u in self.user[c]) + self.turns * self.output_tokens


def make_workload(vocab: int, conversations: int, turns: int, system_tokens: int, user_tokens: int,
                  output_tokens: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    system = toks(system_tokens)
    user = [[toks(user_tokens) for _ in range(turns)] for _ in range(conversations)]
    return Workload(system, user, output_tokens)


@dataclass
class RunResult:
    name: str
    wall: float
    outputs: list[list[list[int]]]  # [conversation][turn] -> output token ids
    ttft: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    from_device: int = 0
    from_host: int = 0
    computed: int = 0
    load_back_bytes: int = 0
    write_back_bytes: int = 0
    transfer_seconds: float = 0.0
    preemptions: int = 0
    steps: int = 0
    host_evicted_nodes: int = 0
    device_pages: dict = field(default_factory=dict)
    host_pages: dict = field(default_factory=dict)

    @property
    def input_throughput(self) -> float:
        return self.prompt_tokens / self.wall

    @property
    def ttft_mean(self) -> float:
        return statistics.fmean(self.ttft)

    def ttft_pct(self, q: float) -> float:
        xs = sorted(self.ttft)
        return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def run_conversations(llm: LLM, work: Workload, name: str) -> RunResult:
    """Drive all conversations through llm.engine, closed loop; returns outputs and metrics."""
    eng = llm.engine
    C, T = work.conversations, work.turns
    params = SamplingParams(temperature=0, max_tokens=work.output_tokens, ignore_eos=True)
    history = [list(work.system) for _ in range(C)]
    outputs: list[list[list[int]]] = [[[] for _ in range(T)] for _ in range(C)]
    res = RunResult(name, 0.0, outputs)

    def submit(c: int, t: int) -> None:
        history[c] = history[c] + work.user[c][t]
        eng.add_request(f"c{c}-t{t}", {"prompt_token_ids": history[c]}, params)

    t0 = time.perf_counter()
    for c in range(C):
        submit(c, 0)
    while eng.has_unfinished_requests():
        for out in eng.step():
            if not out.finished:
                continue
            c, t = (int(x[1:]) for x in out.request_id.split("-"))
            toks = list(out.outputs[0].token_ids)
            outputs[c][t] = toks
            m = out.metrics
            res.ttft.append(m["first_token_time"] - m["arrival_time"])
            res.prompt_tokens += len(history[c])
            res.from_device += m["prompt_tokens_from_device"]
            res.from_host += m["prompt_tokens_from_host"]
            res.computed += m["prompt_tokens_computed"]
            history[c] = history[c] + toks
            if t + 1 < T:
                submit(c, t + 1)
    res.wall = time.perf_counter() - t0
    res.load_back_bytes = eng.tier_stats["load_back_bytes"]
    res.write_back_bytes = eng.tier_stats["write_back_bytes"]
    res.transfer_seconds = eng.tier_stats["transfer_seconds"]
    res.preemptions = eng.scheduler.num_preemptions
    res.steps = eng.stats["steps"]
    res.device_pages = {n: s.num_pages for n, s in eng.kv.spaces.items()}
    if eng.kv.host_tier is not None:
        res.host_pages = {s: p.num_pages for s, p in eng.kv.host_tier.pools.items()}
        res.host_evicted_nodes = eng.kv.host_tier.stats.host_evicted_nodes
    eng.check_invariants()
    return res


def _print_run(r: RunResult) -> None:
    P = r.prompt_tokens
    print(f"  {r.name:<8} input {r.input_throughput:8.1f} tok/s  wall {r.wall:7.2f} s  "
          f"TTFT mean {r.ttft_mean * 1e3:8.1f} ms  p50 {r.ttft_pct(50) * 1e3:8.1f}  p99 {r.ttft_pct(99) * 1e3:8.1f}  "
          f"steps {r.steps}")
    print(f"           prompt tokens {P}: device {r.from_device / P:6.1%}  host {r.from_host / P:6.1%}  "
          f"computed {r.computed / P:6.1%}   load-back {r.load_back_bytes / 2**20:8.1f} MiB  "
          f"write {r.write_back_bytes / 2**20:8.1f} MiB  tier copies {r.transfer_seconds:6.2f} s  "
          f"preemptions {r.preemptions}" + (f"  host evictions {r.host_evicted_nodes}" if r.host_pages else ""))


def build_model(spec: str, tmp: str, block_size: int | None) -> tuple[str | None, dict, str]:
    """(model path or None, LLM kwargs, label)."""
    if spec == "demo":
        return None, dict(dtype="float32", block_size=block_size), "demo (SmolLM2-135M, float32)"
    if spec == "v4-tiny":
        from tiny_deepseek_v4 import build_v4_checkpoint

        path = build_v4_checkpoint(os.path.join(tmp, "v4"))
        return path, dict(dtype="float32", block_size=block_size or 32), "DeepSeek-V4 tiny (window 16, float32)"
    return spec, dict(dtype="float32", block_size=block_size), spec


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo", help="demo (default), v4-tiny, or a checkpoint folder")
    ap.add_argument("--conversations", type=int, default=None, help="C (default 16; quick 16)")
    ap.add_argument("--turns", type=int, default=None, help="T (default 10; quick 4)")
    ap.add_argument("--system-tokens", type=int, default=None, help="shared system prompt (default 128; quick 64)")
    ap.add_argument("--user-tokens", type=int, default=None, help="new user tokens per turn (default 32; quick 32)")
    ap.add_argument("--output-tokens", type=int, default=None, help="generated per turn (default 4; quick 2)")
    ap.add_argument("--device-fraction", type=float, default=0.125, help="device pages / working-set pages (whole-history spaces)")
    ap.add_argument("--host-fraction", type=float, default=1.25, help="host tier pages / working-set pages (every space)")
    ap.add_argument("--block-size", type=int, default=None, help="page size (default: the model's; v4-tiny 32)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a small workload, well under a minute")
    args = ap.parse_args(argv)
    quick = dict(conversations=16, turns=4, system_tokens=64, user_tokens=32, output_tokens=2)
    full = dict(conversations=16, turns=10, system_tokens=128, user_tokens=32, output_tokens=4)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model, kw, label = build_model(args.model, tmp, args.block_size)
        return _bench(args, model, kw, label)


def warm_up(llm: LLM, vocab: int) -> None:
    """A few prefills and decodes of other tokens, so that neither timed run pays the process's
    first-call costs (allocator growth, kernel selection)."""
    rng = random.Random(12345)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(n)]} for n in (200, 64, 17)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)


def device_bytes_for(specs: dict, page: int, n: int, seqs: int, chunk: int) -> int:
    """kv_cache_memory_bytes for which the engine gives every whole-history space n pages:
    its split (LLMEngine._pages_per_space) gives a windowed space min(n + seqs, seqs x the
    pages one request holds + one chunk) pages."""
    total = 0
    for s in specs.values():
        if s.windowed:
            total += min(n + seqs, seqs * s.max_live_pages(page, page) + -(-chunk // page)) * s.bytes_per_page(page)
        else:
            total += n * s.bytes_per_page(page)
    return total


def _bench(args, model, kw: dict, label: str) -> int:
    C = args.conversations
    # A probe engine (small pool) tells the page size, the vocabulary and the block spaces.
    probe = LLM(model, max_model_len=256, max_num_seqs=1, **kw)
    vocab = probe.engine.runner.config.vocab_size
    work = make_workload(vocab, C, args.turns, args.system_tokens, args.user_tokens, args.output_tokens, args.seed)
    page = probe.engine.kv.page_size
    specs = dict(probe.engine.kv.specs)
    warm_up(probe, vocab)
    del probe
    gc.collect()
    bpp = {n: s.bytes_per_page(page) for n, s in specs.items()}
    longest = max(work.final_history_tokens(c) for c in range(C))
    max_model_len = -(-longest // page) * page + page
    chunk = max(2048, max_model_len)  # the engine's default max_num_batched_tokens
    # Working set: every conversation's final history, in pages, in every space (the host tier
    # keeps one page per cached node in every space, windowed ones too).
    ws_pages = sum(-(-work.final_history_tokens(c) // page) for c in range(C))
    ws_bytes = ws_pages * sum(bpp.values())
    # Device: the whole-history spaces hold device_fraction of the working set's pages; windowed
    # spaces (V4's swa/state) only ever need the running requests' windows there, and get the
    # engine's usual share for C sequences. At least one longest sequence must fit.
    n_dev = round(ws_pages * args.device_fraction)
    n_min = -(-max_model_len // page) + 1
    clamped = n_dev < n_min
    n_dev = max(n_dev, n_min)
    device_bytes = device_bytes_for(specs, page, n_dev, C, chunk)
    host_pages = math.ceil(ws_pages * args.host_fraction)
    host_bytes = host_pages * sum(bpp.values())
    common = dict(kw, max_model_len=max_model_len, max_num_seqs=C, kv_cache_memory_bytes=device_bytes)
    prompt_total = sum(len(work.system) + sum(len(u) for u in work.user[c][: t + 1]) + t * work.output_tokens
                       for c in range(C) for t in range(work.turns))
    print(f"model: {label}, page {page}; torch threads {torch.get_num_threads()}")
    print(f"workload: {C} conversations x {work.turns} turns, shared system prompt {len(work.system)} tokens, "
          f"+{args.user_tokens} user tokens and {work.output_tokens} output tokens per turn; "
          f"{prompt_total} prompt tokens in all, longest history {longest} tokens")
    print(f"working set {ws_pages} pages (page {page}) x {sum(bpp.values())} B over spaces {bpp} = "
          f"{ws_bytes / 2**20:.1f} MiB; device KV {device_bytes / 2**20:.2f} MiB = {n_dev} pages per "
          f"whole-history space ({n_dev / ws_pages:.3f} of the working set"
          + (", raised to fit one longest sequence" if clamped else "") + f"); host tier "
          f"{host_bytes / 2**20:.1f} MiB = {host_pages} pages per space ({args.host_fraction:g})")

    runs = []
    for name, extra in (("L1", dict(enable_hierarchical_cache=False)),
                        ("L1+L2", dict(enable_hierarchical_cache=True, hicache_size=host_bytes,
                                       hicache_write_policy="write_through"))):
        llm = LLM(model, **common, **extra)
        r = run_conversations(llm, work, name)
        del llm
        gc.collect()
        runs.append(r)
        print(f"  [{name}] device pages {r.device_pages}" + (f", host pages {r.host_pages}" if r.host_pages else ""))
    print()
    for r in runs:
        _print_run(r)
    l1, l2 = runs
    identical = l1.outputs == l2.outputs
    if not identical:
        bad = [(c, t) for c in range(C) for t in range(work.turns) if l1.outputs[c][t] != l2.outputs[c][t]]
        print(f"\nOUTPUTS DIFFER on {len(bad)} of {C * work.turns} turns (first: conversation {bad[0][0]}, "
              f"turn {bad[0][1]}): {l1.outputs[bad[0][0]][bad[0][1]]} vs {l2.outputs[bad[0][0]][bad[0][1]]}")
    speedup = l2.input_throughput / l1.input_throughput
    ttft_red = (1 - l2.ttft_mean / l1.ttft_mean) * 100
    p50_red = (1 - l2.ttft_pct(50) / l1.ttft_pct(50)) * 100
    print(f"\nL1+L2 vs L1: input throughput {speedup:.2f}x (target >= {TARGET_THROUGHPUT_X:g}x: "
          f"{'met' if speedup >= TARGET_THROUGHPUT_X else 'MISSED'}), mean TTFT {ttft_red:.1f}% lower "
          f"(target >= {TARGET_TTFT_REDUCTION_PCT:g}%: {'met' if ttft_red >= TARGET_TTFT_REDUCTION_PCT else 'MISSED'}), "
          f"p50 TTFT {p50_red:.1f}% lower; outputs identical: {identical}")
    print(f"RESULT model={args.model} throughput_x={speedup:.3f} ttft_mean_reduction_pct={ttft_red:.1f} "
          f"outputs_identical={int(identical)} l1_input_tok_s={l1.input_throughput:.1f} "
          f"l2_input_tok_s={l2.input_throughput:.1f} l1_ttft_mean_ms={l1.ttft_mean * 1e3:.1f} "
          f"l2_ttft_mean_ms={l2.ttft_mean * 1e3:.1f} l2_host_hit={l2.from_host / l2.prompt_tokens:.3f} "
          f"l2_load_back_mib={l2.load_back_bytes / 2**20:.1f}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())

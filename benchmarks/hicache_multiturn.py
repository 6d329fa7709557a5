"""Multi-turn conversations with and without the host tier (HiCache L2) and the storage tier (L3),
at equal device memory, and after a warm restart on the same store.

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

Two more runs, with storage (HiCache L3, the file backend in a temporary directory):
  * L1+L2+L3: the host tier is also too small for the working set (--l3-host-fraction of it,
    default 1/4), so most returning histories have left both the device and the host and come
    back from the store (prefetched into host pages while the turn waits in the queue);
  * warm restart: a new process (a subprocess: a fresh engine, empty device and host tiers) on
    the same store, replaying the same workload: its very first turns already hit the store.

Printed per run: input throughput (prompt tokens / wall second), TTFT (first token time minus
the turn's submission) mean / p50 / p99, prompt tokens by where they came from (device cache,
host tier, computed; at admission), load-back bytes and the seconds the tier copies took
(both directions), preemptions, steps; then L1+L2 vs L1: throughput x and mean-TTFT reduction, and
each of L1+L2+L3 and the warm restart against L1 (cold) and L1+L2. Nothing
is asserted about timings (the issue's targets, >= 3x input throughput and >= 56% lower mean
TTFT, are printed next to the figures).

    python benchmarks/hicache_multiturn.py                   # demo model (SmolLM2-135M), ~2.5 minutes
    python benchmarks/hicache_multiturn.py --model v4-tiny   # tiny DeepSeek-V4 (page 32), built in a temp dir; ~30 s
    python benchmarks/hicache_multiturn.py --quick           # ~70 s (a smoke test)
    [--conversations 16 --turns 10 --system-tokens 128 --user-tokens 32 --output-tokens 4
     --device-fraction 0.125 --host-fraction 1.25 --l3-host-fraction 0.25 --no-storage
     --threads N --model PATH --block-size P]

Last line: RESULT model=... throughput_x=... ttft_mean_reduction_pct=... outputs_identical=0|1 ...
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402

from hybridkv import LLM, SamplingParams  # noqa: E402
from hybridkv.engine.kv_memory_plan import windowed_space_caps  # noqa: E402

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
    from_storage: int = 0
    computed: int = 0
    load_back_bytes: int = 0
    write_back_bytes: int = 0
    transfer_seconds: float = 0.0
    preemptions: int = 0
    steps: int = 0
    host_evicted_nodes: int = 0
    device_pages: dict = field(default_factory=dict)
    host_pages: dict = field(default_factory=dict)
    storage: dict = field(default_factory=dict)  # StorageTier.snapshot() at the end

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
            res.from_storage += m["prompt_tokens_from_storage"]
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
    if eng.storage is not None:
        eng.storage.close()  # every queued write lands before the store is reused
        res.storage = eng.storage.snapshot()
    return res


def _print_run(r: RunResult) -> None:
    P = r.prompt_tokens
    print(f"  {r.name:<9} input {r.input_throughput:8.1f} tok/s  wall {r.wall:7.2f} s  "
          f"TTFT mean {r.ttft_mean * 1e3:8.1f} ms  p50 {r.ttft_pct(50) * 1e3:8.1f}  p99 {r.ttft_pct(99) * 1e3:8.1f}  "
          f"steps {r.steps}")
    print(f"            prompt tokens {P}: device {r.from_device / P:6.1%}  host {r.from_host / P:6.1%}  "
          f"storage {r.from_storage / P:6.1%}  computed {r.computed / P:6.1%}   load-back {r.load_back_bytes / 2**20:8.1f} MiB  "
          f"write {r.write_back_bytes / 2**20:8.1f} MiB  tier copies {r.transfer_seconds:6.2f} s  "
          f"preemptions {r.preemptions}" + (f"  host evictions {r.host_evicted_nodes}" if r.host_pages else ""))
    if r.storage:
        st = r.storage
        print(f"            storage: prefetches {int(st['prefetches_started'])} (completed "
              f"{int(st['prefetches_completed'])}, timed out {int(st['prefetches_timed_out'])}, failed "
              f"{int(st['prefetches_failed'])}), pages prefetched {int(st['prefetch_pages'])}, pages written "
              f"{int(st['writes_queued'] - st['writes_dropped'])}, dropped {int(st['writes_dropped'])}, "
              f"corrupt {int(st['corrupt_values'])}")


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
    ap.add_argument("--l3-host-fraction", type=float, default=0.25,
                    help="host tier pages / working-set pages in the L1+L2+L3 and warm-restart runs")
    ap.add_argument("--no-storage", action="store_true", help="skip the L1+L2+L3 and warm-restart runs")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # the warm-restart process's spec
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
    if args.child:
        return _child(args.child)
    with tempfile.TemporaryDirectory() as tmp:
        model, kw, label = build_model(args.model, tmp, args.block_size)
        return _bench(args, model, kw, label, tmp)


def warm_up(llm: LLM, vocab: int) -> None:
    """A few prefills and decodes of other tokens, so that neither timed run pays the process's
    first-call costs (allocator growth, kernel selection)."""
    rng = random.Random(12345)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(n)]} for n in (200, 64, 17)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)


def _child(spec_path: str) -> int:
    """The warm-restart process: warm up on a probe engine without storage, then run the
    workload on a fresh engine over the store the parent filled; print the result as JSON."""
    with open(spec_path) as f:
        spec = json.load(f)
    w = spec["workload"]
    work = make_workload(w["vocab"], w["conversations"], w["turns"], w["system_tokens"], w["user_tokens"],
                         w["output_tokens"], w["seed"])
    probe_kw = {k: v for k, v in spec["kw"].items() if k in ("dtype", "block_size")}
    probe = LLM(spec["model"], max_model_len=256, max_num_seqs=1, **probe_kw)
    warm_up(probe, w["vocab"])
    del probe
    gc.collect()
    llm = LLM(spec["model"], **spec["kw"])
    res = run_conversations(llm, work, spec["name"])
    print("CHILD_RESULT " + json.dumps(dataclasses.asdict(res)))
    return 0


def run_in_new_process(args, model: str | None, kw: dict, work: Workload, vocab: int, name: str, tmp: str) -> RunResult:
    """run_conversations in a new Python process (nothing shared with this one but the store)."""
    spec = dict(model=model, kw=kw, name=name, workload=dict(
        vocab=vocab, conversations=work.conversations, turns=work.turns, system_tokens=len(work.system),
        user_tokens=len(work.user[0][0]), output_tokens=work.output_tokens, seed=args.seed))
    spec_path = os.path.join(tmp, f"{name}.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", spec_path]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("CHILD_RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the {name} process failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    res = RunResult(**json.loads(lines[-1][len("CHILD_RESULT "):]))
    return res


def device_bytes_for(specs: dict, page: int, n: int, seqs: int, chunk: int) -> int:
    """kv_cache_memory_bytes for which the engine gives every whole-history space n pages:
    its split (kv_memory_plan.pages_per_space) gives a windowed space min(n + seqs, its cap) pages
    (prefix caching on: this benchmark measures the prefix cache)."""
    caps = windowed_space_caps(list(specs.values()), page, seqs, chunk, prefix_caching=True)
    total = 0
    for s in specs.values():
        if s.windowed:
            total += min(n + seqs, caps[s.name]) * s.bytes_per_page(page)
        else:
            total += n * s.bytes_per_page(page)
    return total


def _bench(args, model, kw: dict, label: str, tmp: str) -> int:
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

    l3_host_pages = max(1, math.ceil(ws_pages * args.l3_host_fraction))
    l3_host_bytes = l3_host_pages * sum(bpp.values())
    store = os.path.join(tmp, "store")
    l3 = dict(enable_hierarchical_cache=True, hicache_size=l3_host_bytes, hicache_write_policy="write_through",
              hicache_storage_backend="file", hicache_storage_dir=store)
    if not args.no_storage:
        print(f"L1+L2+L3 and warm restart: host tier {l3_host_bytes / 2**20:.1f} MiB = {l3_host_pages} pages per "
              f"space ({args.l3_host_fraction:g} of the working set), file store in a temporary directory")
    configs = [("L1", dict(enable_hierarchical_cache=False)),
               ("L1+L2", dict(enable_hierarchical_cache=True, hicache_size=host_bytes,
                              hicache_write_policy="write_through"))]
    if not args.no_storage:
        configs.append(("L1+L2+L3", l3))
    runs = []
    for name, extra in configs:
        llm = LLM(model, **common, **extra)
        r = run_conversations(llm, work, name)
        del llm
        gc.collect()
        runs.append(r)
        print(f"  [{name}] device pages {r.device_pages}" + (f", host pages {r.host_pages}" if r.host_pages else ""))
    if not args.no_storage:
        runs.append(run_in_new_process(args, model, dict(common, **l3), work, vocab, "warm", tmp))
        print(f"  [warm] a new process on the same store; device pages {runs[-1].device_pages}, "
              f"host pages {runs[-1].host_pages}")
    print()
    for r in runs:
        _print_run(r)
    cold = runs[0]
    bad = {r.name: [(c, t) for c in range(C) for t in range(work.turns) if r.outputs[c][t] != cold.outputs[c][t]]
           for r in runs[1:]}
    identical = not any(bad.values())
    for name, turns in bad.items():
        if turns:
            c, t = turns[0]
            other = next(r for r in runs if r.name == name)
            print(f"\nOUTPUTS DIFFER between L1 and {name} on {len(turns)} of {C * work.turns} turns (first: "
                  f"conversation {c}, turn {t}): {cold.outputs[c][t]} vs {other.outputs[c][t]}")
    l2 = runs[1]
    speedup = l2.input_throughput / cold.input_throughput
    ttft_red = (1 - l2.ttft_mean / cold.ttft_mean) * 100
    p50_red = (1 - l2.ttft_pct(50) / cold.ttft_pct(50)) * 100
    print(f"\nL1+L2 vs L1: input throughput {speedup:.2f}x (target >= {TARGET_THROUGHPUT_X:g}x: "
          f"{'met' if speedup >= TARGET_THROUGHPUT_X else 'MISSED'}), mean TTFT {ttft_red:.1f}% lower "
          f"(target >= {TARGET_TTFT_REDUCTION_PCT:g}%: {'met' if ttft_red >= TARGET_TTFT_REDUCTION_PCT else 'MISSED'}), "
          f"p50 TTFT {p50_red:.1f}% lower; outputs identical: {identical}")
    for r in runs[2:]:
        hit = (r.prompt_tokens - r.computed) / r.prompt_tokens
        print(f"{r.name} : hit rate {hit:.1%} (storage {r.from_storage / r.prompt_tokens:.1%}); input throughput "
              f"{r.input_throughput / cold.input_throughput:.2f}x L1, {r.input_throughput / l2.input_throughput:.2f}x "
              f"L1+L2; mean TTFT {(1 - r.ttft_mean / cold.ttft_mean) * 100:.1f}% lower than L1, "
              f"{(1 - r.ttft_mean / l2.ttft_mean) * 100:.1f}% lower than L1+L2")
    line = (f"RESULT model={args.model} throughput_x={speedup:.3f} ttft_mean_reduction_pct={ttft_red:.1f} "
            f"outputs_identical={int(identical)} l1_input_tok_s={cold.input_throughput:.1f} "
            f"l2_input_tok_s={l2.input_throughput:.1f} l1_ttft_mean_ms={cold.ttft_mean * 1e3:.1f} "
            f"l2_ttft_mean_ms={l2.ttft_mean * 1e3:.1f} l2_host_hit={l2.from_host / l2.prompt_tokens:.3f} "
            f"l2_load_back_mib={l2.load_back_bytes / 2**20:.1f}")
    for r in runs[2:]:
        tag = "l3" if r.name == "L1+L2+L3" else "warm"
        line += (f" {tag}_input_tok_s={r.input_throughput:.1f} {tag}_ttft_mean_ms={r.ttft_mean * 1e3:.1f} "
                 f"{tag}_storage_hit={r.from_storage / r.prompt_tokens:.3f} "
                 f"{tag}_hit={(r.prompt_tokens - r.computed) / r.prompt_tokens:.3f}")
    print(line)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())

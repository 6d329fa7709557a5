"""Per-step overhead of the core: scheduler + block manager + attention metadata, model stubbed.

Each configuration fills the shadow index with `cached` tokens (conversations of 1,024 tokens
that share a 512-token system prompt, as a server's cache looks) in a pool sized like a
long-running server's: full, so half of the new pages the measured steps need must be evicted
from the cache. It admits `running` decode requests whose prompts hit that system prompt,
prefills them (no model: the stub "computes" instantly), then times decode steps: schedule -> the
runner's metadata for the step (block tables -> slot mappings, prefill tiles, and the decode tiles
when the attention backend reads them: not when the CPU paged kernel builds on this machine, which
reads the block tables in place; --decode-tiles forces them) -> a fixed sampled token per request ->
update_after_step (publish pages, release out-of-window pages, move locks). Allocation runs
against the real pools, so windowed spaces (DeepSeek-V4's swa/state) evict as in steady state.

Layouts: dense (one "full" space, page 16) and DeepSeek-V4's six spaces (page 128, window
128, ratios 4/128). A second table runs 16 requests decoding over one shared cached prefix of
10k / 100k / 1M tokens (the lock-move case: each page a request completes moves its lock one
page deeper), scheduler + block manager only — attention metadata over a 1M-token context is
O(context) by nature and would hide what is measured. Prints µs per step; the last line is
machine-readable:
    RESULT us_per_step_256_100k=<float> growth_1m_vs_10k=<float>
(dense layout, 256 running requests; growth = 1M-token figure / 10k-token figure).

    python benchmarks/step_overhead.py [--steps 128] [--quick]
(timed steps per configuration; the default is one whole publication cycle of both layouts: a
decoding request publishes its pages to the index every KVCacheManager.publish_pages pages, 8 x 16
tokens dense, 1 x 128 for V4, so a window of fewer steps could miss the batched inserts.)
(with --running/--caches the RESULT keys keep their names but describe the largest running
count and the three cache sizes given.)
"""
from __future__ import annotations

import argparse
import gc
import time
from types import SimpleNamespace

import torch

from hybridkv.attention_backends.hybrid_metadata import HybridLayout, build_hybrid_metadata
from hybridkv.attention_backends.metadata import build_attention_metadata
from hybridkv.attention_backends.torch_native import TorchNativeAttention
from hybridkv.block_manager.kv_cache_manager import KVCacheManager
from hybridkv.block_manager.space_spec import SpaceSpec
from hybridkv.engine.request import Request
from hybridkv.engine.sampling_params import SamplingParams
from hybridkv.engine.scheduler import Scheduler, SchedulerConfig
from hybridkv.model_executor.model_runner import ModelRunner

SYSTEM_PROMPT = 512
CONVERSATION = 1024
PROMPT_TAIL = 40  # each running request's own tokens after the system prompt
MAX_MODEL_LEN = 4096


def dense_layout():
    return [SpaceSpec("full", 1, 2 * 2 * 16 * 4)], 16, None


def v4_layout():
    specs = [
        SpaceSpec("swa", 1, 64, window=128),
        SpaceSpec("c4", 4, 64),
        SpaceSpec("c128", 128, 64),
        SpaceSpec("indexer", 4, 32),
        SpaceSpec("state_c4", 1, 192, window=8, ring=8, align=4),
        SpaceSpec("state_c128", 1, 64, window=128, ring=128, align=128),
    ]
    return specs, 128, HybridLayout(128, 128, 4, 128)


def build(layout, cached_tokens: int, running: int, steps: int, backend: TorchNativeAttention):
    specs, P, hybrid = layout
    # A long-running server's pool is full of cached pages: half of the pages the measured steps
    # need are free, the other half must be evicted from the cache (so eviction cost is measured).
    own = running * (-(-(SYSTEM_PROMPT + PROMPT_TAIL + 128) // P) - SYSTEM_PROMPT // P + 1)
    new = running * (steps + 2) // P + running
    whole_pages = -(-cached_tokens // P) + own + new // 2
    pages = {}
    for s in specs:
        if s.windowed:  # windowed pools sized like the engine does: the windows of the running requests
            pages[s.name] = running * s.max_live_pages(P, P) + 64
        else:
            pages[s.name] = whole_pages
    kv = KVCacheManager(specs, pages, P, True, max_pages_per_request=MAX_MODEL_LEN // P + 1, max_requests=running)
    system = [1] * SYSTEM_PROMPT
    n_conv = max(1, cached_tokens // CONVERSATION)
    for i in range(n_conv):  # distinct conversations after the shared system prompt
        toks = system + [2 + i % 50000, 3 + i // 50000] * ((CONVERSATION - SYSTEM_PROMPT) // 2)
        rid = f"warm{i}"
        assert kv.allocate(rid, len(toks))
        kv.commit(rid, toks, len(toks), prompt_done=True)
        kv.retire(rid, toks, len(toks), turn_done=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=running, max_num_batched_tokens=1 << 20, max_model_len=MAX_MODEL_LEN), kv)
    for r in range(running):
        tail = [60000 + r] * (PROMPT_TAIL + r % 128)  # spread lengths: page crossings every step
        sched.add(Request(f"r{r}", system + tail, SamplingParams(max_tokens=10_000), max_tokens=10_000))
    runner = SimpleNamespace(layout=kv.layout(), windows={s.name: s.window for s in specs}, backend=backend)
    windows = runner.windows

    def metadata(model_input):
        items, num_decodes = ModelRunner.decodes_first(model_input.sequences)
        plan = kv.plan([s.request_id for s in items])  # the step's KV plan, as the engine builds it
        seqs = ModelRunner.step_sequences(runner, items, plan, num_decodes)
        if hybrid is not None:
            return build_hybrid_metadata(seqs, hybrid)
        return build_attention_metadata(seqs, windows, P)

    def step():
        out = sched.schedule()
        metadata(out.model_input())
        sched.update_after_step(out)
        for s in out.scheduled:
            if s.samples:
                s.request.append_output_token(7)
        return out

    first = step()  # prefill every running request (mostly a hit on the system prompt)
    assert len(first.scheduled) == running, "every request must be admitted"
    return kv, sched, step


def build_deep(layout, prefix_tokens: int, running: int = 16):
    """`running` requests whose prompts extend one cached prefix of prefix_tokens tokens."""
    specs, P, _ = layout
    doc = [5 + i % 1000 for i in range(prefix_tokens)]
    pages = {s.name: (running * s.max_live_pages(P, P) + 64 if s.windowed else prefix_tokens // P + 64 * running)
             for s in specs}
    kv = KVCacheManager(specs, pages, P, True, max_pages_per_request=prefix_tokens // P + 64, max_requests=running)
    for n in range(0, len(doc), 4096):  # chunked prefill: windowed pages are released as it goes
        end = min(len(doc), n + 4096)
        assert kv.allocate("doc", end)
        kv.commit("doc", doc, end, prompt_done=end == len(doc))
    kv.retire("doc", doc, len(doc), turn_done=True)
    limit = prefix_tokens + 4096
    sched = Scheduler(SchedulerConfig(max_num_seqs=running, max_num_batched_tokens=1 << 20, max_model_len=limit), kv)
    for r in range(running):
        tail = [60000 + r] * (1 + r * P // running)  # spread: one request crosses a page per step
        sched.add(Request(f"d{r}", doc + tail, SamplingParams(max_tokens=10_000), max_tokens=10_000))

    def step():
        out = sched.schedule()
        sched.update_after_step(out)
        for s in out.scheduled:
            if s.samples:
                s.request.append_output_token(7)
        return out

    first = step()
    assert len(first.scheduled) == running and all(s.start >= prefix_tokens - P for s in first.scheduled)
    return kv, sched, step


def measure(layout, cached: int, running: int, steps: int, deep: bool = False,
            backend: TorchNativeAttention | None = None) -> float:
    kv, sched, step = build_deep(layout, cached, running) if deep else build(layout, cached, running, steps, backend)
    step()  # warm
    gc.collect()
    gc.disable()
    t0 = time.perf_counter()
    for _ in range(steps):
        out = step()
        assert len(out.scheduled) == running and not out.preempted
    dt = time.perf_counter() - t0
    gc.enable()
    for r in list(sched.running):
        sched.finish(r, r.status)
    kv.assert_idle()
    return dt / steps * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=128, help="timed steps (128: a whole publication cycle)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="fewer configurations (256 requests only)")
    ap.add_argument("--caches", type=int, nargs=3, default=[10_000, 100_000, 1_000_000], metavar="TOKENS",
                    help="the three cached-token counts (small, middle, large; the smoke test shrinks them)")
    ap.add_argument("--running", type=int, nargs="+", default=None, help="running-request counts (default 1 64 256)")
    ap.add_argument("--decode-tiles", action="store_true",
                    help="the torch decode path's per-key tiles even where the CPU paged kernel builds")
    args = ap.parse_args(argv)
    backend = TorchNativeAttention(cpu_kernels=not args.decode_tiles)
    plan = "decode tiles (torch path)" if backend.needs_decode_tiles else "no decode tiles (CPU paged kernel)"
    print(f"decode metadata: {plan}")
    torch.set_num_threads(args.threads)
    caches = args.caches
    runnings = args.running or ([256] if args.quick else [1, 64, 256])
    results = {}
    for name, layout in (("dense p16", dense_layout()), ("v4 p128", v4_layout())):
        print(f"\n{name}: µs per step (scheduler + block manager + metadata; model stubbed)")
        print(f"{'running':>8} " + " ".join(f"{c:>12,}" for c in caches) + "   large/small")
        for running in runnings:
            row = [measure(layout, c, running, args.steps, backend=backend) for c in caches]
            results[(name, running)] = row
            print(f"{running:>8} " + " ".join(f"{v:>12.0f}" for v in row) + f"   {row[2] / row[0]:.2f}x")
    for name, layout in (("dense p16", dense_layout()), ("v4 p128", v4_layout())):
        row = [measure(layout, c, 16, args.steps, deep=True) for c in caches]
        print(f"\n{name}: 16 requests over one shared cached prefix, µs per step (scheduler + block manager)")
        print(f"{'prefix':>8} " + " ".join(f"{c:>12,}" for c in caches) + "   large/small")
        print(f"{'':>8} " + " ".join(f"{v:>12.0f}" for v in row) + f"   {row[2] / row[0]:.2f}x")
    dense = results[("dense p16", max(runnings))]
    print(f"RESULT us_per_step_256_100k={dense[1]:.1f} growth_1m_vs_10k={dense[2] / dense[0]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

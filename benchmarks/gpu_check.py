"""GPU check of the attention backends, for the day a CUDA device is lent (a few minutes).

    python benchmarks/gpu_check.py [--quick] [--skip-e2e] [--skip-bench]

Without a CUDA device it says so and exits 0 (CI runs it that way). On CUDA, three sections:

1. Kernels at realistic shapes, each available backend (triton dense, xformers in each key
   layout, torch_native on the GPU) against torch_native computed in float32 on the same
   cache: 32 sequences, contexts 2k-8k, page 16, GQA 32:4 (8:1), head dim 128, pages shuffled;
   a decode batch, a decode + prefill mix (4 chunks of 512 after 2k-6k cached), and the mix
   with a 4096-token sliding window. Error = max |out - ref| / max |ref|; tolerances: float32
   1e-4 (the kernels keep float32 operands at IEEE precision; ~1e-6 expected), bfloat16 3e-2
   (torch_native itself in bfloat16 lands at ~1e-2 of the float32 reference on these shapes).
2. End to end: the demo model (as every benchmark here: LLM(None) converts it once) in float32
   with each backend, greedy tokens equal to torch_native's on the GPU; the same with the host
   tier and every prefix loaded back (the side-stream, per-layer-event load path); and, when the V4
   hybrid Triton module exists, the tiny DeepSeek-V4 checkpoint of tests/tiny_deepseek_v4.py
   with attention_backend="triton" vs "torch_native" (it prints which class the V4 layers bound).
   The engine runs with device="cuda" (LLM's device option).
3. Decode-attention bandwidth: bytes of K/V a decode step must read / its time, per backend and
   dtype, against the device's peak measured as a device-to-device copy (read + write bytes).

Exit status 1 when any check fails (the failures are listed at the end), 0 otherwise.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import random
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

P, H, HKV, D = 16, 32, 4, 128
TOL = {"float32": 1e-4, "bfloat16": 3e-2}


class Report:
    def __init__(self) -> None:
        self.failures: list[str] = []

    def check(self, ok: bool, what: str) -> None:
        print(f"  [{'ok' if ok else 'FAIL'}] {what}", flush=True)
        if not ok:
            self.failures.append(what)

    @contextlib.contextmanager
    def section(self, what: str):
        try:
            yield
        except Exception:  # noqa: BLE001 - report and go on with the other checks
            traceback.print_exc()
            self.check(False, f"{what}: raised")


def module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


def backends_here(device) -> dict[str, str | None]:
    """name -> None when it can run here, else why not."""
    from hybridkv.attention_backends.registry import attention_backend_problem, available_attention_backends

    return {n: attention_backend_problem(n, device) for n in available_attention_backends()}


def make_backend(name: str, device):
    from hybridkv.attention_backends.registry import get_attention_backend

    return get_attention_backend(name, device)


# -- 1. kernels --------------------------------------------------------------------------------
class Batch:
    """A paged step on the GPU: random pool, shuffled pages, metadata moved to the device."""

    def __init__(self, spans: list[tuple[int, int]], window: int | None, device, seed: int = 0) -> None:
        import torch

        from hybridkv.attention_backends.metadata import StepSequences, build_attention_metadata
        from hybridkv.block_manager.space_spec import NULL_PAGE, window_start
        from hybridkv.model_executor.model_runner import _to_device

        rng = random.Random(seed)
        g = torch.Generator(device=device).manual_seed(seed)
        pages = sum(-(-(s + n) // P) for s, n in spans)
        pool = list(range(1, pages + 1))
        rng.shuffle(pool)
        tables = []
        for s, n in spans:
            t = [pool.pop() for _ in range(-(-(s + n) // P))]
            for i in range(window_start(s, window) // P):
                t[i] = NULL_PAGE
            tables.append(t)
        self.seqs = StepSequences.from_page_lists([n for _, n in spans], [s + n for s, n in spans], {"full": tables})
        self.meta = _to_device(build_attention_metadata(self.seqs, {"full": window}, P), device)
        slots = (pages + 1) * P
        self.k_cache = torch.randn(HKV, slots, D, device=device, generator=g)
        self.v_cache = torch.randn(HKV, slots, D, device=device, generator=g)
        self.k_cache[:, :P] = 0
        self.v_cache[:, :P] = 0
        T = sum(n for _, n in spans)
        self.q = torch.randn(T, H, D, device=device, generator=g)
        self.k = torch.randn(T, HKV, D, device=device, generator=g)
        self.v = torch.randn(T, HKV, D, device=device, generator=g)
        self.kv_keys = sum(s + n - window_start(s + n - 1, window) for s, n in spans[: self.meta.num_decode_tokens])

    def run(self, backend, dtype):
        """backend.forward in `dtype` (the cache copies are written, as in a real step)."""
        cast = lambda t: t.to(dtype)  # noqa: E731
        kc, vc = cast(self.k_cache), cast(self.v_cache)
        out = backend.forward(cast(self.q), cast(self.k), cast(self.v), kc, vc, self.meta, "full", D**-0.5)
        return out, kc, vc


def rel_err(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))


def kernel_checks(rep: Report, device, quick: bool) -> None:
    import torch

    from hybridkv.attention_backends.torch_native import TorchNativeAttention

    rng = random.Random(0)
    n = 8 if quick else 32
    decodes = [(rng.randint(2048, 8192) - 1, 1) for _ in range(n)]
    mixed = decodes[: n - 4] + [(rng.randint(2048, 6144), 512) for _ in range(4)]
    cases = [("decode", decodes, None), ("decode+prefill", mixed, None), ("decode+prefill window=4096", mixed, 4096)]
    avail = backends_here(device)
    print(f"backends here: { {k: (v or 'ok') for k, v in avail.items()} }")
    for title, spans, window in cases:
        batch = Batch(spans, window, device)
        ref, _, _ = batch.run(TorchNativeAttention(), torch.float32)
        print(f"{title}: {len(spans)} seqs, {batch.q.shape[0]} query tokens, contexts "
              f"{min(s + q for s, q in spans)}-{max(s + q for s, q in spans)}", flush=True)
        for dtype_name in ("float32", "bfloat16"):
            dtype = getattr(torch, dtype_name)
            runs: list[tuple[str, object, dict]] = [("torch_native", TorchNativeAttention(), {})]
            if avail.get("triton") is None:
                runs.append(("triton", make_backend("triton", device), {}))
            if avail.get("xformers") is None:
                from hybridkv.attention_backends.xformers_attention.bias import supported_layouts

                layouts = supported_layouts(dtype, window)
                runs += [(f"xformers[{lay}]", None, {"HYBRIDKV_XFORMERS_LAYOUT": lay}) for lay in layouts]
            for name, backend, env in runs:
                with rep.section(f"{title} {name} {dtype_name}"), _env(env):
                    backend = backend or make_backend("xformers", device)
                    out, _, _ = batch.run(backend, dtype)
                    err = rel_err(out, ref)
                    rep.check(err <= TOL[dtype_name] and not out.isnan().any(),
                              f"{title} {name} {dtype_name}: rel err {err:.2e} (tol {TOL[dtype_name]:.0e})")


def hisparse_swap_in_check(rep: Report, device, quick: bool) -> None:
    """The fused HiSparse swap-in kernel against its torch reference (HotBuffers.assign + copy)
    at V4-like sizes: buffers of 2x top-k 512, 512-wide entries, rounds over the same buffers.
    Slots, slot map, clock and copied bytes must be identical (the copy is exact), with the
    mirror on the device and with the mirror in (pinned) host memory, as the engine keeps it."""
    import torch

    from hybridkv.attention_backends.hisparse_reads import swap_in
    from hybridkv.attention_backends.triton_attention.hisparse_swap_in import triton_swap_in
    from hybridkv.attention_backends.hisparse_buffers import HotBuffers

    rows_n, size, k, D = (4, 256, 128, 128) if quick else (16, 1024, 512, 512)
    g = torch.Generator(device=device).manual_seed(0)
    ref, fused, fused_host = (HotBuffers(1, rows_n, size, k, device=device) for _ in range(3))
    for r in range(rows_n):
        for buffers in (ref, fused, fused_host):
            buffers.acquire(f"r{r}")
    mirror = torch.randn(8 * size, D, device=device, generator=g)
    host_mirror = mirror.cpu().pin_memory() if device.type == "cuda" else mirror.cpu()
    hot_ref = torch.zeros(ref.num_slots, D, device=device)
    hot_fused, hot_fused_host = hot_ref.clone(), hot_ref.clone()
    rows = torch.arange(rows_n, device=device)
    for round_ in range(6):
        entries = torch.stack([torch.randperm(3 * size, device=device, generator=g)[:k] for _ in range(rows_n)])
        mslots = torch.randint(0, mirror.shape[0], entries.shape, device=device, generator=g)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        want = swap_in(ref, 0, rows, entries, hot_ref, mirror, mslots)
        sync()
        t = time.perf_counter()
        got = triton_swap_in(fused, 0, rows, entries, hot_fused, mirror, mslots)
        sync()
        ms = (time.perf_counter() - t) * 1e3
        same = (torch.equal(got, want) and torch.equal(fused.entry, ref.entry) and torch.equal(fused.last_use, ref.last_use)
                and torch.equal(hot_fused, hot_ref))
        rep.check(same, f"hisparse swap-in round {round_}: {rows_n} rows x {k} of {size} slots, D={D}: "
                        f"{'identical' if same else 'DIFFERENT'} ({ms:.2f} ms, first round includes compilation)")
        t = time.perf_counter()
        got = triton_swap_in(fused_host, 0, rows, entries, hot_fused_host, host_mirror, mslots)
        sync()
        ms = (time.perf_counter() - t) * 1e3
        same = (torch.equal(got, want) and torch.equal(fused_host.entry, ref.entry)
                and torch.equal(hot_fused_host, hot_ref))
        rep.check(same, f"hisparse swap-in round {round_}, mirror in host memory: "
                        f"{'identical' if same else 'DIFFERENT'} ({ms:.2f} ms)")


@contextlib.contextmanager
def _env(values: dict):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# -- 2. end to end ------------------------------------------------------------------------------
PROMPTS = ["The capital of France is", "Write a haiku about the sea:", "1, 2, 3, 4,", "def fibonacci(n):"]


def greedy(model, backend: str, max_tokens: int, **kw) -> tuple[list[list[int]], object]:
    from hybridkv.entrypoints import LLM, SamplingParams

    llm = LLM(model, dtype="float32", attention_backend=backend, device="cuda", **kw)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def host_hit_check(rep: Report, ref: list[list[int]], tokens: int) -> None:
    """HiCache on CUDA: every prompt's prefix evicted from the device to pinned host pages, then
    the prompts again: the load-backs run on the side stream, layer by layer under events, and
    the greedy tokens equal the run without the host tier."""
    from hybridkv.entrypoints import LLM, SamplingParams

    llm = LLM(None, dtype="float32", attention_backend="torch_native", device="cuda", enable_hierarchical_cache=True)
    params = SamplingParams(max_tokens=tokens, temperature=0)
    llm.generate(PROMPTS, params, use_tqdm=False)
    kv = llm.engine.kv
    for name, space in kv.spaces.items():
        kv.index.evict(name, space.num_pages)
    llm.engine.executor.flush_copies()
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    from_host = sum(o.metrics["prompt_tokens_from_host"] for o in outs)
    rep.check(got == ref and from_host > 0,
              f"demo model with host-tier load-backs on the CUDA side stream: {from_host} prompt tokens from the "
              f"host, greedy {'equal' if got == ref else 'DIFFERENT'}")


def e2e_checks(rep: Report, device, quick: bool) -> None:
    avail = backends_here(device)
    tokens = 16 if quick else 48
    with rep.section("demo model torch_native"):
        ref, _ = greedy(None, "torch_native", tokens)
    with rep.section("demo model, host-tier load-back layer by layer"):
        host_hit_check(rep, ref, tokens)
        for name in ("triton", "xformers"):
            if avail.get(name) is not None:
                print(f"  [skip] demo model {name}: {avail[name]}")
                continue
            with rep.section(f"demo model {name}"):
                got, _ = greedy(None, name, tokens)
                same = sum(a == b for a, b in zip(got, ref))
                rep.check(got == ref, f"demo model float32 greedy, {name} == torch_native: {same}/{len(ref)} prompts")
    if not module_exists("hybridkv.attention_backends.triton_attention.hybrid_v4") or avail.get("triton"):
        print("  [skip] DeepSeek-V4 hybrid Triton: module or triton not available")
        return
    with rep.section("tiny DeepSeek-V4 triton vs torch_native"):
        import tempfile

        sys.path.insert(0, os.path.join(REPO, "tests"))
        from tiny_deepseek_v4 import build_v4_checkpoint

        path = build_v4_checkpoint(tempfile.mkdtemp(prefix="gpu_check_v4_"))
        ref, _ = greedy(path, "torch_native", tokens)
        got, llm = greedy(path, "triton", tokens)
        bound = sorted({type(getattr(m, "backend", None)).__name__ for m in llm.engine.runner.model.modules()
                        if hasattr(m, "backend")})
        print(f"  V4 layers bound: {bound}")
        same = sum(a == b for a, b in zip(got, ref))
        rep.check(got == ref, f"tiny V4 float32 greedy, triton == torch_native: {same}/{len(ref)} prompts")


# -- 3. decode bandwidth ------------------------------------------------------------------------
def timed(fn, repeats: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def bandwidth(rep: Report, device, quick: bool) -> None:
    import torch

    from hybridkv.attention_backends.torch_native import TorchNativeAttention

    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    peak = 2 * n / timed(lambda: dst.copy_(src), 10)
    del src, dst
    print(f"device-to-device copy (read + write): {peak / 1e9:.0f} GB/s, taken as the peak")
    rng = random.Random(1)
    spans = [(rng.randint(2048, 8192) - 1, 1) for _ in range(32 if not quick else 8)]
    batch = Batch(spans, None, device, seed=1)
    avail = backends_here(device)
    names = ["torch_native"] + [b for b in ("triton", "xformers") if avail.get(b) is None]
    print(f"decode: {len(spans)} seqs, {batch.kv_keys} keys, H={H} Hkv={HKV} D={D} page {P}")
    print(f"{'backend':<14}{'dtype':<10}{'time':>10}{'K/V bytes':>12}{'GB/s':>9}{'of peak':>9}")
    for dtype_name in ("bfloat16", "float32"):
        dtype = getattr(torch, dtype_name)
        q, k, v = batch.q.to(dtype), batch.k.to(dtype), batch.v.to(dtype)
        kc, vc = batch.k_cache.to(dtype), batch.v_cache.to(dtype)
        nbytes = 2 * batch.kv_keys * HKV * D * kc.element_size()
        for name in names:
            with rep.section(f"bandwidth {name} {dtype_name}"):
                be = TorchNativeAttention() if name == "torch_native" else make_backend(name, device)
                t = timed(lambda: be.forward(q, k, v, kc, vc, batch.meta, "full", D**-0.5), 5 if quick else 20)
                print(f"{name:<14}{dtype_name:<10}{t * 1e6:>8.0f}us{nbytes / 1e6:>10.0f}MB"
                      f"{nbytes / t / 1e9:>9.0f}{nbytes / t / peak:>9.0%}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 sequences instead of 32, fewer tokens and repeats")
    ap.add_argument("--skip-e2e", action="store_true", help="skip the end-to-end model runs")
    ap.add_argument("--skip-bench", action="store_true", help="skip the decode bandwidth benchmark")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print(f"no CUDA device (torch {torch.__version__}): nothing to check; run this on a GPU machine")
        return 0
    import logging

    logging.basicConfig(level=logging.WARNING)
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
    rep = Report()
    t0 = time.perf_counter()
    print("\n== 1. kernels vs torch_native (float32 reference)")
    with rep.section("kernels"):
        kernel_checks(rep, device, args.quick)
        hisparse_swap_in_check(rep, device, args.quick)
    if not args.skip_e2e:
        print("\n== 2. end to end, greedy, float32")
        with rep.section("end to end"):
            e2e_checks(rep, device, args.quick)
    if not args.skip_bench:
        print("\n== 3. decode attention bandwidth")
        with rep.section("bandwidth"):
            bandwidth(rep, device, args.quick)
    print(f"\n{len(rep.failures)} failure(s) in {time.perf_counter() - t0:.0f}s" + "".join(f"\n  {f}" for f in rep.failures))
    return 1 if rep.failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""Prefix reuse with the shadow prefix index: prefill tokens computed and wall time with the
cache vs without, hit rates, and the index's own match+insert overhead.

Workloads (each run with caching on, off, and the baseline that drops a prefix as soon as any
windowed page on it is gone), on a tiny DeepSeek-V4 config (window 16, page 32, one sequence
at a time so the SWA pool holds one window + one chunk) and on the demo model (dense):
  shared-system-prompt  N requests = one long system prompt + a short distinct question
  multi-turn            8 turns, each prompt = the whole history + a new user message
Then the per-request overhead of ShadowIndex.match + insert on a tree holding 100k tokens
(target < 1 ms per request).

    python benchmarks/prefix_reuse.py [--requests 8] [--turns 8] [--quick]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402

from hybridkv.block_manager.block_space import BlockSpace  # noqa: E402
from hybridkv.block_manager.shadow_index import ShadowIndex  # noqa: E402
from hybridkv.block_manager.space_spec import SpaceSpec  # noqa: E402
from hybridkv.engine.sampling_params import SamplingParams  # noqa: E402
from hybridkv.entrypoints import LLM  # noqa: E402

MODES = {"no cache": dict(enable_prefix_caching=False), "drop-whole-prefix": dict(windowed_match=False), "shadow index": {}}


def _tokens(n: int, vocab: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _generate(llm: LLM, prompt: list[int], max_tokens: int):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]


def shared_system_prompt(llm: LLM, vocab: int, n: int) -> tuple[int, int, list]:
    rng = random.Random(0)
    system = _tokens(400, vocab, rng)
    prompts = [{"prompt_token_ids": system + _tokens(20, vocab, rng)} for _ in range(n)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    total = sum(len(p["prompt_token_ids"]) for p in prompts)
    return total, sum(o.num_cached_tokens for o in outs), [o.outputs[0].token_ids for o in outs]


def multi_turn(llm: LLM, vocab: int, turns: int) -> tuple[int, int, list]:
    rng = random.Random(1)
    history = _tokens(300, vocab, rng)
    total = cached = 0
    outs = []
    for _ in range(turns):
        prompt = history + _tokens(30, vocab, rng)
        out = _generate(llm, prompt, 16)
        total += len(prompt)
        cached += out.num_cached_tokens
        outs.append(out.outputs[0].token_ids)
        history = prompt + out.outputs[0].token_ids
    return total, cached, outs


def run_workloads(name: str, make_llm, args) -> None:
    print(f"\n== {name} ==")
    print(f"{'workload':<22}{'mode':<20}{'prefill computed':>17}{'hit rate':>10}{'wall s':>9}{'vs no cache':>13}")
    for wname, fn, arg in (("shared-system-prompt", shared_system_prompt, args.requests), ("multi-turn", multi_turn, args.turns)):
        base_wall, base_out = None, None
        for mode, kw in MODES.items():
            llm = make_llm(**kw)
            vocab = llm.engine.runner.config.vocab_size
            t0 = time.perf_counter()
            total, cached, outs = fn(llm, vocab, arg)
            wall = time.perf_counter() - t0
            if base_wall is None:
                base_wall, base_out = wall, outs
            same = "" if outs == base_out else "  OUTPUTS DIFFER"
            print(f"{wname:<22}{mode:<20}{total - cached:>17}{cached / total:>10.3f}{wall:>9.2f}{base_wall / wall:>12.2f}x{same}")


def index_overhead(total_tokens: int = 100_000, page: int = 128, prompt: int = 2048, reps: int = 200) -> None:
    """match + insert of a 2k-token request (sharing a random prefix of a cached sequence) on a
    V4-like six-space index that already holds total_tokens tokens."""
    specs = [SpaceSpec("swa", 1, 1, window=128), SpaceSpec("c4", 4, 1), SpaceSpec("c128", 128, 1),
             SpaceSpec("indexer", 4, 1), SpaceSpec("state_c4", 1, 1, window=8, ring=8, align=4),
             SpaceSpec("state_c128", 1, 1, window=128, ring=128, align=128)]
    n_pages = total_tokens // page + 4 * (prompt // page) + 8
    spaces = {s.name: BlockSpace(s, n_pages, page) for s in specs}
    index = ShadowIndex(spaces, page)
    rng = random.Random(2)
    seqs = []
    while sum(len(s) for s in seqs) < total_tokens:
        toks = [rng.randrange(1000) for _ in range(prompt)]
        pages = {name: sp.allocate(len(toks) // page) for name, sp in spaces.items()}
        index.insert(toks, pages)
        for name, sp in spaces.items():
            for p in pages[name]:
                sp.decref(p)
        seqs.append(toks)
    held = sum(len(s) for s in seqs)
    t0 = time.perf_counter()
    for i in range(reps):
        base = seqs[rng.randrange(len(seqs))]
        cut = rng.randrange(len(base) // page) * page
        toks = base[:cut] + [rng.randrange(1000) for _ in range(prompt - cut)]
        hit = index.match(toks, max_pages=(len(toks) - 1) // page)
        receipt = index.lock(hit.nodes[-1], 256) if hit.nodes else None
        # the request records the pages it computed (borrowing the hit's pages for the shared part)
        new = len(toks) // page - len(hit.nodes)
        fresh = {name: sp.allocate(new) for name, sp in spaces.items()}
        pages = {name: [nd.shadows[name] if nd.shadows[name] is not None else -1 for nd in hit.nodes] + fresh[name]
                 for name in spaces}
        index.insert(toks, pages, start=hit.nodes[-1] if hit.nodes else None)
        if receipt is not None:
            index.unlock(receipt)
        for name, sp in spaces.items():
            for p in fresh[name]:
                sp.decref(p)
        index.evict("c4", new)  # keep the tree at ~total_tokens (eviction is timed too)
    per = (time.perf_counter() - t0) / reps * 1e3
    index.check_invariants()
    print(f"\n== index overhead ==\nmatch+lock+insert+unlock(+evict) of a {prompt}-token request on a tree of "
          f"{held} tokens ({index.num_nodes} nodes, page {page}): {per:.3f} ms per request (target < 1 ms)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="index overhead only")
    args = ap.parse_args()
    torch.set_num_threads(1)
    index_overhead()
    if args.quick:
        return
    from tiny_deepseek_v4 import build_v4_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        v4 = build_v4_checkpoint(os.path.join(tmp, "v4"))

        def make_v4(**kw):
            return LLM(v4, dtype="float32", block_size=32, max_model_len=1024, max_num_seqs=1,
                       max_num_batched_tokens=64, **kw)

        run_workloads("DeepSeek-V4 tiny (window 16, page 32, SWA pool = one window + one chunk)", make_v4, args)

        def make_demo(**kw):
            return LLM(None, dtype="float32", max_model_len=1024, **kw)

        run_workloads("demo model (dense: no windowed space, so both cache modes match)", make_demo, args)


if __name__ == "__main__":
    main()

"""HiSparse's hot-buffer hit rate when the top-k comes from a trained model's real attention.

HiSparse keeps each decoding request's full C4 history in a host mirror and only a hot buffer
of C4 entries (4:1 groups of tokens) per CSA layer on the device; its premise is that adjacent
decode steps' top-k selections mostly overlap, so a buffer of a few times top-k keeps most
reads on the device. benchmarks/hisparse.py measures the engine end to end, but on a random
V4 whose indexer has no temporal locality. No trained V4 fits this machine, so this script
uses the demo model (SmolLM2-135M-Instruct, real weights, 30 layers, 9 heads) as a stand-in
for the lightning indexer and drives the engine's own LRU (attention_backends/hisparse_buffers.py,
HotBuffers, imported, not re-implemented) with its selections:

  indexer stand-in  per layer and decode position t: the softmax attention row of every head
                    over [0, t] (causal: what decode at t sees), summed over each 4-token group
                    g = tokens [4g, 4g+4) (the group's attention mass), then aggregated over
                    heads (--heads: mean, the closest to the indexer's one score summed over
                    its heads; or max); only closed groups that end before the last --window
                    tokens (V4's sliding window reads those directly) compete; top --topk.
  buffer policy     as the engine: when decode starts, the most recent `size` closed entries
                    are inserted (hand-off); each entry that closes during decode is inserted;
                    each step's selection is assigned (hits stay, misses take LRU slots).
                    One buffer per layer; sizes --multiples x top-k.
  decode steps      one forward over the decoded tokens, with the prompt's KV cache, with
                    output_attentions: row i is what decode step i would see.

Regimes: (1) document QA: a license text (about --context tokens) and a question in the chat
template, then a written reference answer, teacher-forced (about 130 tokens); (2) free generation: greedy continuation of another long
text (--gen-tokens); (3) synthetic drift: each step keeps a fraction p of the previous top-k
and replaces the rest with entries outside it, at random (--drift), over --drift-entries
entries, no inserts: how the hit rate falls with drift.

Reported per regime and buffer size: hit rate (selected entries found in the buffer), the
adjacent-step overlap |S_t & S_(t-1)| / k, and the bytes moved per step and CSA layer: misses x
584 B, DeepSeek-V4-Flash's C4 entry as released (FP8 448-dim no-rope part, bf16 64-dim rope
part, scales; SGLang's C4 pool, /work/shared/reference/deepseek_v4.md; bf16 would be 1,024 B).

    python benchmarks/hisparse_locality.py     # ~3 minutes on 2 cores (--context 4096: ~6)
    [--context 2048 --gen-tokens 128 --topk 64 --window 128
     --multiples 1 2 4 8 16 --heads mean max --drift 0.9 0.7 0.5 0.2 --threads N --skip-model]

Last line: RESULT qa_hit_2x=... gen_hit_2x=... qa_overlap=... gen_overlap=... drift_hit_2x_p0.5=...
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from hybridkv.attention_backends.hisparse_buffers import NO_ENTRY, HotBuffers
from cpu_info import cpu_name  # noqa: E402  (benchmarks/ is the script's folder)

GROUP = 4  # DeepSeek-V4's csa_ratio: one C4 entry per 4 tokens
ENTRY_BYTES = 584  # V4-Flash C4 entry as released (FP8 nope 448 + bf16 rope 64 x 2 + 8 B scales)

QA_TEXT = "/usr/share/common-licenses/GPL-3"
QA_QUESTION = ("Question: according to the license above, what must you do when you convey a covered "
               "work in object code form? Answer in a few sentences.")
# The answer is teacher-forced (a 135M model's own answer is a few words, then an end of turn):
# its rows are what decode would see while writing it.
QA_ANSWER = ("Under section 6 of the license, you may convey a covered work in object code form only if you "
             "also convey the machine-readable Corresponding Source under the terms of this License. You can "
             "do this by shipping the source with the physical product, by a written offer valid for at "
             "least three years to give anyone who possesses the object code a copy of the source, by "
             "offering access to copy the source from the same place at no further charge, or by "
             "peer-to-peer transmission if you tell other peers where the source is offered. For a User "
             "Product you must also provide the Installation Information needed to install and run "
             "modified versions, unless the code cannot be modified by anyone.")
GEN_TEXTS = ["/usr/share/common-licenses/Apache-2.0", "/usr/share/common-licenses/MPL-2.0",
             "/usr/share/common-licenses/GFDL-1.3"]


# -- the indexer stand-in --------------------------------------------------------------------
def pool_groups(probs: torch.Tensor, t: int, window: int, heads: str) -> torch.Tensor:
    """Scores of the C4 entries query position t may select: probs [H, >= t+1] is t's attention
    row per head; group g sums tokens [4g, 4g+4); only groups that end at or before t+1-window
    (closed, and older than the sliding window) are kept; heads aggregated by mean or max."""
    n = max(0, (t + 1 - window) // GROUP)
    grouped = probs[:, :n * GROUP].reshape(probs.shape[0], n, GROUP).sum(dim=2)  # [H, n]
    if heads == "mean":
        return grouped.mean(dim=0)
    if heads == "max":
        return grouped.amax(dim=0)
    raise ValueError(f"heads must be mean or max, not {heads!r}")


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The top-k entry indices (all of them when fewer than k exist), ties by lower index."""
    k = min(k, scores.numel())
    if k == 0:
        return torch.zeros(0, dtype=torch.long)
    # Stable order so equal scores pick the same entries every step.
    return torch.sort(scores, descending=True, stable=True).indices[:k]


# -- driving HotBuffers ----------------------------------------------------------------------
class Tally:
    def __init__(self) -> None:
        self.lookups = self.hits = self.steps = 0
        self.overlap_sum = 0.0
        self.overlap_n = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 1.0

    @property
    def overlap(self) -> float:
        return self.overlap_sum / self.overlap_n if self.overlap_n else 1.0

    @property
    def misses_per_step(self) -> float:
        return (self.lookups - self.hits) / self.steps if self.steps else 0.0


def run_buffer(selections: list[torch.Tensor], size: int, topk: int, closed: list[int] | None = None,
               first_closed: int = 0) -> Tally:
    """Feed one layer's per-step selections to a HotBuffers of `size` slots. With closed
    (the number of closed entries at each step), the engine's inserts happen too: the most
    recent `size` entries closed before the first step (hand-off), then every entry that
    closes, before that step's selection."""
    buf = HotBuffers(num_layers=1, max_requests=1, size=size, topk=topk)
    buf.acquire("r")
    rows = torch.zeros(1, dtype=torch.long)
    tally = Tally()

    def insert(entries: list[int]) -> None:
        for i in range(0, len(entries), size):
            chunk = torch.tensor(entries[i:i + size], dtype=torch.long)[None]
            buf.assign(0, rows, chunk, insert=True)

    if closed is not None and first_closed:
        insert(list(range(max(0, first_closed - size), first_closed)))
    have = first_closed
    prev = None
    for step, sel in enumerate(selections):
        if closed is not None and closed[step] > have:
            insert(list(range(have, closed[step])))
            have = closed[step]
        before = (buf.stats.lookups, buf.stats.hits)
        entries = torch.full((1, topk), NO_ENTRY, dtype=torch.long)
        entries[0, :sel.numel()] = sel
        buf.assign(0, rows, entries)
        tally.lookups += buf.stats.lookups - before[0]
        tally.hits += buf.stats.hits - before[1]
        tally.steps += 1
        if prev is not None and sel.numel():
            tally.overlap_sum += len(set(sel.tolist()) & set(prev.tolist())) / sel.numel()
            tally.overlap_n += 1
        prev = sel
    buf.check_invariants()
    return tally


def drift_selections(steps: int, entries: int, k: int, p: float, seed: int = 0) -> list[torch.Tensor]:
    """Step 0 picks k random entries; each later step keeps round(p k) of the previous ones
    and replaces the rest with entries not in the previous selection, at random: the
    adjacent-step overlap is p exactly."""
    g = torch.Generator().manual_seed(seed)
    sel = torch.randperm(entries, generator=g)[:k]
    out = [sel]
    keep = round(p * k)
    for _ in range(steps - 1):
        kept = sel[torch.randperm(k, generator=g)[:keep]]
        outside = torch.ones(entries, dtype=torch.bool)
        outside[sel] = False
        pool = outside.nonzero().flatten()
        fresh = pool[torch.randperm(pool.numel(), generator=g)[:k - keep]]
        sel = torch.cat([kept, fresh])
        out.append(sel)
    return out


def run_drift(ps: list[float], multiples: list[int], k: int, entries: int, steps: int) -> dict:
    res = {}
    for p in ps:
        sels = drift_selections(steps, entries, k, p)
        for m in multiples:
            res[(p, m)] = run_buffer(sels, m * k, k)
    return res


# -- the model -------------------------------------------------------------------------------
def read_text(paths: list[str]) -> str:
    parts = []
    for p in paths:
        if os.path.exists(p):
            with open(p, encoding="utf-8", errors="replace") as f:
                parts.append(f.read())
    if not parts:  # no licenses on this machine: the stdlib's own docstrings are English too
        import ast
        stdlib = os.path.dirname(os.__file__)
        for name in sorted(os.listdir(stdlib)):
            if name.endswith(".py"):
                try:
                    with open(os.path.join(stdlib, name), encoding="utf-8") as f:
                        tree = ast.parse(f.read())
                except (OSError, SyntaxError, UnicodeDecodeError):
                    continue
                for node in ast.walk(tree):
                    if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)):
                        d = ast.get_docstring(node)
                        if d and len(d) > 400:
                            parts.append(d)
            if sum(map(len, parts)) > 60000:
                break
    return "\n\n".join(parts)


@torch.no_grad()
def decode_rows(model, tok, prompt_ids: torch.Tensor, new_tokens: int,
                forced: torch.Tensor | None = None) -> tuple[list[torch.Tensor], list[int], int, str]:
    """Greedy-decode new_tokens after prompt_ids (or take the forced tokens [1, N]); then, with the prompt's KV cache cut back to the
    prompt, one forward
    over the decoded tokens with output_attentions. Returns per layer the attention rows
    [H, N, P+N] of the N decode steps (the decoded tokens' positions P .. P+N-1), their
    absolute positions, and P."""
    P = prompt_ids.shape[1]
    # Decoding runs on SDPA (no attention weights needed); the rows come from eager below.
    model.set_attn_implementation("sdpa")
    pre = model(prompt_ids, use_cache=True)
    cache, nxt, gen = pre.past_key_values, pre.logits[:, -1].argmax(-1, keepdim=True), []
    if forced is not None:
        gen = forced
    else:
        for _ in range(new_tokens):
            gen.append(nxt)
            out = model(nxt, past_key_values=cache, use_cache=True)
            cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        gen = torch.cat(gen, dim=1)
        cache.crop(-new_tokens)  # back to the prompt: the decoded tokens are fed again in one forward
    model.set_attn_implementation("eager")
    att = model(gen, past_key_values=cache, use_cache=True, output_attentions=True).attentions
    rows = [a[0].float() for a in att]
    return rows, list(range(P, P + gen.shape[1])), P, tok.decode(gen[0])


def model_regime(rows: list[torch.Tensor], positions: list[int], k: int, window: int, heads: str,
                 multiples: list[int]) -> dict:
    """Per layer: the steps' selections, fed to a buffer per size with the engine's inserts."""
    closed = [(t + 1) // GROUP for t in positions]  # entries closed at each step (inserted as they close)
    first_closed = positions[0] // GROUP  # closed before the first decode step (hand-off)
    per_layer = []
    for r in rows:
        sels = [select_topk(pool_groups(r[:, i], t, window, heads), k) for i, t in enumerate(positions)]
        per_layer.append({m: run_buffer(sels, m * k, k, closed, first_closed) for m in multiples})
    return per_layer


def summarize(per_layer: list[dict], m: int) -> tuple[float, float, float]:
    """Mean over layers of hit rate, overlap, misses per step."""
    L = len(per_layer)
    return (sum(d[m].hit_rate for d in per_layer) / L, sum(d[m].overlap for d in per_layer) / L,
            sum(d[m].misses_per_step for d in per_layer) / L)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=2048, help="tokens of text before the question / continuation")
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--window", type=int, default=128, help="newest tokens left to the sliding window (0 = none)")
    ap.add_argument("--multiples", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--heads", nargs="+", default=["mean", "max"], choices=["mean", "max"])
    ap.add_argument("--drift", type=float, nargs="+", default=[0.9, 0.7, 0.5, 0.2])
    ap.add_argument("--drift-entries", type=int, default=1024, help="C4 entries the drift regime draws from")
    ap.add_argument("--drift-steps", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--skip-model", action="store_true", help="the drift regime only")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    k, mults = args.topk, args.multiples
    print(f"CPU: {cpu_name()} ({torch.get_num_threads()} threads)")
    print("command: python benchmarks/hisparse_locality.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(f"top-k {k}, window {args.window}, buffers {', '.join(f'{m}x' for m in mults)} top-k; "
          f"bytes = misses x {ENTRY_BYTES} B (V4-Flash C4 entry) per step and CSA layer")
    result: dict[str, float] = {}
    table: list[tuple] = []

    if not args.skip_model:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from hybridkv.model_executor.demo_model import ensure_demo_model

        path = ensure_demo_model()
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
        cfg = model.config
        print(f"model: SmolLM2-135M-Instruct ({path}), {cfg.num_hidden_layers} layers, "
              f"{cfg.num_attention_heads} heads, eager attention, float32")
        regimes = []
        doc = tok(read_text([QA_TEXT]), add_special_tokens=False).input_ids[:args.context]
        msgs = [{"role": "user", "content": tok.decode(doc) + "\n\n" + QA_QUESTION}]
        qa_ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        qa_ids = qa_ids["input_ids"] if not torch.is_tensor(qa_ids) else qa_ids
        answer = torch.tensor([tok(QA_ANSWER, add_special_tokens=False).input_ids])
        regimes.append(("qa", "document QA", qa_ids, answer))
        gen_doc = tok(read_text(GEN_TEXTS), add_special_tokens=False).input_ids[:args.context]
        regimes.append(("gen", "free generation", torch.tensor([gen_doc]), None))
        for key, name, ids, forced in regimes:
            t0 = time.perf_counter()
            rows, positions, P, text = decode_rows(model, tok, ids, args.gen_tokens, forced)
            t_model = time.perf_counter() - t0
            print(f"\n{name}: {P}-token prompt, {len(positions)} decode steps ({t_model:.0f} s of model); "
                  f"decoded: {text[:160]!r}")
            for heads in args.heads:
                per_layer = model_regime(rows, positions, k, args.window, heads, mults)
                for m in mults:
                    hit, ov, miss = summarize(per_layer, m)
                    table.append((f"{name} ({heads} over heads)", m, hit, ov, miss))
                    if heads == args.heads[0]:
                        result[f"{key}_hit_{m}x"] = hit
                result_ov = summarize(per_layer, mults[0])[1]
                if heads == args.heads[0]:
                    result[f"{key}_overlap"] = result_ov
                ref = 2 if 2 in mults else mults[0]
                hits = [d[ref].hit_rate for d in per_layer]
                ovs = [d[ref].overlap for d in per_layer]
                print(f"  {heads} over heads, per layer (hit at {ref}x / overlap, %): " + " ".join(
                    f"{i}:{100 * h:.0f}/{100 * o:.0f}" for i, (h, o) in enumerate(zip(hits, ovs))))
            del rows

    drift = run_drift(args.drift, mults, k, args.drift_entries, args.drift_steps)
    for p in args.drift:
        for m in mults:
            t = drift[(p, m)]
            table.append((f"synthetic drift p={p} ({args.drift_entries} entries)", m, t.hit_rate, t.overlap,
                          t.misses_per_step))
            result[f"drift_hit_{m}x_p{p}"] = t.hit_rate

    print("\n| regime | buffer | hit rate | adjacent-step overlap | misses / step | bytes / step / CSA layer |")
    print("|---|---|---|---|---|---|")
    for name, m, hit, ov, miss in table:
        print(f"| {name} | {m}x ({m * k}) | {100 * hit:.1f}% | {100 * ov:.1f}% | {miss:.1f} | "
              f"{miss * ENTRY_BYTES:,.0f} |")
    print("RESULT " + " ".join(f"{key}={v:.4f}" for key, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

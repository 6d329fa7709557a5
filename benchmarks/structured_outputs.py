"""Structured outputs: the per-output-token cost of constrained decoding against none, and grammar
compile time, on the demo model.

One process, one model load per engine: an engine with num_scheduler_steps=1 runs every
workload unconstrained and constrained (a JSON schema: an array of at least 200 integers, so no
sequence finishes before max_tokens and both runs generate the same number of tokens), at batch 1
and batch 32, in alternating rounds; a second engine with the offline default
(num_scheduler_steps=8: decode bursts, which a constrained request never takes) runs the
unconstrained workloads too. Prints each round's ms per output token, the median ratios, and the
share of the constrained runs' wall time spent on grammar work (the matchers' masks and applying
them to the logits, timed inside the steps: steadier than a ratio of two runs on a busy
machine), and the compile time of fresh schemas (cache misses) and of a cached one. Last line:
    RESULT b1_ratio=<median> b32_ratio=<median> b32_ratio_vs_bursts=<median> b32_grammar_share=<median>
    compile_ms=<median>

    python benchmarks/structured_outputs.py [--rounds 3] [--max-tokens 64] [--dtype auto]
"""
from __future__ import annotations

import argparse
import statistics
import time

import hybridkv  # noqa: F401  (before torch: the OpenMP runtime the engine uses)
from hybridkv import LLM, SamplingParams, StructuredOutputsParams
from hybridkv.cpu_features import cpu_features

SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100000}, "minItems": 200}
QUESTIONS = ["List some numbers as a JSON array.", "Give me the first primes in JSON.",
             "Write a JSON array of years.", "Output a JSON list of scores."]


def prompts(llm: LLM, n: int) -> list[str]:
    tok = llm.get_tokenizer()
    return [tok.apply_chat_template([{"role": "user", "content": f"{QUESTIONS[i % 4]} (#{i})"}], tokenize=False,
                                    add_generation_prompt=True) for i in range(n)]


def ms_per_token(llm: LLM, batch: list[str], max_tokens: int, constrained: bool) -> float:
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, structured_outputs=so)
    llm.reset_prefix_cache()
    t = time.perf_counter()
    outs = llm.generate(batch, sp, use_tqdm=False)
    seconds = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    if constrained:
        assert all(o.outputs[0].finish_reason == "length" for o in outs), "a constrained run finished early"
    return seconds * 1e3 / n


class GrammarTimer:
    """Seconds the engine spends on grammar work in constrained steps: the matchers' bitmask
    (engine side) and applying it to the logits (sampler side). Less sensitive to a busy machine
    than the ratio of two runs: both are measured inside the same steps."""

    def __init__(self, llm: LLM) -> None:
        import hybridkv.model_executor.sampler as sampler_module

        self.mask = self.apply = 0.0
        self.steps = 0
        structured, build, apply = llm.engine.structured, llm.engine.structured.bitmask, sampler_module.apply_token_bitmask

        def timed_build(scheduled):
            t = time.perf_counter()
            out = build(scheduled)
            self.mask += time.perf_counter() - t
            self.steps += out is not None
            return out

        def timed_apply(*a):
            t = time.perf_counter()
            out = apply(*a)
            self.apply += time.perf_counter() - t
            return out

        structured.bitmask, sampler_module.apply_token_bitmask = timed_build, timed_apply

    def take(self) -> tuple[float, float, int]:
        out = (self.mask, self.apply, self.steps)
        self.mask = self.apply = 0.0
        self.steps = 0
        return out


def compile_ms(llm: LLM, count: int) -> tuple[list[float], float]:
    """Wall time of `count` fresh schemas (cache misses, one at a time), then of a cached one."""
    structured = llm.engine.structured
    fresh = []
    for i in range(count):
        schema = {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 10 + i}, "age": {"type": "integer", "minimum": 0},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {
                "type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city"]}},
            "required": ["name", "age"]}
        t = time.perf_counter()
        structured.check([StructuredOutputsParams(json=schema)])
        fresh.append((time.perf_counter() - t) * 1e3)
    t = time.perf_counter()
    structured.check([StructuredOutputsParams(json=SCHEMA)])
    return fresh, (time.perf_counter() - t) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the built-in demo model")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    print(f"CPU: {cpu_features().describe()}")
    llm = LLM(args.model, dtype=args.dtype, num_scheduler_steps=1, max_model_len=1024)
    bursts = LLM(args.model, dtype=args.dtype, max_model_len=1024)  # the offline default: decode bursts
    t = time.perf_counter()
    llm.engine.structured.check([StructuredOutputsParams(json=SCHEMA)])  # the tokenizer's one-time preparation
    print(f"dtype {llm.engine.runner.dtype}; first compile (tokenizer preparation included): "
          f"{(time.perf_counter() - t) * 1e3:.0f} ms")
    work = {"b1": prompts(llm, 1), "b32": prompts(llm, 32)}
    for engine in (llm, bursts):  # warm-up
        ms_per_token(engine, work["b1"], 8, False)
    ms_per_token(llm, work["b1"], 8, True)
    ratios: dict[str, list[float]] = {"b1": [], "b32": [], "b32_vs_bursts": []}
    grammar_share: dict[str, list[float]] = {"b1": [], "b32": []}
    timer = GrammarTimer(llm)
    for r in range(args.rounds):
        for name, batch in work.items():
            plain = ms_per_token(llm, batch, args.max_tokens, False)
            timer.take()
            t = time.perf_counter()
            constrained = ms_per_token(llm, batch, args.max_tokens, True)
            total = time.perf_counter() - t
            mask, apply, steps = timer.take()
            grammar_share[name].append((mask + apply) / total)
            line = (f"round {r} {name}: none {plain:.2f} ms/token, constrained {constrained:.2f} (x{constrained / plain:.3f}); "
                    f"grammar work {(mask + apply) / total:.1%} of the run (mask {mask / steps * 1e3:.2f} + apply "
                    f"{apply / steps * 1e3:.2f} ms a step)")
            ratios[name].append(constrained / plain)
            if name == "b32":
                burst = ms_per_token(bursts, batch, args.max_tokens, False)
                ratios["b32_vs_bursts"].append(constrained / burst)
                line += f"; none with bursts {burst:.2f} (x{constrained / burst:.3f})"
            print(line, flush=True)
    fresh, cached = compile_ms(llm, 10)
    med = {k: statistics.median(v) for k, v in ratios.items()}
    print(f"median constrained/none per output token: batch 1 x{med['b1']:.3f}, batch 32 x{med['b32']:.3f} "
          f"(against bursts x{med['b32_vs_bursts']:.3f})")
    print(f"grammar work in constrained runs (median share of wall time): batch 1 "
          f"{statistics.median(grammar_share['b1']):.1%}, batch 32 {statistics.median(grammar_share['b32']):.1%}")
    print(f"compile, fresh schemas: median {statistics.median(fresh):.2f} ms (min {min(fresh):.2f}, max "
          f"{max(fresh):.2f}); cached: {cached:.3f} ms")
    print(f"RESULT b1_ratio={med['b1']:.3f} b32_ratio={med['b32']:.3f} b32_ratio_vs_bursts={med['b32_vs_bursts']:.3f} "
          f"b32_grammar_share={statistics.median(grammar_share['b32']):.3f} compile_ms={statistics.median(fresh):.2f}")


if __name__ == "__main__":
    main()

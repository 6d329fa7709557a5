"""Fairness under load (engine/scheduler.py, engine/scheduling_policy.py, engine/async_llm_engine.py):

- latency target: while a request decodes, every step's estimated cost stays within the timer's
  budget (or is the one guaranteed minimum prefill chunk), chunks shrink as a prompt's context
  grows, and outputs are the same tokens as without the target;
- with a longest step above the target, decode-only steps bank time for longer prefill steps,
  none planned past the longest step, and outputs are still the same tokens;
- while streamed prompts wait and nothing decodes, steps are held to the longest step, so the
  prompts get their first tokens one after another;
- when nobody streams, the token budget alone applies (throughput);
- admission is round-robin across client requests: a request that fans out into many sequences
  does not hold a later request back;
- the bounded queue refuses an add that would overfill it, and nothing is left behind.
"""
from __future__ import annotations

import asyncio

import pytest

from hybridkv.engine.async_llm_engine import AsyncLLMEngine, EngineQueueFullError, GenerateRequest
from hybridkv.engine.config import EngineConfig
from hybridkv.engine.llm_engine import LLMEngine
from hybridkv.engine.sampling_params import SamplingParams

LONG = [(7 * i + 3) % 200 + 10 for i in range(400)]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _freeze(engine: LLMEngine, gflops_per_s: float, fixed: float = 0.0) -> None:
    """Pin the timer's estimates so the budget is known (it would otherwise learn from timings)."""
    timer = engine.scheduler.timer
    timer.seconds_per_flop, timer.overhead_seconds = 1 / (gflops_per_s * 1e9), fixed
    timer.min_sample_flops = float("inf")  # learn nothing from this run


def _run_long_prompt_beside_a_stream(engine: LLMEngine) -> tuple[list, list[int], list[int]]:
    """A stream decodes while a long prompt arrives; returns per-step plans and both outputs."""
    engine.add_request("stream", [5, 6, 7, 8], _greedy(60))
    for _ in range(3):
        engine.step()
    engine.add_request("long", list(LONG), _greedy(4))
    plans, outs = [], {}
    original = engine.scheduler.schedule

    def recording():
        out = original()
        budget = engine.scheduler.timer.budget_flops if engine.scheduler.timer else None
        plans.append((out, budget, [(s.request_id.split("#")[0], s.start, s.num_new_tokens) for s in out.scheduled]))
        return out

    engine.scheduler.schedule = recording
    try:
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o.outputs[0].token_ids
    finally:
        engine.scheduler.schedule = original
    return plans, outs["stream"], outs["long"]


def test_latency_target_bounds_every_step_and_keeps_outputs(tiny_ckpt):
    ckpt = tiny_ckpt("llama")
    ref = LLMEngine(EngineConfig(model=ckpt, max_model_len=512))
    _, ref_stream, ref_long = _run_long_prompt_beside_a_stream(ref)

    eng = LLMEngine(EngineConfig(model=ckpt, max_model_len=512, target_step_seconds=0.01))
    _freeze(eng, gflops_per_s=0.2)  # 2 MFLOP per step: a few dozen tokens of this tiny model
    plans, stream, long = _run_long_prompt_beside_a_stream(eng)
    floor = eng.scheduler.config.min_prefill_chunk
    long_chunks = []
    for out, budget, items in plans:
        prefills = [(start, n) for rid, start, n in items if rid == "long" and n > 1]
        long_chunks += prefills
        decoding = any(rid == "stream" for rid, _, _ in items)
        if decoding and prefills:
            over_budget = out.estimated_flops > budget
            # Invariant: a step that carries decodes fits the budget, unless it is the one floor chunk.
            assert not over_budget or prefills == [(prefills[0][0], min(floor, prefills[0][1]))], (items, budget)
    assert len(long_chunks) > 5, "the long prompt was not split into chunks"
    sizes = [n for _, n in long_chunks[:-1]]
    assert sizes[0] > sizes[-1], f"chunks should shrink as the context grows: {sizes}"
    # Chunking is invisible in the outputs: the same greedy tokens as one big prefill.
    assert stream == ref_stream and long == ref_long


def test_banked_time_buys_longer_prefill_steps_within_the_max_and_keeps_outputs(tiny_ckpt):
    ckpt = tiny_ckpt("llama")
    ref = LLMEngine(EngineConfig(model=ckpt, max_model_len=512))
    _, ref_stream, ref_long = _run_long_prompt_beside_a_stream(ref)

    target, longest, gflops = 0.05, 0.15, 0.04  # 2 MFLOP a step on average, 6 at most
    eng = LLMEngine(EngineConfig(model=ckpt, max_model_len=512, target_step_seconds=target,
                                 max_step_seconds=longest))
    _freeze(eng, gflops_per_s=gflops)
    # A machine whose steps take what the frozen timer estimates (this tiny model's real steps
    # take milliseconds, so wall time would never draw the bank down).
    sched, observe = eng.scheduler, eng.scheduler.observe_step
    sched.observe_step = lambda out, seconds: observe(out, sched.timer.seconds(out.estimated_flops,
                                                                               out.estimated_reads))
    plans, stream, long = _run_long_prompt_beside_a_stream(eng)
    floor = eng.scheduler.config.min_prefill_chunk
    banking = above_target = 0
    prompt_done = False
    for out, _, items in plans:
        prefills = [(start, n) for rid, start, n in items if rid == "long" and n > 1]
        if prompt_done or not any(rid == "stream" for rid, _, _ in items):
            continue
        if not prefills:  # the prompt waits while the stream decodes: a banking step
            banking += 1
            continue
        prompt_done = prefills[-1][0] + prefills[-1][1] == len(LONG)
        # Invariant: no step planned past the longest step, unless it is the one floor chunk.
        over = out.estimated_flops > longest * gflops * 1e9 * (1 + 1e-9)
        assert not over or prefills == [(prefills[0][0], min(floor, prefills[0][1]))], (items, out.estimated_flops)
        above_target += out.estimated_flops > target * gflops * 1e9
    assert banking and above_target, f"no decode-only steps ({banking}) or no longer steps ({above_target})"
    assert stream == ref_stream and long == ref_long


def test_without_watchers_the_token_budget_alone_sizes_prefill(tiny_ckpt):
    eng = LLMEngine(EngineConfig(model=tiny_ckpt("llama"), max_model_len=512, max_num_batched_tokens=256,
                                 target_step_seconds=0.001))
    _freeze(eng, gflops_per_s=0.01)  # a budget far below one chunk: it must not apply
    eng.add_request("long", list(LONG), _greedy(1), interactive=False)  # nobody streams it
    out = eng.scheduler.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [256]
    eng.scheduler.update_after_step(out)  # keep the engine consistent, then finish cleanly
    eng.abort_request("long")


def test_round_robin_admission_across_client_requests(tiny_ckpt):
    # Budget for 3 prompts of 8 tokens per step; client A fans out into 12 sequences first.
    eng = LLMEngine(EngineConfig(model=tiny_ckpt("llama"), max_model_len=128, max_num_batched_tokens=24))
    for i in range(4):
        eng.add_request(f"a{i}", [10 + i] * 8, SamplingParams(n=3, max_tokens=2), client_id="A")
    eng.add_request("b", [20] * 8, _greedy(2), client_id="B")
    eng.add_request("c", [30] * 8, _greedy(2))  # its own client (the request id)
    eng.step()
    admitted = {r.request_id.split("#")[0] for r in eng.scheduler.running}
    assert {"b", "c"} <= admitted, f"later clients waited behind A's fan-out: {admitted}"
    while eng.has_unfinished_requests():
        eng.step()


def test_bounded_queue_refuses_an_add_that_would_overfill_it(tiny_ckpt):
    eng = AsyncLLMEngine.from_config(EngineConfig(model=tiny_ckpt("llama"), max_model_len=128, max_num_seqs=1),
                                     max_queued_requests=4)

    async def run():
        # An empty queue always takes a request, even one larger than the limit.
        big = await eng.add_requests([GenerateRequest("big", {"prompt_token_ids": [5] * 8},
                                                      SamplingParams(n=6, max_tokens=50, ignore_eos=True))])
        with pytest.raises(EngineQueueFullError) as e:
            await eng.add_request("late", {"prompt_token_ids": [6] * 8}, _greedy(2))
        assert e.value.retry_after >= 1 and "limit is 4" in str(e.value)
        assert eng.num_rejected_queue_full == 1
        big.abort()
        await eng.wait_until_idle()
        ok = await eng.add_request("after", {"prompt_token_ids": [6] * 8}, _greedy(2))
        async for _ in ok:
            pass

    try:
        asyncio.run(run())
    finally:
        eng.shutdown()


def test_min_tokens_that_cannot_fit_the_context_is_refused(tiny_ckpt):
    eng = LLMEngine(EngineConfig(model=tiny_ckpt("llama"), max_model_len=64))
    with pytest.raises(ValueError, match="min_tokens=1000"):
        eng.add_request("x", [5] * 8, SamplingParams(min_tokens=1000, max_tokens=None))
    assert not eng.has_unfinished_requests()


def test_only_watched_decodes_hold_prefill_to_the_target(tiny_ckpt):
    # A non-streaming request decoding does not shrink someone's prefill: its client waits for
    # the whole response anyway; a streaming one does.
    for interactive, limited in ((False, False), (True, True)):
        eng = LLMEngine(EngineConfig(model=tiny_ckpt("llama"), max_model_len=512, max_num_batched_tokens=256,
                                     target_step_seconds=0.001))
        _freeze(eng, gflops_per_s=0.01)
        eng.add_request("decoding", [5, 6, 7], _greedy(30), interactive=interactive)
        eng.step()
        # The prompt is not streamed either: only the decoding request decides.
        eng.add_request("long", list(LONG), _greedy(1), interactive=False)
        out = eng.scheduler.schedule()
        long = [s.num_new_tokens for s in out.scheduled if s.request_id.startswith("long")]
        assert (long[0] < 255) == limited, (interactive, long)
        eng.scheduler.update_after_step(out)
        eng.abort_request("long")
        eng.abort_request("decoding")


def test_streamed_prompts_without_decodes_get_first_tokens_one_after_another(tiny_ckpt):
    # A burst of streamed prompts reaches an engine with nothing decoding. One step that
    # prefilled them all would give every prompt its first token at the end of all of them;
    # held to max_step_seconds, the steps finish one prompt after another, with the same tokens.
    ckpt = tiny_ckpt("llama")
    prompts = {f"p{i}": [(11 * i + 5 * j) % 200 + 10 for j in range(120)] for i in range(4)}

    def run(engine: LLMEngine) -> tuple[dict[str, int], dict[str, list[int]], list[float]]:
        for rid, toks in prompts.items():
            engine.add_request(rid, toks, _greedy(3))
        first_token_step, outs, step_flops, step = {}, {}, [], 0
        while engine.has_unfinished_requests():
            original = engine.scheduler.schedule
            out = original()
            step_flops.append(out.estimated_flops)
            engine.scheduler.schedule = lambda: out  # step() runs exactly this plan
            try:
                results = engine.step()
            finally:
                engine.scheduler.schedule = original
            for o in results:
                if o.outputs[0].token_ids:
                    first_token_step.setdefault(o.request_id, step)
                if o.finished:
                    outs[o.request_id] = o.outputs[0].token_ids
            step += 1
        return first_token_step, outs, step_flops

    ref_first, ref_outs, _ = run(LLMEngine(EngineConfig(model=ckpt, max_model_len=512)))
    assert set(ref_first.values()) == {0}, "without a target all four prompts share one step"

    target, longest, gflops = 0.05, 0.1, 0.04  # 4 MFLOP a step at most: a fraction of one prompt
    eng = LLMEngine(EngineConfig(model=ckpt, max_model_len=512, target_step_seconds=target,
                                 max_step_seconds=longest))
    _freeze(eng, gflops_per_s=gflops)
    first, outs, step_flops = run(eng)
    assert outs == ref_outs, "chunking the burst changed the tokens"
    # Invariant: until the first prompt's first token nothing decodes, and no step is planned past
    # the longest step (the steps after it carry decodes: the target's tests above cover those).
    assert max(step_flops[:first["p0"] + 1]) <= longest * gflops * 1e9 * (1 + 1e-9), step_flops
    order = [first[rid] for rid in prompts]
    assert order == sorted(order) and order[0] < order[-1], f"first tokens did not come one after another: {first}"

"""Decode bursts (num_scheduler_steps, engine/decode_burst.py): several greedy decode steps in one
model call give every request exactly the tokens, texts, stops and cached pages of one step at a
time; a schedule a burst cannot run exactly as single steps would runs one step."""
import pytest
import torch

from hybridkv.engine.async_llm_engine import AsyncLLMEngine
from hybridkv.engine.config import DEFAULT_SCHEDULER_STEPS, EngineConfig
from hybridkv.engine.decode_burst import burst_limit, burst_steps
from hybridkv.entrypoints import LLM, SamplingParams
from hybridkv.model_executor.fused_decode import FusedDecode

from fused_decode_cases import FUSED_DECODE_CASES

CASES = FUSED_DECODE_CASES


def _engines(path: str, dtype: str, steps: int) -> tuple[LLM, LLM]:
    """One step a call, and `steps`; skips where this CPU has no fused decode for `dtype`."""
    single = LLM(path, dtype=dtype, max_model_len=256, num_scheduler_steps=1)
    burst = LLM(path, dtype=dtype, max_model_len=256, num_scheduler_steps=steps)
    fused = burst.engine.runner.model._fused_decode
    if fused is None or fused.head is None:
        pytest.skip(f"no fused decode with its head for {dtype} on this CPU (its linears are not the blocked kernels)")
    return single, burst


def _run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]):
    """Each request's (tokens, text, finish reason, stop reason), from an empty prefix cache (on
    CPUs where some linear changes kernel with the row count, a prefix hit changes the kernels a
    prompt's rows meet: tests/engine/test_batch_invariance.py)."""
    llm.reset_prefix_cache()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for o in outs]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_burst_gives_every_request_the_tokens_of_single_steps(tiny_ckpt, case, dtype):
    """Requests of different lengths and budgets (so bursts are cut to what the shortest may still
    take, and pages and windows are crossed inside a burst), one of them stopped by a stop token
    in the middle of a burst: tokens, text, finish and stop reasons as single steps give them."""
    arch, overrides = CASES[case]
    single, burst = _engines(tiny_ckpt(arch, **overrides), dtype, steps=5)
    g = torch.Generator().manual_seed(5)
    vocab = single.engine.runner.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 30, 45)]
    plain = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (40, 23, 33)]
    ref = _run(single, prompts, plain)
    # A stop token the second request meets at its 12th token (a burst's 2nd or 3rd step).
    stop_at = ref[1][0][11]
    first = ref[1][0].index(stop_at)
    params = [plain[0], SamplingParams(temperature=0, max_tokens=23, ignore_eos=True, stop_token_ids=[stop_at]),
              plain[2]]
    ref = _run(single, prompts, params)
    assert ref[1][2] == "stop" and len(ref[1][0]) == first + 1
    calls = burst.engine.stats["burst_calls"]
    got = _run(burst, prompts, params)
    assert burst.engine.stats["burst_calls"] > calls, "no burst ran: the test would compare single steps to themselves"
    assert got == ref, "a burst changed a request's tokens, text or stop"


def test_pages_a_burst_published_serve_prefix_hits_exactly(tiny_ckpt):
    """The whole pages a burst computed are published as single steps publish them: a second turn
    (prompt + answer + more) hits them and continues with the tokens of an engine without bursts."""
    single, burst = _engines(tiny_ckpt("llama"), "float32", steps=8)
    g = torch.Generator().manual_seed(9)
    vocab = single.engine.runner.config.vocab_size
    prompt = torch.randint(3, vocab, (21,), generator=g).tolist()
    sp = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    first = _run(burst, [prompt], [sp])[0][0]
    assert first == _run(single, [prompt], [sp])[0][0]
    turn = prompt + first + torch.randint(3, vocab, (5,), generator=g).tolist()
    out = burst.generate([{"prompt_token_ids": turn}], sp, use_tqdm=False)[0]
    assert out.num_cached_tokens >= 64, f"the second turn hit {out.num_cached_tokens} tokens, not the burst's pages"
    assert out.outputs[0].token_ids == _run(single, [turn], [sp])[0][0]


def test_schedules_a_burst_does_not_take(tiny_ckpt, monkeypatch):
    """Sampling, logprobs, penalties and a request still short of min_tokens step one at a time,
    as does a burst the model refuses; a burst the sampler's plain argmax serves does not."""
    path = tiny_ckpt("llama")
    _, llm = _engines(path, "float32", steps=8)
    calls = []
    original = FusedDecode.burst
    monkeypatch.setattr(FusedDecode, "burst", lambda self, *a: calls.append(1) or original(self, *a))
    prompt = [[5, 6, 7, 8, 9]]
    for sp in (SamplingParams(temperature=0.8, seed=1, max_tokens=12),
               SamplingParams(temperature=0, max_tokens=12, logprobs=2),
               SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.2)):
        llm.generate([{"prompt_token_ids": p} for p in prompt], sp, use_tqdm=False)
        assert not calls, f"a burst ran for {sp}"
    llm.generate([{"prompt_token_ids": p} for p in prompt], SamplingParams(temperature=0, max_tokens=12),
                 use_tqdm=False)
    assert calls, "plain greedy decodes took no burst"
    # A step target (serve's default) turns bursts off unless asked for.
    served = LLM(path, dtype="float32", max_model_len=256, target_step_seconds=0.5)
    assert served.engine.burst_limit == 1
    # The async engine (the server) keeps one step a call unless the config asks for bursts.
    for steps, expected in ((None, 1), (4, 4)):
        engine = AsyncLLMEngine.from_config(EngineConfig(model=path, dtype="float32", max_model_len=256,
                                                         num_scheduler_steps=steps))
        try:
            assert engine.engine.burst_limit == expected
        finally:
            engine.shutdown()


def test_burst_length_follows_the_requests(tiny_ckpt):
    """burst_steps: cut to what every request may still generate; 1 with anyone waiting, anyone
    not scheduled, a prefill chunk, or a request whose min_tokens still masks its stop tokens."""
    llm = LLM(tiny_ckpt("llama"), dtype="float32", max_model_len=64)
    engine = llm.engine
    engine.add_request("a", [4, 5, 6], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    engine.add_request("b", [4, 5, 6, 7], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.step()  # both prompts
    reqs = list(engine.scheduler.running)
    try:
        assert [r.num_output_tokens for r in reqs] == [1, 1]
        assert burst_steps(8, reqs, [1, 1], 2, 0, 64) == 8
        assert burst_steps(20, reqs, [1, 1], 2, 0, 64) == 9, "a has 9 tokens left"
        assert burst_steps(8, reqs, [1, 1], 2, 0, 7) == 2, "max_model_len leaves b room for 2 more tokens"
        assert burst_steps(8, reqs, [1, 1], 2, 0, 6) == 1, "max_model_len leaves b room for 1 more token"
        assert burst_steps(8, reqs, [1, 1], 2, 1, 64) == 1, "a waiting request is admitted at the next step"
        assert burst_steps(8, reqs[:1], [1], 2, 0, 64) == 1, "every running request must be in the burst"
        assert burst_steps(8, reqs, [1, 2], 2, 0, 64) == 1, "a prefill chunk is not a decode"
        reqs[0].params = SamplingParams(temperature=0, max_tokens=10, min_tokens=4, stop_token_ids=[7])
        assert burst_steps(8, reqs, [1, 1], 2, 0, 64) == 1, "min_tokens still masks a's stop tokens"
    finally:
        engine.abort_request("a")
        engine.abort_request("b")


def test_one_rule_resolves_the_default_number_of_steps():
    """burst_limit, which both LLMEngine and AsyncLLMEngine ask: a set value stands everywhere;
    None is DEFAULT_SCHEDULER_STEPS offline, 1 under a step target ("auto" included) or streaming."""
    assert burst_limit(None, None, streaming=False) == DEFAULT_SCHEDULER_STEPS > 1
    assert burst_limit(None, 0.25, streaming=False) == 1
    assert burst_limit(None, "auto", streaming=False) == 1
    assert burst_limit(None, None, streaming=True) == 1
    for streaming in (False, True):
        assert burst_limit(3, "auto", streaming=streaming) == 3
        assert burst_limit(1, None, streaming=streaming) == 1


def test_num_scheduler_steps_is_checked():
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        EngineConfig(num_scheduler_steps=0)
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        EngineConfig(num_scheduler_steps=2.5)


def test_the_burst_kernel_refuses_slot_mappings_of_the_wrong_shape(tiny_ckpt):
    """A malformed call fails with an error naming the argument before any step writes, and the
    engine serves the next request."""
    _, llm = _engines(tiny_ckpt("llama"), "float32", steps=4)
    fused = llm.engine.runner.model._fused_decode
    original = fused.burst_op

    def bad_op(steps, ids, *rest):
        rest = list(rest)
        rest[6] = [s[:, :0] for s in rest[6]]  # slot mappings [steps, 0]: no row per sequence
        return original(steps, ids, *rest)

    fused.burst_op = bad_op
    sp = SamplingParams(temperature=0, max_tokens=9)
    try:
        with pytest.raises(RuntimeError, match=r"slot mappings must be \[steps, T\]"):
            llm.generate([{"prompt_token_ids": [3, 4, 5]}], sp, use_tqdm=False)
    finally:
        fused.burst_op = original
        for rid in list(llm.engine._groups):
            llm.engine.abort_request(rid)
    out = llm.generate([{"prompt_token_ids": [3, 4, 5]}], sp, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 9

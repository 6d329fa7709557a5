"""Structured outputs on a tiny random checkpoint: the grammar alone forces valid output, and it
composes with prefix caching, chunked prefill, preemption (the matcher follows the output tokens
exactly: the same greedy tokens as a plain run), decode bursts (never run for a constrained
request) and a grammar that is still compiling (the others keep running)."""
from __future__ import annotations

import json
import re
from concurrent.futures import Future

import pytest

from hybridkv.entrypoints import LLM, SamplingParams, StructuredOutputsParams
from hybridkv.engine.structured_output import RequestGrammar

# Small enough that a random model's whitespace (at most 13 characters a gap) fits max_tokens.
SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "n": {"type": "integer", "minimum": 1,
          "maximum": 9}}, "required": ["kind", "n"], "additionalProperties": False}
REGEX = r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)"
CHOICES = ["alpha", "beta", "gamma"]
PAGE_BYTES = 2 * 2 * 2 * 16 * 4 * 16  # one page of the tiny llama (see tests/engine/test_llm_engine.py)


def _params(max_tokens: int = 80) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
        SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(regex=REGEX)),
        SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(choice=CHOICES)),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    ]


def _prompts(n: int) -> list[dict]:
    shared = list(range(5, 45))  # a 40-token shared prefix: prefix caching has something to hit
    return [{"prompt_token_ids": shared + [50 + 3 * i, 60 + i]} for i in range(n)]


def _check_valid(outs) -> None:
    kinds = ["json", "regex", "choice", None] * (len(outs) // 4)
    for out, kind in zip(outs, kinds):
        o = out.outputs[0]
        if kind is None:
            continue
        assert o.finish_reason == "stop", (kind, o.text)
        if kind == "json":
            value = json.loads(o.text)
            assert set(value) == {"kind", "n"} and value["kind"] in ("cat", "dog") and 1 <= value["n"] <= 9
        elif kind == "regex":
            assert re.fullmatch(REGEX, o.text), o.text
        else:
            assert o.text in CHOICES


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    """Plain run: no caching, one request at a time."""
    path = tiny_ckpt("llama")
    llm = LLM(path, dtype="float32", enable_prefix_caching=False, max_num_seqs=1)
    outs = llm.generate(_prompts(8), _params() * 2, use_tqdm=False)
    _check_valid(outs)
    return path, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("config", [
    dict(enable_prefix_caching=True, max_num_batched_tokens=7),  # chunked prefill, prefix hits on pass 2
    dict(enable_prefix_caching=True, max_model_len=128, kv_cache_memory_bytes=12 * PAGE_BYTES),  # preemption
    dict(enable_prefix_caching=False, max_model_len=128, kv_cache_memory_bytes=12 * PAGE_BYTES,
         preemption_mode="recompute"),
])
def test_grammar_outputs_equal_plain_run_under_caching_chunking_and_preemption(reference, config):
    path, ref = reference
    llm = LLM(path, dtype="float32", **config)
    for _ in range(2):  # the second pass hits what the first cached
        outs = llm.generate(_prompts(8), _params() * 2, use_tqdm=False)
        _check_valid(outs)
        assert [o.outputs[0].token_ids for o in outs] == ref
    if "kv_cache_memory_bytes" in config:
        assert llm.engine.scheduler.num_preemptions > 0
    if config.get("enable_prefix_caching"):
        assert sum(o.num_cached_tokens for o in outs) > 0
    llm.engine.kv.assert_idle()


def test_no_decode_burst_runs_while_a_constrained_request_is_scheduled(tiny_ckpt):
    llm = LLM(tiny_ckpt("llama"), dtype="float32", num_scheduler_steps=8)
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm.generate(_prompts(2), plain, use_tqdm=False)
    assert llm.engine.stats["burst_calls"] > 0, "bursts run for plain greedy requests"
    before = llm.engine.stats["burst_calls"]
    outs = llm.generate(_prompts(4), _params(), use_tqdm=False)
    _check_valid(outs)
    # Bursts may run only once every constrained request has finished (the plain one goes on alone).
    assert llm.engine.stats["burst_calls"] - before <= 1


def test_a_request_waiting_for_its_grammar_does_not_stall_the_others(tiny_ckpt):
    llm = LLM(tiny_ckpt("llama"), dtype="float32")
    engine = llm.engine
    compiler = engine.structured.compiler
    real = compiler.compile(StructuredOutputsParams(choice=CHOICES)).result()
    pending: Future = Future()
    compile_ = compiler.compile
    compiler.compile = lambda spec, count_hit=True: pending  # the constraint "compiles" until we say so
    try:
        engine.add_request("slow", _prompts(1)[0], _params()[2])
    finally:
        compiler.compile = compile_
    engine.add_request("plain", _prompts(2)[1], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    finished = {}
    for _ in range(50):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if "plain" in finished:
            break
    assert "plain" in finished and "slow" not in finished
    assert engine.scheduler.num_waiting == 1, "the constrained request waits in the queue, not prefilled"
    pending.set_result(real)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["slow"].outputs[0].text in CHOICES


def test_grammar_compiled_once_per_distinct_spec_and_bad_specs_refused(tiny_ckpt):
    llm = LLM(tiny_ckpt("llama"), dtype="float32")
    stats0 = llm.engine.structured.stats()
    llm.generate(_prompts(4), [_params()[1]] * 4, use_tqdm=False)
    llm.generate(_prompts(4), [_params()[1]] * 4, use_tqdm=False)
    stats = llm.engine.structured.stats()
    assert stats.compiles - stats0.compiles <= 1 and stats.cache_hits - stats0.cache_hits >= 7
    assert stats.requests - stats0.requests == 8
    for bad in (StructuredOutputsParams(regex="a(b"), StructuredOutputsParams(json={"type": "objectx"}),
                StructuredOutputsParams(grammar="start: undefined_rule")):
        with pytest.raises(ValueError, match="structured_outputs"):
            llm.generate(_prompts(1), SamplingParams(structured_outputs=bad), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])


def test_matcher_sync_rolls_back_and_readvances_to_the_output_tokens(tiny_ckpt):
    llm = LLM(tiny_ckpt("llama"), dtype="float32")
    tok = llm.get_tokenizer()
    fut = llm.engine.structured.compiler.compile(StructuredOutputsParams(regex=REGEX))
    grammar = RequestGrammar(fut)
    fut.result()
    text_ids = tok.encode("ab@cd.com", add_special_tokens=False)
    grammar.sync(text_ids)
    assert grammar.terminated and grammar.num_consumed == len(text_ids)
    grammar.sync(text_ids[:2])  # e.g. tokens gone: rolled back
    assert not grammar.terminated and grammar.num_consumed == 2
    grammar.sync(text_ids)
    assert grammar.terminated and not grammar.failed


@pytest.mark.slow
def test_two_ranks_give_one_process_constrained_tokens_and_workers_never_get_the_mask(tiny_ckpt):
    """Under tensor parallelism only rank 0 samples: the mask goes to its sampler alone."""
    import pickle

    path = tiny_ckpt("llama", num_key_value_heads=4)
    common = dict(dtype="float32", max_model_len=128, max_num_seqs=8)
    want = [o.outputs[0].token_ids for o in LLM(path, **common).generate(_prompts(4), _params(), use_tqdm=False)]
    two = LLM(path, tensor_parallel_size=2, **common)
    try:
        sent: list[bytes] = []
        broadcast = two.engine.runner.workers.broadcast
        two.engine.runner.workers.broadcast = lambda msg, *a, **k: (sent.append(pickle.dumps(msg)),
                                                                    broadcast(msg, *a, **k))[1]
        outs = two.generate(_prompts(4), _params(), use_tqdm=False)
    finally:
        two.shutdown()
    _check_valid(outs)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sent and not any(b"TokenBitmask" in m for m in sent)


def test_eos_is_allowed_only_where_the_grammar_accepts(tiny_ckpt):
    llm = LLM(tiny_ckpt("llama"), dtype="float32")
    structured, tok = llm.engine.structured, llm.get_tokenizer()
    (eos,) = llm.engine.eos_token_ids
    fut = structured.compiler.compile(StructuredOutputsParams(regex="a+b?"))
    fut.result()
    grammar = RequestGrammar(fut)

    def eos_allowed(outputs: list[int]) -> bool:
        bits = structured.builder.build([("s", grammar, outputs)]).bits[0]
        return bool((int(bits[eos // 32]) >> (eos % 32)) & 1)

    a = tok.encode("a", add_special_tokens=False)
    assert not eos_allowed([]), "nothing generated yet: not an accept state"
    assert eos_allowed(a), "'a' matches a+b?: EOS may end it"
    assert not grammar.terminated
    grammar.sync(a + tok.encode("b", add_special_tokens=False))
    assert grammar.terminated, "'ab' can only end"


def test_a_grammar_with_a_start_marker_leaves_what_comes_before_free(tiny_ckpt):
    """start_after (a reasoning model's "</think>"): the output up to the marker is what the model
    writes unconstrained, token for token; what follows matches the grammar."""
    llm = LLM(tiny_ckpt("llama"), dtype="float32", max_model_len=256)
    tok = llm.get_tokenizer()
    prompt = _prompts(1)[0]
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    # The marker: the free run's tokens 3..5, as text that encodes back to those very tokens.
    cut = next(i for i in range(3, 9) if tok.encode(tok.decode(free[i:i + 3]), add_special_tokens=False) == free[i:i + 3])
    marker = tok.decode(free[cut:cut + 3])
    spec = StructuredOutputsParams(regex=REGEX, start_after=marker)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=60, structured_outputs=spec),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:cut + 3] == free[:cut + 3], "the grammar constrained tokens before its start marker"
    answer = tok.decode(out.token_ids[cut + 3:])
    assert re.fullmatch(REGEX, answer) and out.finish_reason == "stop", answer


def test_the_start_marker_is_found_incrementally_and_after_a_rollback():
    done: Future = Future()
    grammar = RequestGrammar(done, start_after=[7, 8])
    assert grammar.start_of([1, 2, 7]) is None and not grammar.active([1, 2, 7])
    assert grammar.start_of([1, 2, 7, 8]) == 4  # the marker spans the previous call's end
    assert grammar.start_of([1, 2, 7, 8, 9, 9]) == 4
    assert grammar.start_of([1, 2, 7]) is None  # rolled back before the marker's end
    assert grammar.start_of([1, 2, 3, 7, 8]) == 5
    assert RequestGrammar(done).start_of([5, 6]) == 0  # no marker: constrained from the first token

"""Internal sequence ids never collide with user request ids: the engine keys each sequence by
a private, counter-based id, while outputs and abort_request use the user's request_id."""
from __future__ import annotations

import pytest

from hybridkv.engine.sampling_params import SamplingParams
from hybridkv.entrypoints import LLM

PROMPT = {"prompt_token_ids": [3, 17, 42, 99, 7, 12]}


def _drain(engine) -> dict[str, list[list[int]]]:
    """request_id -> token ids of each of its n samples (by index), once finished."""
    done: dict[str, list[list[int]]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done, f"{out.request_id} finished twice"
                done[out.request_id] = [o.token_ids for o in sorted(out.outputs, key=lambda o: o.index)]
    return done


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt("llama"), dtype="float32", max_model_len=128, max_num_seqs=8)


def test_user_id_shaped_like_a_child_id_beside_a_group(llm):
    """Request "0_a" (n=1) beside request "a" (n=2): the old child ids f"{i}_{id}" made "0_a" twice."""
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    seeded = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True)
    engine.add_request("0_a", PROMPT, greedy)
    engine.add_request("a", PROMPT, seeded)
    internal = engine.sequence_ids("0_a") + engine.sequence_ids("a")
    assert len(set(internal)) == 3
    assert not {"0_a", "a", "1_a"} & set(internal)
    done = _drain(engine)
    assert set(done) == {"0_a", "a"}
    assert len(done["0_a"]) == 1 and len(done["0_a"][0]) == 5
    assert len(done["a"]) == 2 and all(len(t) == 5 for t in done["a"])
    # Each request got what it gets alone: the ids mixed no state between them.
    engine.add_request("alone", PROMPT, greedy)
    assert _drain(engine)["alone"] == done["0_a"]
    engine.add_request("alone_n2", PROMPT, seeded)
    assert _drain(engine)["alone_n2"] == done["a"]


def test_abort_uses_the_user_id_and_leaves_the_look_alike_running(llm):
    engine = llm.engine
    params = SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("a", PROMPT, params)
    engine.add_request("0_a", PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()
    engine.abort_request("0_a")
    assert engine.sequence_ids("0_a") == []
    assert len(engine.sequence_ids("a")) == 2
    done = _drain(engine)
    assert set(done) == {"a"} and all(len(t) == 8 for t in done["a"])


def test_auto_ids_skip_a_number_a_caller_took(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    taken = str(next(engine._counter) + 1)  # the id the engine would hand out next
    engine.add_request(taken, PROMPT, params)
    auto = engine.add_request(None, PROMPT, params)
    assert auto != taken
    assert set(_drain(engine)) == {taken, auto}
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", PROMPT, params)
        engine.add_request("dup", PROMPT, params)
    engine.abort_request("dup")


def test_sequence_ids_stay_unique_across_reuse_of_a_user_id(llm):
    """A finished request's id may be reused; its sequences get fresh internal ids."""
    engine = llm.engine
    params = SamplingParams(n=2, temperature=0, max_tokens=2, ignore_eos=True)
    seen: set[str] = set()
    for _ in range(3):
        engine.add_request("again", PROMPT, params)
        ids = engine.sequence_ids("again")
        assert not seen & set(ids)
        seen |= set(ids)
        _drain(engine)

"""Structured outputs on the demo model (SmolLM2-135M-Instruct, real weights), offline: constrained
requests batched with unconstrained ones all validate, and the unconstrained ones keep exactly
the tokens they get without constrained neighbours."""
from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest

from hybridkv import LLM, SamplingParams, StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colors": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]},
                   "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "colors", "address"],
    "additionalProperties": False,
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
ANSWERS = ["yes", "no", "maybe"]


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=1024)


def _chat(llm, question: str) -> str:
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                   add_generation_prompt=True)


def _requests(llm, **sampling):
    prompts = [_chat(llm, "Describe a person living in Paris as JSON."), _chat(llm, "Write a phone number."),
               _chat(llm, "Is the sky blue?"), _chat(llm, "Name three fruits."), _chat(llm, "Say hello in French.")]
    params = [
        SamplingParams(max_tokens=150, structured_outputs=StructuredOutputsParams(json=PERSON), **sampling),
        SamplingParams(max_tokens=30, structured_outputs=StructuredOutputsParams(regex=PHONE), **sampling),
        SamplingParams(max_tokens=10, structured_outputs=StructuredOutputsParams(choice=ANSWERS), **sampling),
        SamplingParams(max_tokens=24, **sampling),
        SamplingParams(max_tokens=24, **sampling),
    ]
    return prompts, params


def _check(outs) -> None:
    person, phone, answer = (o.outputs for o in outs[:3])
    for o in person:
        jsonschema.validate(json.loads(o.text), PERSON)
    assert all(re.fullmatch(PHONE, o.text) for o in phone), [o.text for o in phone]
    assert all(o.text in ANSWERS for o in answer)
    assert all(o.finish_reason == "stop" for out in outs[:3] for o in out.outputs)


@pytest.mark.slow
def test_constrained_outputs_validate_and_unconstrained_neighbours_keep_their_greedy_tokens(llm):
    prompts, params = _requests(llm, temperature=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    _check(outs)
    alone = llm.generate(prompts[3:], params[3:], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[3:]] == [o.outputs[0].token_ids for o in alone]


@pytest.mark.slow
def test_seeded_temperature_one_with_n_and_logprobs_validates(llm):
    prompts, params = _requests(llm, temperature=1.0, seed=7, n=2, logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    _check(outs)
    again = llm.generate(prompts, params, use_tqdm=False)  # seeded: the same samples whatever the batch
    assert [[o.token_ids for o in out.outputs] for out in outs] == [[o.token_ids for o in out.outputs] for out in again]
    # Logprobs describe the masked distribution: at the choice's first token only allowed tokens
    # have a finite logprob, and the sampled one is among them.
    for o in outs[2].outputs:
        first = o.logprobs[0]
        assert math.isfinite(first[o.token_ids[0]].logprob)
        allowed = [t for t, lp in first.items() if math.isfinite(lp.logprob)]
        assert all(any(a.startswith(llm.get_tokenizer().decode([t]).strip()) for a in ANSWERS) for t in allowed)


@pytest.mark.slow
def test_max_tokens_cut_finishes_with_length(llm):
    out = llm.generate([_chat(llm, "Describe a person as JSON.")],
                       SamplingParams(temperature=0, max_tokens=5, structured_outputs=StructuredOutputsParams(json=PERSON)),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5 and out.text.startswith("{")


@pytest.mark.slow
def test_a_schema_the_library_cannot_compile_raises_value_error(llm):
    bad = {"type": "object", "properties": {"a": {"type": "strin"}}}
    with pytest.raises(ValueError, match="structured_outputs.json"):
        llm.generate(["hi"], SamplingParams(structured_outputs=StructuredOutputsParams(json=bad)), use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        llm.generate(["hi"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed")),
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_llm_chat_with_a_schema_beside_an_unconstrained_conversation(llm):
    """LLM.chat batches a constrained conversation with a free one; the free one keeps its tokens."""
    conversations = [[{"role": "user", "content": "Describe a person living in Paris as JSON."}],
                     [{"role": "user", "content": "Say hello in French."}]]
    free = SamplingParams(max_tokens=24, temperature=0)
    alone = llm.chat(conversations[1:], free, use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.chat(conversations, [SamplingParams(max_tokens=150, temperature=0,
                                                   structured_outputs=StructuredOutputsParams(json=PERSON)), free],
                    use_tqdm=False)
    jsonschema.validate(json.loads(outs[0].outputs[0].text), PERSON)
    assert outs[1].outputs[0].token_ids == alone, "a constrained neighbour changed an unconstrained conversation"

"""Tool calling through the official openai client against `hybridkv serve` on the demo model:
tool_choice "required" and a named function give calls whose arguments validate against the
tool's parameters (constrained decoding), at temperature 0 and 1.0 with a seed; a named call
streamed joins to the whole one; a tool result sent back is answered; "auto" without
--enable-auto-tool-choice is a 400 saying what to set, and with it a plain answer stays content."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from demo_server import demo_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "days", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$"}},
                   "required": ["timezone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next three days, and the time in Tokyo?"}]


@pytest.fixture(scope="module")
def client():
    with demo_server("--enable-auto-tool-choice", "--tool-call-parser", "hermes") as url:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
        yield c
        c.close()


def _valid_calls(message) -> list[tuple[str, dict]]:
    assert message.content is None, "the answer to an enforced tool choice is the calls only"
    calls = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        calls.append((call.function.name, args))
    return calls


@pytest.mark.parametrize("temperature,seed", [(0, None), (1.0, 7)])
def test_required_and_named_choices_give_valid_calls(client, temperature, seed):
    r = client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=120, temperature=temperature, seed=seed)
    assert r.choices[0].finish_reason == "tool_calls"
    assert len(_valid_calls(r.choices[0].message)) >= 1
    r = client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, max_tokens=80,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       temperature=temperature, seed=seed)
    assert [name for name, _ in _valid_calls(r.choices[0].message)] == ["get_time"]
    r = client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=120, temperature=temperature, seed=seed)
    assert len(_valid_calls(r.choices[0].message)) == 1


def test_a_named_call_streamed_joins_to_the_whole_one(client):
    kw = dict(model="demo", messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kw).choices[0]
    name, arguments, finish = None, "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                name = call.function.name or name
                arguments += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert (name, json.loads(arguments)) == (whole.message.tool_calls[0].function.name,
                                             json.loads(whole.message.tool_calls[0].function.arguments))
    assert finish == whole.finish_reason == "tool_calls"


def test_a_tool_result_round_trip_is_answered(client):
    r = client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = r.choices[0].message.tool_calls[0]
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": ["sun", "rain", "sun"]})},
    ]
    answer = client.chat.completions.create(model="demo", messages=messages, tools=TOOLS, tool_choice="none",
                                            max_tokens=24, temperature=0)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_auto_parses_the_models_own_format_or_leaves_content(client):
    r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Say hello."}],
                                       tools=TOOLS, max_tokens=16, temperature=0)  # "auto" by default
    message = r.choices[0].message
    assert message.content or message.tool_calls
    if message.tool_calls:  # the hermes parser found a call: it must be one of the tools
        assert {c.function.name for c in message.tool_calls} <= set(SCHEMAS)


def test_bad_tool_requests_are_400s(client):
    with pytest.raises(openai.BadRequestError, match="not among 'tools'"):
        client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, max_tokens=8,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=8,
                                       response_format={"type": "json_object"})
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["x"]}}}
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="demo", messages=ASK, tools=[bad], tool_choice="required", max_tokens=8)


def test_auto_without_the_server_flag_is_a_400_saying_what_to_set():
    with demo_server() as url:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
        with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
            c.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, max_tokens=8)
        r = c.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8)
        assert r.choices[0].message.content is not None
        c.close()

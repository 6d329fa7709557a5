"""A chat answer's fields (chat_output.py) on scripted outputs: the reasoning split, then the tool
calls (auto-parsed or enforced), give the same message whole and streamed one character at a
time; an enforced call cut at max_tokens leaves its text as content and finishes "length"."""
from __future__ import annotations

import json

import pytest

from hybridkv.entrypoints.openai.chat_output import ChatOutput
from hybridkv.entrypoints.openai.tool_calling import read_tools
from hybridkv.entrypoints.openai.tool_parsers import make_parser

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _streamed(output: ChatOutput, text: str) -> dict:
    """Join a character-by-character stream's deltas into a message's fields."""
    reasoning, content, calls = "", "", {}
    deltas = [output.feed(ch) for ch in text] + [output.finish()]
    for d in deltas:
        reasoning += d.get("reasoning_content", "")
        content += d.get("content") or ""
        for c in d.get("tool_calls", []):
            call = calls.setdefault(c["index"], {"id": None, "name": None, "arguments": ""})
            call["id"] = c.get("id", call["id"])
            call["name"] = c.get("function", {}).get("name") or call["name"]
            call["arguments"] += c.get("function", {}).get("arguments", "")
    return {"reasoning": reasoning or None, "content": content or None,
            "calls": [(c["name"], json.loads(c["arguments"])) for c in calls.values()]}


def _whole(output: ChatOutput, text: str) -> dict:
    m = output.message(text)
    return {"reasoning": m.get("reasoning_content"), "content": m["content"] or None,
            "calls": [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m.get("tool_calls", [])]}


CASES = [
    # (in_reasoning, tools, tool_choice, parser, output, expected)
    (True, [WEATHER], "auto", "hermes",
     'the user wants weather</think>Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
     {"reasoning": "the user wants weather", "content": "Checking.", "calls": [("get_weather", {"city": "Oslo"})]}),
    (None, [WEATHER, TIME], "required", None,
     '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Rome"}}]',
     {"reasoning": None, "content": None, "calls": [("get_time", {}), ("get_weather", {"city": "Rome"})]}),
    (None, [WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None, '{"city": "Lima"}',
     {"reasoning": None, "content": None, "calls": [("get_weather", {"city": "Lima"})]}),
    (None, [WEATHER], "auto", "hermes", "No tool needed: it is sunny.",
     {"reasoning": None, "content": "No tool needed: it is sunny.", "calls": []}),
    (None, [WEATHER], "none", None, "plain answer", {"reasoning": None, "content": "plain answer", "calls": []}),
]


@pytest.mark.parametrize("in_reasoning,tools,choice,parser,output,expected", CASES,
                         ids=["reasoning+auto", "required-parallel", "named", "auto-no-call", "none"])
def test_whole_and_streamed_give_the_same_fields(in_reasoning, tools, choice, parser, output, expected):
    request = read_tools(tools, choice, None)
    make = lambda: ChatOutput(in_reasoning, request, make_parser(parser) if parser else None)  # noqa: E731
    whole = make()
    assert _whole(whole, output) == expected
    assert whole.finish_reason("stop") == ("tool_calls" if expected["calls"] else "stop")
    assert _streamed(make(), output) == expected


def test_an_enforced_call_cut_at_max_tokens_is_content_and_length():
    output = ChatOutput(None, read_tools([WEATHER], "required", None), None)
    m = output.message('[{"name": "get_weather", "parameters": {"ci')
    assert m["content"] == '[{"name": "get_weather", "parameters": {"ci' and "tool_calls" not in m
    assert output.finish_reason("length") == "length"


def test_the_required_schema_names_every_tool_and_limits_parallel_calls():
    schema = read_tools([WEATHER, TIME], "required", False).schema()
    names = [alt["properties"]["name"]["const"] for alt in schema["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"] and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert read_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None).schema() == \
        WEATHER["function"]["parameters"]


@pytest.mark.parametrize("tools,choice,match", [
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not among 'tools'"),
    ([], "required", "needs 'tools'"),
    ([{"type": "function", "function": {}}], "auto", "function.name"),
    ([WEATHER], "sometimes", "expected none, auto, required"),
])
def test_bad_tool_fields_are_400s_naming_the_field(tools, choice, match):
    from hybridkv.entrypoints.openai.errors import OpenAIError

    with pytest.raises(OpenAIError, match=match):
        read_tools(tools, choice, None)

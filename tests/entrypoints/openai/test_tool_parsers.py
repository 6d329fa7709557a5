"""Tool-call parsers on scripted outputs of each family's format: the calls (names and arguments
as JSON objects) and the content before them come out the same whole or streamed one character at
a time; an output whose call does not parse is left whole as content."""
from __future__ import annotations

import json

import pytest

from hybridkv.entrypoints.openai.tool_parsers import ToolCallStream, check_parser_name, make_parser

WEATHER = {"city": "Paris", "days": 3}
CASES = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
               "Let me check.", [("get_weather", WEATHER), ("get_time", {})]),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                    '{"name": "get_time", "parameters": {}}',
                    None, [("get_weather", WEATHER), ("get_time", {})]),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
                None, [("get_weather", WEATHER)]),
    "deepseek_v4": ('I will look it up.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
                    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
                    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
                    '</｜DSML｜invoke>\n</｜DSML｜function_calls>',
                    "I will look it up.", [("get_weather", WEATHER)]),
}


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("name", list(CASES))
def test_whole_output(name):
    output, content, calls = CASES[name]
    got_content, got_calls = make_parser(name).extract(output)
    assert got_content == content
    assert _calls(got_calls) == calls
    assert len({c.id for c in got_calls}) == len(got_calls), "every call gets its own id"


@pytest.mark.parametrize("name", list(CASES))
def test_streamed_one_character_at_a_time(name):
    output, content, calls = CASES[name]
    stream = ToolCallStream(make_parser(name))
    deltas = [stream.feed(ch) for ch in output] + [stream.finish()]
    streamed_content = "".join(d.content for d in deltas).strip()
    assert (streamed_content or None) == content
    assert _calls([c for d in deltas for c in d.calls]) == calls
    for marker in ("<tool_call", "[TOOL_CALLS", "<｜DSML", "<|python_tag"):
        assert marker not in streamed_content, "part of a call leaked into the content"


@pytest.mark.parametrize("name,output", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>'),
    ("mistral", "[TOOL_CALLS] not json"),
    ("llama3_json", '{"no_name": 1}'),
])
def test_a_call_that_does_not_parse_is_content(name, output):
    assert make_parser(name).extract(output) == (output, [])
    stream = ToolCallStream(make_parser(name))
    deltas = [stream.feed(ch) for ch in output] + [stream.finish()]
    assert "".join(d.content for d in deltas) == output and not any(d.calls for d in deltas)


def test_plain_answers_are_content_and_stream_without_holding_everything():
    parser = make_parser("hermes")
    assert parser.extract("The weather is fine.") == ("The weather is fine.", [])
    stream = ToolCallStream(parser)
    first = stream.feed("The weather ")
    assert first.content == "The weather ", "content must stream as it comes"
    assert stream.feed("is <").content == "is ", "a possible marker's start is held back"
    assert stream.feed("b>fine").content == "<b>fine"
    # Llama 3: a '{' inside an answer is not a call
    assert make_parser("llama3_json").extract('Use {"a": 1} as input.') == ('Use {"a": 1} as input.', [])


def test_unknown_parser_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="hermes"):
        check_parser_name("qwen")

"""Structured outputs through the official openai client against a real `hybridkv serve`
subprocess on the demo model: response_format json_schema (strict) and json_object on
/v1/chat/completions and /v1/completions, vLLM's `structured_outputs` extra body field, a schema
that cannot compile is a 400 with an OpenAI error body, and /metrics counts the compiles."""
from __future__ import annotations

import json
import re
import urllib.request

import jsonschema
import openai
import pytest

from demo_server import demo_server


SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 3}},
        "required": ["name", "age", "hobbies"], "additionalProperties": False},
    "weather": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "forecast": {"type": "array", "items": {"type": "object", "properties": {
            "day": {"enum": ["mon", "tue", "wed"]}, "temp": {"type": "integer", "minimum": -50, "maximum": 60}},
            "required": ["day", "temp"], "additionalProperties": False}, "minItems": 1, "maxItems": 2}},
        "required": ["city", "unit", "forecast"], "additionalProperties": False},
    "flag": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False},
}


@pytest.fixture(scope="module")
def server():
    with demo_server() as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=300)


def _json_schema(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=11)])
def test_chat_json_schema_strict_outputs_validate(client, sampling):
    for name in SCHEMAS:
        r = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": f"Give me a {name} record as JSON."}],
            response_format=_json_schema(name), max_tokens=200, n=2, **sampling)
        for choice in r.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


@pytest.mark.slow
def test_json_object_gives_a_json_object_on_both_endpoints(client):
    question = "Reply with a short JSON object with the keys name and age of a cat."
    r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": question}],
                                       response_format={"type": "json_object"}, max_tokens=300, temperature=0)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict)
    c = client.completions.create(model="demo", prompt="A JSON object describing a dog:", max_tokens=200,
                                  temperature=0, extra_body={"response_format": _json_schema("flag")})
    jsonschema.validate(json.loads(c.choices[0].text), SCHEMAS["flag"])


@pytest.mark.slow
def test_structured_outputs_extra_body_regex_choice_and_grammar(client):
    msgs = [{"role": "user", "content": "Pick one."}]
    r = client.chat.completions.create(model="demo", messages=msgs, max_tokens=20, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert r.choices[0].message.content in ("left", "right")
    r = client.chat.completions.create(model="demo", messages=msgs, max_tokens=20, temperature=0,
                                       extra_body={"structured_outputs": {"regex": r"[0-9]{4}-[0-9]{2}"}})
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}", r.choices[0].message.content)
    c = client.completions.create(model="demo", prompt="Answer:", max_tokens=20, temperature=0,
                                  extra_body={"structured_outputs": {"grammar": 'start: "A" | "B" "!"'}})
    assert c.choices[0].text in ("A", "B!")


@pytest.mark.slow
def test_a_schema_that_cannot_compile_is_a_400_with_an_openai_error_body(client, server):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}, "strict": True}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                       response_format=bad, max_tokens=5)
    body = e.value.body
    assert e.value.status_code == 400 and body["param"] == "response_format" and "objekt" in body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo", prompt="hi", max_tokens=5,
                                  extra_body={"structured_outputs": {"regex": "(unclosed"}})
    assert e.value.body["param"] == "structured_outputs"
    with pytest.raises(openai.BadRequestError):  # tool calling stays refused
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    with urllib.request.urlopen(f"{server}/metrics") as r:
        text = r.read().decode()
    assert re.search(r'hybridkv:structured_output_compile_seconds_count\{model_name="demo"\} [1-9]', text)
    assert re.search(r'hybridkv:structured_output_compile_failures_total\{model_name="demo"\} [1-9]', text)
    assert re.search(r'hybridkv:structured_output_requests_total\{model_name="demo"\} [1-9]', text)


@pytest.mark.slow
def test_a_streamed_constrained_answer_validates(client):
    stream = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "The weather in Oslo as JSON."}],
        response_format=_json_schema("weather"), max_tokens=200, temperature=0, stream=True)
    text, reasons = "", []
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            reasons.append(c.finish_reason)
    assert reasons[-1] == "stop"
    jsonschema.validate(json.loads(text), SCHEMAS["weather"])

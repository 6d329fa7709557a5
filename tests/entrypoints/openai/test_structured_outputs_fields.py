"""response_format and structured_outputs are read into one StructuredOutputsParams on both
endpoints; malformed values are 400s naming the field (no server, no model needed)."""
from __future__ import annotations

import pytest

from hybridkv.entrypoints.openai.errors import OpenAIError
from hybridkv.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
MSGS = [{"role": "user", "content": "hi"}]


def _chat(**fields):
    return ChatCompletionRequest.parse({"messages": MSGS, **fields}).sampling


def test_response_format_forms_map_to_structured_outputs():
    assert _chat(response_format={"type": "text"}).structured_outputs is None
    assert _chat(response_format={"type": "json_object"}).structured_outputs.json_object is True
    so = _chat(response_format={"type": "json_schema",
                                "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}).structured_outputs
    assert so.json == SCHEMA
    params = _chat(response_format={"type": "json_object"}).to_params(None, None, {})
    assert params.structured_outputs.json_object is True


def test_structured_outputs_extra_field_on_both_endpoints():
    assert _chat(structured_outputs={"regex": "[0-9]+"}).structured_outputs.regex == "[0-9]+"
    req = CompletionRequest.parse({"prompt": "x", "structured_outputs": {"choice": ["a", "b"]}})
    assert req.sampling.structured_outputs.choice == ["a", "b"]
    assert req.sampling.structured_outputs_param == "structured_outputs"
    req = CompletionRequest.parse({"prompt": "x", "response_format": {"type": "json_object"}})
    assert req.sampling.structured_outputs.json_object


@pytest.mark.parametrize("fields,param", [
    (dict(response_format={"type": "yaml"}), "response_format.type"),
    (dict(response_format="json"), "response_format"),
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}}), "response_format.json_schema.name"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}}),
     "response_format.json_schema.schema"),
    (dict(structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs"),
    (dict(structured_outputs={"whitespace_pattern": " "}), "structured_outputs.whitespace_pattern"),
    (dict(structured_outputs={"choice": []}), "structured_outputs"),
    (dict(structured_outputs={"regex": "a"}, response_format={"type": "json_object"}), "structured_outputs"),
    (dict(tools=[{"type": "function", "function": {}}]), "tools[0].function.name"),
    (dict(tool_choice="required"), "tool_choice"),
])
def test_malformed_constraints_are_400s_naming_the_field(fields, param):
    with pytest.raises(OpenAIError) as e:
        ChatCompletionRequest.parse({"messages": MSGS, **fields})
    assert e.value.status == 400 and e.value.param == param


def test_sglang_native_constraint_fields_map_to_structured_outputs():
    from hybridkv.entrypoints.openai.serving_native import parse_generate

    req = parse_generate({"text": "x", "sampling_params": {"regex": "[0-9]+"}})
    assert req.params.structured_outputs.regex == "[0-9]+"
    req = parse_generate({"text": "x", "sampling_params": {"json_schema": '{"type": "object"}'}})
    assert req.params.structured_outputs.json == '{"type": "object"}'
    assert parse_generate({"text": "x", "sampling_params": {"ebnf": 'root ::= "a"'}}).params.structured_outputs.grammar
    for bad in ({"regex": "a", "ebnf": "b"}, {"json_schema": "not json"}, {"structural_tag": "{}"}):
        with pytest.raises(OpenAIError) as e:
            parse_generate({"text": "x", "sampling_params": bad})
        assert e.value.status == 400

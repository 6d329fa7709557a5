"""The request fields that constrain an answer: OpenAI's `response_format` and vLLM's
`structured_outputs` extra body field, read into one StructuredOutputsParams.

- response_format: {"type": "text"} (no constraint), {"type": "json_object"} (any JSON object),
  {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}};
- structured_outputs: exactly one of {"json": schema, "regex": str, "choice": [str, ...],
  "grammar": str (Lark or GBNF), "json_object": true}.

Giving both is refused: they would say two things about the same output. Whether the grammar
compiles is checked later, against the model's tokenizer (ServingContext.start), and a spec that
cannot be compiled is a 400 naming the field the client used.
"""
from __future__ import annotations

from typing import Any

from hybridkv.engine.sampling_params import StructuredOutputsParams
from hybridkv.entrypoints.openai.errors import bad_request

_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_JSON_SCHEMA_KEYS = ("name", "schema", "strict", "description")


def _type_name(v: Any) -> str:
    from hybridkv.entrypoints.openai.protocol import json_type  # protocol imports this module

    return json_type(v)


def _response_format(v: Any) -> StructuredOutputsParams | None:
    param = "response_format"
    if not isinstance(v, dict):
        raise bad_request(f"Invalid type for '{param}': expected an object, but got {_type_name(v)} instead.", param)
    kind = v.get("type")
    extra = sorted(set(v) - {"type", "json_schema"})
    if extra:
        raise bad_request(f"Unrecognized request argument supplied: {param}.{extra[0]}", f"{param}.{extra[0]}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise bad_request(f"Invalid value for '{param}.type': expected one of text, json_object, json_schema, "
                          f"but got {kind!r} instead.", f"{param}.type")
    js = v.get("json_schema")
    where = f"{param}.json_schema"
    if not isinstance(js, dict):
        if js is None:
            raise bad_request(f"Missing required parameter: '{where}'.", where)
        raise bad_request(f"Invalid type for '{where}': expected an object, but got {_type_name(js)} instead.", where)
    extra = sorted(set(js) - set(_JSON_SCHEMA_KEYS))
    if extra:
        raise bad_request(f"Unrecognized request argument supplied: {where}.{extra[0]}", f"{where}.{extra[0]}")
    if not isinstance(js.get("name"), str) or not js["name"]:
        raise bad_request(f"Missing required parameter: '{where}.name'.", f"{where}.name")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise bad_request(f"Invalid type for '{where}.strict': expected a boolean, but got "
                          f"{_type_name(js['strict'])} instead.", f"{where}.strict")
    schema = js.get("schema")
    if schema is None:  # OpenAI: no schema means any JSON (vLLM does the same)
        return StructuredOutputsParams(json_object=True)
    if not isinstance(schema, dict):
        raise bad_request(f"Invalid type for '{where}.schema': expected an object, but got {_type_name(schema)} "
                          "instead.", f"{where}.schema")
    return StructuredOutputsParams(json=schema)


def _structured_outputs(v: Any) -> StructuredOutputsParams:
    param = "structured_outputs"
    if not isinstance(v, dict):
        raise bad_request(f"Invalid type for '{param}': expected an object, but got {_type_name(v)} instead.", param)
    extra = sorted(set(v) - set(_STRUCTURED_KEYS))
    if extra:
        raise bad_request(f"'{param}.{extra[0]}' is not supported by this server (it takes one of "
                          f"{', '.join(_STRUCTURED_KEYS)}).", f"{param}.{extra[0]}")
    fields = {k: v[k] for k in _STRUCTURED_KEYS if v.get(k) is not None}
    if "json" in fields and not isinstance(fields["json"], (dict, str)):
        raise bad_request(f"Invalid type for '{param}.json': expected a JSON schema object, but got "
                          f"{_type_name(fields['json'])} instead.", f"{param}.json")
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as e:
        raise bad_request(str(e).replace("StructuredOutputsParams", param), param) from None


def read_structured_outputs(response_format: Any, structured_outputs: Any) -> tuple[StructuredOutputsParams | None, str]:
    """(the constraint or None, the field it came from, for error messages)."""
    if structured_outputs is not None:
        if response_format is not None and response_format != {"type": "text"}:
            raise bad_request("Pass either 'response_format' or 'structured_outputs', not both.", "structured_outputs")
        return _structured_outputs(structured_outputs), "structured_outputs"
    if response_format is not None:
        return _response_format(response_format), "response_format"
    return None, "response_format"

"""Tool calling on /v1/chat/completions: the request's `tools` and `tool_choice`, and what they
make of the generation.

- `tools` are rendered into the prompt by the model's chat template (transformers' `tools=`
  argument), except with `tool_choice: "none"`, where the model is not offered them.
- `tool_choice: "required"` and a named function are enforced by constrained decoding (vLLM's
  way): the output is JSON, a non-empty array of `{"name", "parameters"}` objects whose name is
  one of the tools and whose parameters validate against that tool's `parameters` schema
  (`"required"`; one element without `parallel_tool_calls`), or the named function's arguments
  object itself. The calls come back in `message.tool_calls`, with `content` null.
- `tool_choice: "auto"` (the default when tools are given) lets the model decide, in its own
  format: `--enable-auto-tool-choice --tool-call-parser NAME` (tool_parsers.py) must be set, as
  vLLM requires, or the request is a 400 saying so.

`finish_reason` is `"tool_calls"` when the answer is calls (and it ended by itself, not at
max_tokens).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hybridkv.engine.sampling_params import StructuredOutputsParams
from hybridkv.entrypoints.openai.errors import bad_request
from hybridkv.entrypoints.openai.tool_parsers import ToolCall

ANY_OBJECT = {"type": "object"}


@dataclass
class ToolRequest:
    """The request's tools, validated: `tools` in OpenAI's shape, `choice` one of "none", "auto",
    "required" or a function's name (`named`)."""

    tools: list[dict]
    choice: str
    named: str | None = None
    parallel: bool = True

    @property
    def rendered_tools(self) -> list[dict] | None:
        """What the chat template is given (None: no tools in the prompt)."""
        return self.tools if self.tools and self.choice != "none" else None

    @property
    def constrained(self) -> bool:
        return self.choice == "required" or self.named is not None

    def schema(self) -> dict:
        """The JSON schema the output must match when the choice is enforced."""
        params = {t["function"]["name"]: t["function"].get("parameters") or ANY_OBJECT for t in self.tools}
        if self.named is not None:
            return params[self.named]
        call = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                 "required": ["name", "parameters"], "additionalProperties": False}
                for name, schema in params.items()]
        array = {"type": "array", "items": {"anyOf": call}, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return array

    def constraint(self) -> StructuredOutputsParams | None:
        return StructuredOutputsParams(json=self.schema()) if self.constrained else None

    def calls_from(self, text: str) -> list[ToolCall]:
        """The calls of an enforced choice's output (JSON the grammar guaranteed, unless the
        output was cut at max_tokens: then there are none)."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return []
        if self.named is not None:
            return [ToolCall(self.named, json.dumps(value, ensure_ascii=False))]
        return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value]


def read_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolRequest:
    """Validate the three fields (any of them None: absent)."""
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise bad_request("Invalid type for 'tools': expected an array of tool objects.", "tools")
    names: list[str] = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise bad_request(f"Invalid value for '{where}': expected {{\"type\": \"function\", \"function\": {{...}}}}.",
                              where)
        fn = t["function"]
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"Missing required parameter: '{where}.function.name'.", f"{where}.function.name")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad_request(f"Invalid type for '{where}.function.parameters': expected a JSON schema object.",
                              f"{where}.function.parameters")
        if fn["name"] in names:
            raise bad_request(f"Invalid value for 'tools': the function name {fn['name']!r} is given twice.", "tools")
        names.append(fn["name"])
    if parallel_tool_calls is None:
        parallel_tool_calls = True
    if not isinstance(parallel_tool_calls, bool):
        raise bad_request("Invalid type for 'parallel_tool_calls': expected a boolean.", "parallel_tool_calls")
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise bad_request(f"Invalid value for 'tool_choice': expected none, auto, required or a named function, "
                              f"but got {tool_choice!r} instead.", "tool_choice")
        if tool_choice != "none" and not tools:
            raise bad_request(f"Invalid value for 'tool_choice': {tool_choice!r} needs 'tools'.", "tool_choice")
        return ToolRequest(tools, tool_choice, None, parallel_tool_calls)
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad_request("Invalid value for 'tool_choice': expected none, auto, required or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}.", "tool_choice")
    if name not in names:
        raise bad_request(f"Invalid value for 'tool_choice': function {name!r} is not among 'tools'.", "tool_choice")
    return ToolRequest(tools, "named", name, parallel_tool_calls)


def read_assistant_tool_calls(where: str, calls: Any) -> list[dict]:
    """An assistant message's `tool_calls`, for the chat template: the arguments as objects (the
    shape transformers' templates render), the id kept."""
    if not isinstance(calls, list):
        raise bad_request(f"Invalid type for '{where}.tool_calls': expected an array.", f"{where}.tool_calls")
    out = []
    for j, c in enumerate(calls):
        cw = f"{where}.tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"Invalid value for '{cw}': expected {{\"id\", \"type\": \"function\", \"function\": "
                              "{\"name\", \"arguments\"}}.", cw)
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            raise bad_request(f"Invalid value for '{cw}.function.arguments': not valid JSON.",
                              f"{cw}.function.arguments") from None
        out.append({"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def stream_call_deltas(calls: list[ToolCall]) -> list[dict]:
    """OpenAI's streamed form of calls: per call, a delta with its index, id and name (empty
    arguments), then one with its arguments."""
    deltas = []
    for i, c in enumerate(calls):
        deltas.append({"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}})
        deltas.append({"index": i, "function": {"arguments": c.arguments}})
    return deltas

"""Tool-call parsers: a model's own tool-call format turned into OpenAI `tool_calls`.

With `tool_choice="auto"` the model decides whether to call a tool, in the format its chat
template taught it; `--tool-call-parser` names that format (vLLM's names):

- `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one block per call;
- `llama3_json` (Llama 3.1+): a JSON object `{"name": ..., "parameters": {...}}` (optionally
  after `<|python_tag|>`), several separated by `;`;
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}`;
- `deepseek_v4` (also `deepseek_v32`): DeepSeek's DSML block,
  `<｜DSML｜function_calls><｜DSML｜invoke name="f"><｜DSML｜parameter name="p" string="true">v
  </｜DSML｜parameter></｜DSML｜invoke></｜DSML｜function_calls>`, where `string="false"` marks a
  JSON value.

Text before the first call is the message's content. A call whose JSON does not parse leaves the
whole output as content (what vLLM does): a client then sees what the model wrote rather than
a call that was never made.

Streaming: the content streams until a call's start marker could begin (the possible beginning
of a marker is held back, as the reasoning parser holds back `</think>`); from the marker on the
output is buffered and parsed once complete, then sent as OpenAI's deltas: for each call, its
id and name first, then its arguments. Parsing half-written JSON as it arrives is what broke
streaming tool calls in other engines; a call's arguments arriving in one piece is valid
OpenAI streaming, and clients join the pieces either way.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

PARSERS = ("hermes", "llama3_json", "mistral", "deepseek_v4", "deepseek_v32")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def check_parser_name(name: str) -> str:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {list(PARSERS)}")
    return name


def _call(name, arguments) -> ToolCall:
    if not isinstance(name, str) or not name:
        raise ValueError("a tool call without a name")
    if isinstance(arguments, str):  # some models write the arguments as JSON text already
        arguments = json.loads(arguments)
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise ValueError("tool-call arguments that are not an object")
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


class ToolParser:
    """One format: where calls start, and how a complete output's calls parse."""

    start_markers: tuple[str, ...] = ()

    def call_start(self, text: str) -> int:
        """Index where the first call begins in text (-1: none)."""
        found = [i for i in (text.find(m) for m in self.start_markers) if i >= 0]
        return min(found) if found else -1

    def parse_calls(self, text: str) -> list[ToolCall]:
        """The calls in text, which starts at a call's marker; ValueError when they do not parse."""
        raise NotImplementedError

    def extract(self, output: str) -> tuple[str | None, list[ToolCall]]:
        """A whole output as (content, calls)."""
        start = self.call_start(output)
        if start < 0:
            return output or None, []
        try:
            calls = self.parse_calls(output[start:])
        except (ValueError, json.JSONDecodeError):
            return output or None, []
        if not calls:
            return output or None, []
        content = output[:start].strip()
        return content or None, calls


class HermesParser(ToolParser):
    start_markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def parse_calls(self, text: str) -> list[ToolCall]:
        calls = []
        for body in self._block.findall(text):
            obj = json.loads(body)
            calls.append(_call(obj.get("name"), obj.get("arguments", obj.get("parameters"))))
        return calls


class Llama3JsonParser(ToolParser):
    start_markers = ("<|python_tag|>", "{")

    def call_start(self, text: str) -> int:
        # Only an output that is a call from its first non-space character: a '{' inside an
        # answer is not a call.
        stripped = text.lstrip()
        if stripped.startswith(("<|python_tag|>", "{")):
            return len(text) - len(stripped)
        return -1

    def parse_calls(self, text: str) -> list[ToolCall]:
        text = text.strip().removeprefix("<|python_tag|>").strip()
        decoder = json.JSONDecoder()
        calls, i = [], 0
        while i < len(text):
            obj, i = decoder.raw_decode(text, i)
            if not isinstance(obj, dict):
                raise ValueError("a tool call that is not an object")
            calls.append(_call(obj.get("name"), obj.get("parameters", obj.get("arguments"))))
            while i < len(text) and text[i] in " \n\t;":
                i += 1
        return calls


class MistralParser(ToolParser):
    start_markers = ("[TOOL_CALLS]",)

    def parse_calls(self, text: str) -> list[ToolCall]:
        body = text[len("[TOOL_CALLS]"):].strip()
        obj, _ = json.JSONDecoder().raw_decode(body)
        items = obj if isinstance(obj, list) else [obj]
        return [_call(o.get("name"), o.get("arguments")) for o in items]


DSML = "｜DSML｜"  # the fullwidth bars are part of DeepSeek's special tokens


class DeepSeekDsmlParser(ToolParser):
    start_markers = (f"<{DSML}function_calls>",)
    _invoke = re.compile(rf'<{DSML}invoke\s+name="([^"]+)"\s*>(.*?)</{DSML}invoke>', re.S)
    _param = re.compile(rf'<{DSML}parameter\s+name="([^"]+)"(?:\s+string="(true|false)")?\s*>(.*?)</{DSML}parameter>',
                        re.S)

    def parse_calls(self, text: str) -> list[ToolCall]:
        calls = []
        for name, body in self._invoke.findall(text):
            args = {}
            for pname, is_string, value in self._param.findall(body):
                args[pname] = json.loads(value) if is_string == "false" else value
            calls.append(_call(name, args))
        return calls


def make_parser(name: str) -> ToolParser:
    check_parser_name(name)
    return {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser,
            "deepseek_v4": DeepSeekDsmlParser, "deepseek_v32": DeepSeekDsmlParser}[name]()


@dataclass
class ToolStreamDelta:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallStream:
    """One output's content and calls, fed its text deltas in order."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""  # everything seen
        self.sent = 0  # characters of text already sent as content
        self.in_call = False

    def _held(self) -> int:
        """Characters at the end of text that could begin a start marker."""
        tail = self.text[self.sent:]
        for m in self.parser.start_markers:
            for n in range(min(len(m) - 1, len(tail)), 0, -1):
                if m.startswith(tail[-n:]):
                    return n
        return 0

    def feed(self, delta: str) -> ToolStreamDelta:
        self.text += delta
        if self.in_call:
            return ToolStreamDelta()
        start = self.parser.call_start(self.text)
        if start >= 0:
            self.in_call = True
            out = ToolStreamDelta(self.text[self.sent:start])
            self.sent = start
            return out
        if isinstance(self.parser, Llama3JsonParser) and not self.text.strip():
            return ToolStreamDelta()  # leading whitespace: a call may still start
        end = len(self.text) - self._held()
        out = ToolStreamDelta(self.text[self.sent:end])
        self.sent = end
        return out

    def finish(self) -> ToolStreamDelta:
        """The end of the output: the calls, or (when none parses) the rest as content."""
        if not self.in_call:
            out = ToolStreamDelta(self.text[self.sent:])
            self.sent = len(self.text)
            return out
        content, calls = self.parser.extract(self.text)
        if not calls:  # the call did not parse: what the model wrote is the content
            out = ToolStreamDelta(self.text[self.sent:])
        else:
            out = ToolStreamDelta("", calls)
        self.sent = len(self.text)
        return out

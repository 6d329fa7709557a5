"""A chat answer's text turned into OpenAI's message fields, whole or delta by delta.

Two optional stages, in this order: the reasoning parser (reasoning_parser.py) takes what the
model wrote between `<think>` and `</think>` into `reasoning_content`; what follows is the
answer, which the tools then read (tool_calling.py): with an enforced `tool_choice` the whole
answer is the calls' JSON, with `"auto"` the model's own tool-call format is parsed out of it
(tool_parsers.py), and otherwise it is the `content`. The whole and the streamed forms of one
output carry the same fields (tests/entrypoints/openai/test_chat_output.py).
"""
from __future__ import annotations

from hybridkv.entrypoints.openai.reasoning_parser import ReasoningStream
from hybridkv.entrypoints.openai.tool_calling import ToolRequest, stream_call_deltas
from hybridkv.entrypoints.openai.tool_parsers import ToolCall, ToolCallStream, ToolParser


class ChatOutput:
    """One choice's output. in_reasoning: None without a reasoning parser, else whether the
    prompt left the model inside its reasoning; parser: the auto tool-call parser (None: no
    auto tool calls)."""

    def __init__(self, in_reasoning: bool | None, tools: ToolRequest, parser: ToolParser | None) -> None:
        self.reasoning = ReasoningStream(in_reasoning) if in_reasoning is not None else None
        self.tools = tools
        self.auto = ToolCallStream(parser) if parser is not None and tools.choice == "auto" else None
        self.enforced = tools.constrained
        self.answer = ""  # the enforced choice's JSON, gathered until the end
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> dict:
        """The delta fields for the next piece of text ({} when nothing can be shown yet)."""
        reasoning, answer = self._split(text, final=False)
        return self._delta(reasoning, self._answer_piece(answer, final=False))

    def finish(self, text: str = "") -> dict:
        """The last piece of text and whatever was held back: the delta fields, the calls
        included (as OpenAI streams them)."""
        reasoning, answer = self._split(text, final=True)
        delta = self._delta(reasoning, self._answer_piece(answer, final=True))
        if self.calls:
            delta["tool_calls"] = stream_call_deltas(self.calls)
        return delta

    def message(self, text: str) -> dict:
        """The whole output as a message's fields."""
        reasoning, answer = self._split(text, final=True)
        content = self._answer_piece(answer, final=True)
        message: dict = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning if reasoning.strip() else None
        if self.calls:
            message["tool_calls"] = [c.to_openai() for c in self.calls]
        if not content and (self.reasoning is not None or self.calls):
            message["content"] = None  # the answer is the reasoning or the calls
        return message

    def finish_reason(self, reason: str | None) -> str | None:
        """"tool_calls" for an answer that is calls and ended by itself."""
        return "tool_calls" if self.calls and reason == "stop" else reason

    # -- stages ---------------------------------------------------------------------------------
    def _split(self, text: str, final: bool) -> tuple[str, str]:
        if self.reasoning is None:
            return "", text
        part = self.reasoning.feed(text)
        reasoning, answer = part.reasoning, part.content
        if final:
            rest = self.reasoning.finish()
            reasoning, answer = reasoning + rest.reasoning, answer + rest.content
        return reasoning, answer

    def _answer_piece(self, answer: str, final: bool) -> str:
        """The content to show for this piece of the answer (the calls are kept aside)."""
        if self.enforced:
            self.answer += answer
            if final:
                self.calls = self.tools.calls_from(self.answer)
                return "" if self.calls else self.answer  # cut at max_tokens: what was written
            return ""
        if self.auto is not None:
            piece = self.auto.feed(answer)
            content = piece.content
            if final:
                rest = self.auto.finish()
                content += rest.content
                self.calls = rest.calls
            return content
        return answer

    def _delta(self, reasoning: str, content: str) -> dict:
        delta = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content or not reasoning:
            delta["content"] = content
        return delta

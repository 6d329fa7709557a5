"""Reasoning parsers: a reasoning model's output split into `reasoning_content` and `content`.

DeepSeek-R1/V4 and Qwen3 think between `<think>` and `</think>` before they answer. Where the
thinking starts differs by model and chat template: Qwen3 writes `<think>` itself; DeepSeek-R1's
template ends the prompt with `<think>\\n`, and DeepSeek-V4's ends it with `<think>` (thinking
mode) or with `</think>` (non-thinking mode), so the output starts inside the reasoning or
after it. One parser covers them: it is told whether the prompt left the model inside a
reasoning block (`prompt_in_reasoning`: the prompt's last `<think>` comes after its last
`</think>`) and otherwise accepts an opening tag at the start of the output.

Streaming works on text deltas, which split the tags anywhere (a `</think>` can arrive as `</`,
`think`, `>`): the stream holds back the longest suffix of what it has seen that could still
start a tag, and releases it once the next delta decides. What was held back when the output
ends is flushed to the side it was on.

Names (`--reasoning-parser`, vLLM's): `deepseek_r1`, `deepseek_v4`, `qwen3`. They select the same
parser, since the rendered prompt already says where the output starts: an output without any
tag is the answer after a prompt that closed (or never opened) the reasoning (Qwen3, V4 in
non-thinking mode), and all reasoning after one that opened it (an R1/V4 output cut by
max_tokens before `</think>`).
"""
from __future__ import annotations

from dataclasses import dataclass

START_TAG = "<think>"
END_TAG = "</think>"
PARSERS = ("deepseek_r1", "deepseek_v4", "qwen3")


def check_parser_name(name: str) -> str:
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {list(PARSERS)}")
    return name


def prompt_in_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt leaves the model inside a reasoning block."""
    return prompt.rfind(START_TAG) > prompt.rfind(END_TAG)


def reasoning_precedes_answer(prompt: str) -> bool:
    """Whether the model will reason before it answers this prompt: the prompt does not end in a
    closed reasoning block (DeepSeek-V4's non-thinking mode, Qwen3 with thinking off). A
    constrained answer (response_format, an enforced tool choice) then starts after END_TAG."""
    return not prompt.rstrip().endswith(END_TAG)


def _held_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (what must be held
    back until the next delta says whether the tag follows)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningStream:
    """One output's split, fed its text deltas in order."""

    def __init__(self, in_reasoning: bool) -> None:
        # "start": the output may open with <think> (after whitespace); "reasoning"; "content".
        self.state = "reasoning" if in_reasoning else "start"
        self.held = ""  # text not yet attributed (a possible tag's beginning)
        self.content_started = False  # the answer's leading whitespace after </think> is dropped

    def feed(self, delta: str) -> ReasoningDelta:
        out = ReasoningDelta()
        text = self.held + delta
        self.held = ""
        while text:
            if self.state == "start":
                stripped = text.lstrip()
                if stripped.startswith(START_TAG):
                    self.state, text = "reasoning", stripped[len(START_TAG):]
                elif START_TAG.startswith(stripped):  # whitespace or a tag's beginning: undecided
                    self.held = text
                    return out
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                end = text.find(END_TAG)
                if end >= 0:
                    out.reasoning += text[:end]
                    self.state, text = "content", text[end + len(END_TAG):]
                    continue
                keep = _held_suffix(text, END_TAG)
                out.reasoning += text[:len(text) - keep]
                self.held = text[len(text) - keep:]
                return out
            else:
                if not self.content_started:
                    text = text.lstrip()
                    if not text:
                        return out
                    self.content_started = True
                out.content += text
                return out
        return out

    def finish(self) -> ReasoningDelta:
        """The end of the output: what was held back goes to the side it was on."""
        held, self.held = self.held, ""
        if self.state == "reasoning":
            return ReasoningDelta(reasoning=held)
        if not self.content_started:
            held = held.lstrip()
        return ReasoningDelta(content=held)


def split_reasoning(text: str, in_reasoning: bool) -> tuple[str | None, str | None]:
    """A whole output as (reasoning_content, content); None where a part is empty."""
    stream = ReasoningStream(in_reasoning)
    a, b = stream.feed(text), stream.finish()
    reasoning, content = a.reasoning + b.reasoning, a.content + b.content
    return (reasoning if reasoning.strip() else None), content or None

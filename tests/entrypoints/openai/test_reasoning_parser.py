"""Reasoning parsers on scripted outputs: the split into reasoning_content and content is the same
whole or streamed, whatever the deltas' boundaries (a `</think>` split across tokens included),
and where the reasoning starts follows the rendered prompt."""
from __future__ import annotations

import itertools

import pytest

from hybridkv.entrypoints.openai.reasoning_parser import (
    ReasoningStream, check_parser_name, prompt_in_reasoning, split_reasoning,
)

CASES = [
    # (output, prompt left the model inside <think>, reasoning, content)
    ("<think>\nplan: add 2 and 2\n</think>\n\nThe answer is 4.", False, "\nplan: add 2 and 2\n", "The answer is 4."),
    ("plan: add 2 and 2\n</think>\n\nThe answer is 4.", True, "plan: add 2 and 2\n", "The answer is 4."),
    ("The answer is 4.", False, None, "The answer is 4."),  # no reasoning at all (Qwen3, V4 non-thinking)
    ("still thinking about <b>tags</b> and <thin", True, "still thinking about <b>tags</b> and <thin", None),  # cut
    ("  <think>x</think>y", False, "x", "y"),  # leading whitespace before the tag
    ("<think></think>answer </think> kept", False, None, "answer </think> kept"),  # only the first tag counts
    ("<thinking is not a tag", False, None, "<thinking is not a tag"),
    ("a < b </think>c", True, "a < b ", "c"),
]


@pytest.mark.parametrize("output,in_reasoning,reasoning,content", CASES)
def test_whole_output_split(output, in_reasoning, reasoning, content):
    assert split_reasoning(output, in_reasoning) == (reasoning, content)


def _streamed(output: str, in_reasoning: bool, cuts: tuple[int, ...]) -> tuple[str, str]:
    stream = ReasoningStream(in_reasoning)
    pieces = [output[a:b] for a, b in zip((0, *cuts), (*cuts, len(output)))]
    r = c = ""
    for piece in pieces:
        d = stream.feed(piece)
        r, c = r + d.reasoning, c + d.content
    d = stream.finish()
    return r + d.reasoning, c + d.content


@pytest.mark.parametrize("output,in_reasoning,reasoning,content", CASES)
def test_every_split_into_three_deltas_streams_the_same_split(output, in_reasoning, reasoning, content):
    """Every way of cutting the output into up to three deltas: the tags split anywhere."""
    n = len(output)
    for cuts in itertools.combinations(range(1, n), 2) if n > 2 else [()]:
        r, c = _streamed(output, in_reasoning, cuts)
        assert (r if r.strip() else None, c or None) == (reasoning, content), f"cuts {cuts}: {r!r} / {c!r}"


def test_a_closing_tag_one_character_per_token():
    output = "weigh the options</think>Pick B."
    stream = ReasoningStream(in_reasoning=True)
    deltas = [stream.feed(ch) for ch in output] + [stream.finish()]
    assert "".join(d.reasoning for d in deltas) == "weigh the options"
    assert "".join(d.content for d in deltas) == "Pick B."
    # nothing of the tag leaks into either side while it arrives
    assert all("<" not in d.reasoning and "<" not in d.content for d in deltas)


def test_where_the_prompt_leaves_the_model():
    assert prompt_in_reasoning("<|User|>hi<|Assistant|><think>")  # V4 thinking, R1
    assert not prompt_in_reasoning("<|User|>hi<|Assistant|></think>")  # V4 non-thinking
    assert not prompt_in_reasoning("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")  # Qwen3
    assert not prompt_in_reasoning("...<think>\n\n</think>\n\n")  # Qwen3 with enable_thinking=False


def test_unknown_parser_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="deepseek_r1"):
        check_parser_name("deepseek")

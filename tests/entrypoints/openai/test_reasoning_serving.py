"""--reasoning-parser on /v1/chat/completions (a real server, the official openai client): the
reasoning and the answer come apart in `reasoning_content` and `content`, whole and streamed
alike, and where the reasoning starts follows the rendered prompt (a template that ends the
prompt inside `<think>`, as DeepSeek-R1/V4's thinking mode does, makes the whole output reasoning
until the model closes it). The split itself, on scripted outputs with tags across tokens, is
test_reasoning_parser.py's."""
from __future__ import annotations

import pytest

from server_harness import MODEL, launch

THINKING = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|><think>{% endif %}")
ANSWERING = THINKING.replace("<think>", "<think></think>")
MESSAGES = [{"role": "user", "content": "count the letters in banana"}]


@pytest.fixture(scope="module", params=[THINKING, ANSWERING], ids=["prompt-opens-think", "prompt-closes-think"])
def server(request, tiny_ckpt):
    handle = launch(tiny_ckpt("llama"), settings={"reasoning_parser": "deepseek_v4", "chat_template": request.param})
    yield handle, request.param
    handle.stop()


def test_whole_and_streamed_answers_split_the_same(server):
    srv, template = server
    client = srv.client()
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    message = whole.choices[0].message
    reasoning = getattr(message, "reasoning_content", None) or (message.model_extra or {}).get("reasoning_content")
    if template == THINKING:  # the tiny model never writes </think>: everything is reasoning
        assert reasoning and message.content is None
    else:
        assert reasoning is None and message.content
    r = c = ""
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                                stream=True):
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            r += extra.get("reasoning_content") or ""
            c += choice.delta.content or ""
    assert (r or None, c or None) == (reasoning, message.content), "the streamed split differs from the whole one"
    client.close()
    srv.engine.check_idle(timeout=15)


def test_an_unknown_parser_is_refused_before_the_model_loads(tiny_ckpt):
    from hybridkv.entrypoints.openai.api_server import ServerSettings

    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ServerSettings(reasoning_parser="r1").validate()


def test_a_constrained_answer_starts_after_the_reasoning(server):
    """With a reasoning parser the grammar applies after </think>: a prompt that closed the
    reasoning gets a valid JSON answer at once; one that opened it leaves the thinking free (the
    tiny model never closes it, so nothing is constrained and everything is reasoning)."""
    import json

    srv, template = server
    client = srv.client()
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
                                       response_format={"type": "json_object"})
    message = r.choices[0].message
    reasoning = (message.model_extra or {}).get("reasoning_content")
    if template == THINKING:
        assert reasoning and message.content is None
    else:
        assert reasoning is None
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(message.content), dict)
        else:  # cut at max_tokens: a JSON prefix
            assert message.content.lstrip().startswith("{")
    client.close()
    srv.engine.check_idle(timeout=15)

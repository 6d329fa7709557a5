"""Multi-turn prefix reuse on DeepSeek-V4 survives distractor traffic between turns: a conversation
whose history is cached gets every whole page of it back on the next turn, though four unrelated
400-token requests ran in between, on a configuration whose sliding window (24) does not divide
the 128-token page and whose compress ratios (4 and 32) are not the release's 4 / 128; outputs
equal those of a run without the prefix cache."""
from __future__ import annotations

import random

import pytest

from hybridkv import LLM, SamplingParams
from tiny_deepseek_v4 import build_v4_checkpoint, single_thread

TURNS, DISTRACTORS, PAGE = 6, 4, 128


@pytest.fixture(scope="module")
def v4_window_24(tmp_path_factory):
    return build_v4_checkpoint(str(tmp_path_factory.mktemp("v4_w24")), sliding_window=24,
                               compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32})


def _conversation(llm: LLM, vocab: int) -> list[tuple[int, int, list[int]]]:
    """(history before the turn, cached prompt tokens, output) per turn."""
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    history: list[int] = []
    turns = []
    for _ in range(TURNS):
        before = len(history)
        history = history + [rng.randrange(3, vocab) for _ in range(rng.randrange(150, 250))]
        out = llm.generate([{"prompt_token_ids": history}], params, use_tqdm=False)[0]
        turns.append((before, out.num_cached_tokens, list(out.outputs[0].token_ids)))
        history = history + list(out.outputs[0].token_ids)
        distractors = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(400)]} for _ in range(DISTRACTORS)]
        llm.generate(distractors, params, use_tqdm=False)
    return turns


@pytest.mark.slow
@pytest.mark.parametrize("budget_mib", [24, 96])
def test_every_whole_page_of_a_conversation_is_reused_after_distractors(v4_window_24, budget_mib):
    kw = dict(dtype="float32", max_model_len=4096, kv_cache_memory_bytes=budget_mib << 20, max_num_seqs=64)
    with single_thread():
        cached = LLM(v4_window_24, **kw)
        vocab = cached.engine.runner.config.vocab_size
        turns = _conversation(cached, vocab)
        reference = _conversation(LLM(v4_window_24, enable_prefix_caching=False, **kw), vocab)
    for i, (before, hit, output) in enumerate(turns[1:], 1):
        assert hit == before // PAGE * PAGE, f"turn {i}: {hit} of {before} history tokens reused, not every whole page"
        if i >= 2:
            assert hit >= 0.8 * before, f"turn {i}: reuse {hit / before:.2f} of the history"
    assert [t[2] for t in turns] == [t[2] for t in reference], "the prefix cache changed the outputs"

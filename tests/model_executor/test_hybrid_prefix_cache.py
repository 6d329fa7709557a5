"""Prefix caching on models with windowed block spaces (shadow prefix index):
DeepSeek-V4 tiny configs (swa + state_c4/state_c128 windowed rings, c4/c128/indexer whole-history), Mistral
(all-SWA) and Gemma-3 (full + SWA). A hit at every page boundary, with every windowed page
outside the kept tails tombstoned, gives the no-cache run's greedy tokens and logprobs."""
from __future__ import annotations

import pytest
import torch

from hybridkv.entrypoints import LLM
from prefix_hit_helpers import assert_hit_at_every_boundary, run_one
from tiny_deepseek_v4 import build_v4_checkpoint, single_thread

V4_CONFIGS = {
    # window 16 < page 32, HCA ratio 16: the SWA and state (16) tails sit inside one page
    # (an explicit block_size is always kept; these cases use page 32)
    "w16_p32": (dict(), 32, 100),
    # window 40 > page 32: the SWA tail spans two pages; state window 8 < page
    "w40_p32": (dict(sliding_window=40, index_topk=5), 32, 110),
}


@pytest.fixture(autouse=True)
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def v4_path(tmp_path_factory):
    built = {}

    def get(name):
        if name not in built:
            built[name] = build_v4_checkpoint(str(tmp_path_factory.mktemp(f"v4pc_{name}")), **V4_CONFIGS[name][0])
        return built[name]

    return get


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize("seed_tail", [0, 40])  # 40: the seed runs on past the page end in the same chunk
@pytest.mark.parametrize("name", list(V4_CONFIGS))
def test_v4_hit_at_every_page_boundary_equals_no_cache(v4_path, name, seed_tail):
    _, P, n = V4_CONFIGS[name]
    path = v4_path(name)
    ref = LLM(path, dtype="float32", block_size=P, max_model_len=256, max_num_seqs=2, enable_prefix_caching=False)
    prompt = _prompt(n, ref.engine.runner.config.vocab_size, seed=5)
    want = run_one(ref, prompt, 24)  # decodes past the window and across compression boundaries
    cached = LLM(path, dtype="float32", block_size=P, max_model_len=256, max_num_seqs=2)
    assert cached.engine.kv.page_size == P
    assert cached.engine.kv.enable_prefix_caching and set(cached.engine.kv.index.windows) == {"swa", "state_c4", "state_c128"}
    hit = assert_hit_at_every_boundary(cached, want, prompt, 24, seed_tail)
    assert hit == list(range(P, n, P))


def test_mistral_hit_at_every_page_boundary_equals_no_cache(tiny_ckpt):
    path = tiny_ckpt("mistral")  # sliding window 24, page 16: the tail spans two pages
    ref = LLM(path, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    prompt = _prompt(90, ref.engine.runner.config.vocab_size, seed=6)
    want = run_one(ref, prompt, 20)
    cached = LLM(path, dtype="float32", max_model_len=256)
    assert cached.engine.kv.enable_prefix_caching
    assert assert_hit_at_every_boundary(cached, want, prompt, 20) == list(range(16, 90, 16))


def test_gemma3_hit_at_every_page_boundary_equals_no_cache(tiny_ckpt):
    """Gemma-3: sliding layers (window 24) in the "swa" space, the full layer in "full"; a hit at
    every boundary, with far SWA pages tombstoned, equals the no-cache run."""
    path = tiny_ckpt("gemma3_text")
    ref = LLM(path, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    prompt = _prompt(90, ref.engine.runner.config.vocab_size, seed=7)
    want = run_one(ref, prompt, 20)
    cached = LLM(path, dtype="float32", max_model_len=256)
    assert cached.engine.kv.enable_prefix_caching and set(cached.engine.kv.index.windows) == {"swa"}
    assert set(cached.engine.kv.spaces) == {"full", "swa"}
    assert assert_hit_at_every_boundary(cached, want, prompt, 20) == list(range(16, 90, 16))


def _conversation(llm: LLM, ref: LLM | None, vocab: int, turns: int = 8):
    """8 turns: each prompt = the whole history + a 30-token user message. Returns per turn
    (history length, cached tokens) and checks every turn's output against ref (no cache)."""
    from prefix_hit_helpers import sampled_logprobs

    history = _prompt(300, vocab, seed=40)
    stats = []
    for t in range(turns):
        prompt = history + _prompt(30, vocab, seed=41 + t)
        out = run_one(llm, prompt, 16)
        if ref is not None:
            want = run_one(ref, prompt, 16)
            assert out.outputs[0].token_ids == want.outputs[0].token_ids, f"turn {t}: tokens differ"
            torch.testing.assert_close(
                torch.tensor(sampled_logprobs(out)), torch.tensor(sampled_logprobs(want)), atol=1e-4, rtol=0
            )
        stats.append((len(history), out.num_cached_tokens))
        history = prompt + out.outputs[0].token_ids
    return stats


@pytest.mark.slow
def test_v4_multi_turn_reuses_history_with_a_tiny_swa_pool(v4_path):
    """8 turns on V4 whose SWA pool holds 5 pages (one window + one chunk): the SWA pages of
    earlier turns are tombstoned, yet every turn after the first serves >= 90% of its history
    from cache and outputs equal the no-cache run. The baseline that drops a prefix once any
    SWA page on it is gone reuses almost nothing (recorded: ours 0.93-0.99 per turn, baseline 0)."""
    path = v4_path("w16_p32")
    kw = dict(dtype="float32", block_size=32, max_model_len=1024, max_num_seqs=1, max_num_batched_tokens=64)
    ref = LLM(path, enable_prefix_caching=False, **kw)
    vocab = ref.engine.runner.config.vocab_size
    llm = LLM(path, **kw)
    assert llm.engine.kv.spaces["swa"].num_pages <= 5
    ours = _conversation(llm, ref, vocab)
    index = llm.engine.kv.index
    assert sum(1 for nd in index.nodes() if nd.shadows["swa"] is None) > 10, "early turns' SWA should be tombstoned"
    baseline = _conversation(LLM(path, windowed_match=False, **kw), None, vocab)
    rates = [c / h for h, c in ours[1:]]
    base_rates = [c / h for h, c in baseline[1:]]
    print(f"multi-turn reuse per turn: shadow index {[round(r, 3) for r in rates]}, "
          f"drop-whole-prefix baseline {[round(r, 3) for r in base_rates]}")
    assert min(rates) >= 0.9, rates
    assert sum(base_rates) < sum(rates) / 2

"""N-gram speculative decoding (engine/speculative/): greedy outputs are token-identical with it
on and off, drafts are proposed and accepted, rejected positions leave nothing behind in the
block spaces, and what it does not support is refused before the model loads."""
import pytest
import torch

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.speculative.config import SpeculativeConfig
from hybridkv.engine.speculative.ngram_proposer import NgramIndex
from hybridkv.engine.speculative.verifier import accepted_length
from hybridkv.entrypoints import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _prompts(vocab: int) -> list[list[int]]:
    """Copy-friendly prompts (a random 8-token pattern repeated) beside random ones."""
    g = torch.Generator().manual_seed(3)
    pattern = torch.randint(3, vocab, (8,), generator=g).tolist()
    other = torch.randint(3, vocab, (5,), generator=g).tolist()
    return [pattern * 5, torch.randint(3, vocab, (37,), generator=g).tolist(), other * 6 + pattern[:3],
            torch.randint(3, vocab, (19,), generator=g).tolist()]


def _generate(llm: LLM, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.engine.check_invariants()
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


def _params(n: int, max_tokens: int = 40, **kw) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw) for _ in range(n)]


@pytest.mark.parametrize("arch,dtype", [("llama", "float32"), ("qwen3", "float32")])
def test_greedy_outputs_are_identical_with_speculation(tiny_ckpt, arch, dtype):
    """A batch of copy-friendly and random prompts, twice (the second pass hits the prefix
    cache), with prompts chunked by a small token budget: the tokens of plain greedy decoding.
    (Not in bfloat16 here: the tiny widths' bf16 linears change kernel with the row count, so even
    plain decoding's tokens depend on what shares the step.)"""
    path = tiny_ckpt(arch)
    kw = dict(dtype=dtype, max_model_len=256, max_num_batched_tokens=24, num_scheduler_steps=1)
    plain, spec = LLM(path, **kw), LLM(path, speculative_config=SPEC, **kw)
    prompts = _prompts(plain.engine.runner.config.vocab_size)
    params = _params(len(prompts))
    ref = _generate(plain, prompts, params)
    assert _generate(spec, prompts, params) == ref
    # fewer model calls than plain decoding: several tokens per verified step
    assert spec.engine.stats["steps"] < plain.engine.stats["steps"]
    assert _generate(spec, prompts, params) == ref  # prefix hits, pages published by verified decodes too
    st = spec.engine.stats
    assert st["spec_draft_tokens"] > 0 and st["spec_accepted_tokens"] > 0, st
    assert st["spec_accepted_tokens"] <= st["spec_draft_tokens"]
    per_pos = st["spec_accepted_per_position"]
    assert sum(per_pos) == st["spec_accepted_tokens"] and per_pos == sorted(per_pos, reverse=True)
    assert spec.engine.kv.prefix_hits > 0
    # the counters on /metrics
    from hybridkv.engine.async_llm_engine import EngineSnapshot
    from hybridkv.entrypoints.openai.metrics import _EngineCollector

    snap = EngineSnapshot.capture(spec.engine)
    metrics = {m.name: m for m in _EngineCollector(lambda: snap, "m").collect()}
    accepted = metrics["hybridkv:spec_decode_num_accepted_tokens"].samples[0].value
    assert accepted == st["spec_accepted_tokens"]
    assert "hybridkv:spec_decode_num_drafts" not in {m.name for m in _EngineCollector(
        lambda: EngineSnapshot.capture(plain.engine), "m").collect()}


@pytest.mark.parametrize("arch", ["mistral", "gemma3_text"])
def test_sliding_window_models_roll_back_exactly(tiny_ckpt, arch):
    """Windowed spaces (Mistral: every layer; Gemma-3: interleaved with full layers) with a
    window much shorter than the outputs, so it slides across verified steps: a rejected draft
    never released a page the accepted tokens still read, and outputs, prefix hits included,
    equal plain decoding's, with chunked prefill."""
    # (untied embeddings: the tied tiny Gemma only repeats its last token, so no draft is rejected)
    path = tiny_ckpt(arch, sliding_window=12, **({"tie_word_embeddings": False} if arch == "gemma3_text" else {}))
    kw = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=24, num_scheduler_steps=1, block_size=4)
    plain, spec = LLM(path, **kw), LLM(path, speculative_config=SPEC, **kw)
    assert any(s.window == 12 for s in spec.engine.kv.specs.values())
    prompts = _prompts(plain.engine.runner.config.vocab_size)
    params = _params(len(prompts), max_tokens=48)
    ref = _generate(plain, prompts, params)
    assert _generate(spec, prompts, params) == ref
    assert _generate(spec, prompts, params) == ref  # the prefix cache's windows
    st = spec.engine.stats
    assert st["spec_accepted_tokens"] > 0 and st["spec_accepted_tokens"] < st["spec_draft_tokens"], st
    assert spec.engine.kv.prefix_hits > 0


def test_stops_and_budgets_inside_accepted_drafts(tiny_ckpt):
    """Stop ids, max_tokens and non-greedy requests beside drafted ones: tokens after a stop are
    dropped, a sampled request decodes normally (its seed gives the same tokens)."""
    path = tiny_ckpt("llama")
    kw = dict(dtype="float32", max_model_len=256, num_scheduler_steps=1)
    plain, spec = LLM(path, **kw), LLM(path, speculative_config=SPEC, **kw)
    prompts = _prompts(plain.engine.runner.config.vocab_size)
    ref = _generate(plain, prompts, _params(len(prompts)))
    stop = ref[0][0][29]  # a token the first request generates at its 30th step (or before)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop]),
              SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=27, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)]
    ref = _generate(plain, prompts, params)
    got = _generate(spec, prompts, params)
    assert got == ref
    assert ref[0][1] == "stop" and ref[2][1] == "length" and len(ref[2][0]) == 27
    assert spec.engine.stats["spec_accepted_tokens"] > 0


def test_preemption_with_speculation(tiny_ckpt):
    """A KV budget too small for the batch: requests are preempted and resume; outputs unchanged."""
    path = tiny_ckpt("llama")
    kw = dict(dtype="float32", max_model_len=96, num_scheduler_steps=1, block_size=4)
    plain = LLM(path, **kw)
    pages = 30
    kw["kv_cache_memory_bytes"] = pages * plain.engine.kv_cache_bytes["device"]["full"] // (
        plain.engine.kv.spaces["full"].num_pages)
    plain, spec = LLM(path, **kw), LLM(path, speculative_config=SPEC, **kw)
    prompts = _prompts(plain.engine.runner.config.vocab_size)
    params = _params(len(prompts), max_tokens=30)
    ref = _generate(plain, prompts, params)
    assert _generate(spec, prompts, params) == ref
    assert spec.engine.scheduler.num_preemptions > 0
    assert spec.engine.stats["spec_accepted_tokens"] > 0


def test_ngram_index_proposes_the_latest_continuation():
    idx = NgramIndex(1, 3, 4)
    toks = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    assert idx.propose(toks, 3) == [7, 5, 1]  # the latest earlier "1 2 3" wins
    toks += [7, 5]
    assert idx.propose(toks, 4) == [1, 2, 3, 7]  # "3 7 5" at 6..8 (indexed incrementally)
    assert NgramIndex(2, 2, 4).propose([4, 5, 6], 2) == []
    assert NgramIndex(1, 1, 4).propose([4, 5, 4], 5) == [5, 4]  # fewer at the end
    assert accepted_length([1, 2, 3], [1, 2, 4, 8]) == 2 and accepted_length([5], [6, 1]) == 0


def test_draft_length_adapts_to_what_is_accepted():
    """A rejection shrinks the next draft to one more than was accepted; a fully accepted draft
    doubles it, never past num_speculative_tokens."""
    idx = NgramIndex(1, 1, 6)
    assert idx.draft_len == 6
    idx.adapt_draft_len(6, 0)
    assert idx.draft_len == 1
    idx.adapt_draft_len(1, 1)
    assert idx.draft_len == 2
    idx.adapt_draft_len(2, 2)
    idx.adapt_draft_len(4, 4)
    assert idx.draft_len == 6  # capped
    idx.adapt_draft_len(6, 2)
    assert idx.draft_len == 3
    toks = [1, 2, 3, 4, 5, 6, 7, 1]
    assert idx.propose(toks, 3) == [2, 3, 4]


def test_refused_settings_raise_before_the_model_loads(tiny_ckpt, monkeypatch):
    import hybridkv.engine.llm_engine as llm_engine

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(llm_engine, "ModelRunner", no_load)
    with pytest.raises(ValueError, match="supported: \\['ngram', 'mtp'\\]"):
        EngineConfig(speculative_config={"method": "eagle", "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match="LlamaForCausalLM .* has none"):  # no MTP layer: refused before loading
        LLM(tiny_ckpt("llama"), speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig.parse({"method": "ngram"})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
                                '"prompt_lookup_max": 2}')


def test_truncate_returns_the_pages_of_rejected_positions_and_publishes_none():
    """KVCacheManager.truncate: pages past the accepted tokens go back to the free list, the
    block table shrinks with them, and only whole pages of accepted tokens are ever published."""
    from hybridkv.block_manager.kv_cache_manager import KVCacheManager
    from hybridkv.block_manager.space_spec import SpaceSpec

    P = 4
    kv = KVCacheManager([SpaceSpec("full", bytes_per_slot=8)], {"full": 16}, P, True, decode_publish_tokens=P)
    toks = list(range(100, 106))  # 6 prompt tokens
    assert kv.allocate("a", len(toks))
    kv.commit("a", toks, len(toks), prompt_done=True)
    free = kv.spaces["full"].num_free
    assert kv.allocate("a", len(toks) + 1 + 6, decode=True)  # last token + 6 drafts: 13 tokens, 4 pages
    assert kv.spaces["full"].num_free == free - 2
    toks += [7, 8]  # the last token was computed, one draft accepted; the model's token follows
    kv.truncate("a", 7)
    kv.commit("a", toks, 7)
    kv.check_invariants()
    assert kv.spaces["full"].num_free == free and len(kv.page_table("a", "full")) == 2
    assert kv.match_prefix(toks + [0], touch=False).num_tokens == 4  # page 2 (tokens 4..7) is not whole yet
    assert kv.allocate("a", 8, decode=True)  # the next step grows again
    kv.retire("a", toks, 7, turn_done=True)
    kv.assert_idle()


def test_the_cli_passes_the_speculative_config_through():
    from hybridkv.entrypoints.cli import build_parser, engine_kwargs

    for cmd in ("generate", "serve"):
        args = build_parser().parse_args([cmd, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
        assert SpeculativeConfig.parse(engine_kwargs(args)["speculative_config"]).num_speculative_tokens == 3


def test_streams_under_the_async_engine_equal_plain_decoding(tiny_ckpt):
    """The server's engine (streamed deltas, a step at a time): the tokens of plain decoding."""
    import asyncio

    from hybridkv.engine.async_llm_engine import AsyncLLMEngine

    path = tiny_ckpt("llama")
    plain = LLM(path, dtype="float32", max_model_len=256)
    prompts = _prompts(plain.engine.runner.config.vocab_size)[:2]
    ref = [t for t, _ in _generate(plain, prompts, _params(2))]
    eng = AsyncLLMEngine.from_config(EngineConfig(model=path, dtype="float32", max_model_len=256,
                                                  speculative_config=SPEC))

    async def one(p, rid):
        outs = [o async for o in eng.generate({"prompt_token_ids": p}, _params(1)[0], rid)]
        return list(outs[-1].outputs[0].token_ids)  # cumulative outputs: the last holds them all

    async def run():
        return await asyncio.gather(*(one(p, f"r{i}") for i, p in enumerate(prompts)))

    try:
        assert asyncio.run(run()) == ref
        assert eng.engine.stats["spec_accepted_tokens"] > 0
    finally:
        eng.shutdown()

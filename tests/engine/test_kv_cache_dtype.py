"""The FP8 KV cache (kv_cache_dtype) end to end on tiny checkpoints.

- the option: EngineConfig / LLM / `--kv-cache-dtype` accept vLLM's four names and nothing else,
  and the path that cannot read an FP8 cache (xformers) refuses it by name;
- the pools are FP8 and greedy tokens mostly agree with the model-dtype cache;
- exactness: prefix hits, chunked prefill, preemption, the fused decode, the host tier and the
  file storage tier give exactly the tokens (and logprobs) of the same FP8 engine without them,
  since every path reads the cache's FP8 bytes and the tiers move those bytes as they are;
- capacity: an equal budget holds twice the pages of a bfloat16 cache;
- the storage fingerprint names the KV dtype: an FP8 engine gets no hit on an auto engine's store.
"""
from __future__ import annotations

import pytest
import torch

from hybridkv.engine.config import EngineConfig
from hybridkv.entrypoints import LLM, SamplingParams
from hybridkv.entrypoints.cli import build_parser, engine_kwargs
from hybridkv.model_executor.model_runner import kv_cache_dtype_for
from hybridkv.model_executor.models.llama import LlamaForCausalLM
from host_tier_helpers import assert_host_hit_at_every_boundary
from prefix_hit_helpers import LOGPROB_ATOL, assert_hit_at_every_boundary, run_one, sampled_logprobs
from tp_helpers import assert_logprobs_close, prompts_with_prefix, run_passes, shut_down  # noqa: F401 - a fixture

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _prompts(vocab: int, n: int, seed: int = 0) -> list[dict]:
    """n prompts sharing a 40-token prefix (a prefix cache has something to hit)."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, vocab, (40,), generator=g).tolist()
    return [{"prompt_token_ids": prefix + torch.randint(3, vocab, (1 + (i * 7) % 23,), generator=g).tolist()}
            for i in range(n)]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _same(out, want) -> None:
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
    torch.testing.assert_close(torch.tensor(sampled_logprobs(out)), torch.tensor(sampled_logprobs(want)),
                               atol=LOGPROB_ATOL, rtol=0)


# -- the option --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
def test_the_four_names_parse_on_the_command_line_and_in_the_config(name):
    args = build_parser().parse_args(["generate", "--kv-cache-dtype", name])
    assert engine_kwargs(args)["kv_cache_dtype"] == name
    assert EngineConfig(kv_cache_dtype=name).kv_cache_dtype == name


def test_other_names_are_refused_with_the_choices(capsys):
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp16'.*fp8_e5m2"):
        EngineConfig(kv_cache_dtype="fp16")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--kv-cache-dtype", "int8"])
    assert "--kv-cache-dtype" in capsys.readouterr().err


def test_fp8_resolves_to_e4m3_and_auto_to_the_model_dtype():
    assert kv_cache_dtype_for(LlamaForCausalLM, "fp8", torch.bfloat16, "auto") == torch.float8_e4m3fn
    assert kv_cache_dtype_for(LlamaForCausalLM, "fp8_e4m3", torch.float32, "auto") == torch.float8_e4m3fn
    assert kv_cache_dtype_for(LlamaForCausalLM, "fp8_e5m2", torch.float32, "auto") == torch.float8_e5m2
    assert kv_cache_dtype_for(LlamaForCausalLM, "auto", torch.bfloat16, "auto") == torch.bfloat16


def test_xformers_refuses_an_fp8_cache_by_name():
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'.*xformers"):
        kv_cache_dtype_for(LlamaForCausalLM, "fp8", torch.bfloat16, "xformers")


# -- pools and agreement -------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "gemma3_text"])
def test_fp8_pools_and_greedy_agreement_with_the_model_dtype_cache(tiny_ckpt, arch):
    path = tiny_ckpt(arch)
    auto = LLM(path, dtype="float32", max_model_len=256)
    prompts = _prompts(auto.engine.runner.config.vocab_size, 6)
    want = _tokens(auto.generate(prompts, GREEDY, use_tqdm=False))
    for name, fp8 in (("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        llm = LLM(path, dtype="float32", max_model_len=256, kv_cache_dtype=name)
        assert {t.dtype for ts in llm.engine.runner.kv_caches.values() for t in ts} == {fp8}
        got = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
        same = sum(a == b for x, y in zip(got, want) for a, b in zip(x, y)) / sum(map(len, want))
        # e4m3 keeps 3 mantissa bits, e5m2 2: greedy tokens of a random tiny model diverge more with e5m2.
        assert same >= (0.8 if name == "fp8" else 0.5), f"{name}: {same:.2f} of greedy tokens agree"
        llm.engine.kv.check_invariants()


# -- exactness: every cache option gives the FP8 engine's own tokens ---------------------------------
@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def fp8_reference(tiny_ckpt, request):
    """Greedy tokens of an FP8 engine in its simplest configuration: no prefix cache, one request
    at a time; a float32 and a bfloat16 model (whose prefills take the float32-FMA kernel)."""
    path, dtype = tiny_ckpt("llama"), request.param
    llm = LLM(path, dtype=dtype, kv_cache_dtype="fp8", enable_prefix_caching=False, max_num_seqs=1)
    prompts = _prompts(llm.engine.runner.config.vocab_size, 12, seed=1)
    return path, dtype, prompts, _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("chunk", [7, 16, None])
def test_prefix_hits_chunked_prefill_and_batching_keep_the_fp8_tokens(fp8_reference, chunk):
    path, dtype, prompts, ref = fp8_reference
    llm = LLM(path, dtype=dtype, kv_cache_dtype="fp8", max_num_batched_tokens=chunk, max_num_seqs=8)
    for _ in range(2):  # the second pass hits the shared prefix the first cached
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert _tokens(outs) == ref
        llm.engine.kv.check_invariants()
    assert sum(o.num_cached_tokens for o in outs) >= 12 * 32


def test_a_hit_at_every_page_boundary_keeps_the_fp8_tokens_and_logprobs(tiny_ckpt):
    path = tiny_ckpt("gemma3_text")  # a full and a sliding space
    ref = LLM(path, dtype="float32", max_model_len=256, kv_cache_dtype="fp8", enable_prefix_caching=False)
    prompt = _prompt(70, ref.engine.runner.config.vocab_size, seed=5)
    want = run_one(ref, prompt, 8)
    cached = LLM(path, dtype="float32", max_model_len=256, kv_cache_dtype="fp8")
    assert assert_hit_at_every_boundary(cached, want, prompt, 8) == list(range(16, 70, 16))
    cached.engine.kv.check_invariants()


def test_preemption_under_a_tiny_fp8_budget_keeps_the_fp8_tokens(fp8_reference):
    path, dtype, prompts, ref = fp8_reference
    # 12 pages of 16 tokens in FP8 (2 layers x K,V x 2 heads x 16 dims x 1 byte x 16 tokens).
    page_bytes = 2 * 2 * 2 * 16 * 1 * 16
    llm = LLM(path, dtype=dtype, kv_cache_dtype="fp8", max_model_len=128, kv_cache_memory_bytes=12 * page_bytes)
    assert llm.engine.kv.spaces["full"].num_pages <= 13
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(outs) == ref
    assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.kv.check_invariants()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", ["fp8", "fp8_e5m2"])
def test_fused_decode_takes_fp8_steps_with_the_layer_by_layer_logits(tiny_ckpt, dtype, fmt, monkeypatch):
    llm = LLM(tiny_ckpt("qwen3"), dtype=dtype, max_model_len=256, kv_cache_dtype=fmt)
    model, runner = llm.engine.runner.model, llm.engine.runner
    fused = model._fused_decode
    if fused is None:
        pytest.skip(f"no fused decode for {dtype} on this CPU (its linears are not the blocked kernels)")
    calls = []
    original = type(fused).__call__
    monkeypatch.setattr(type(fused), "__call__", lambda self, *a: calls.append(1) or original(self, *a))
    prompts = [_prompt(n, runner.config.vocab_size, seed=n) for n in (9, 40)]

    def logits(on: bool) -> list[torch.Tensor]:
        model._fused_decode = fused if on else None
        runner.captured_logits = {}
        llm.reset_prefix_cache()
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        out, runner.captured_logits = [torch.cat(c) for _, c in sorted(runner.captured_logits.items())], None
        model._fused_decode = fused
        return out

    with_fused = logits(True)
    assert len(calls) == 5, "every decode-only step should run fused over the FP8 caches"
    for a, b in zip(with_fused, logits(False)):
        assert torch.equal(a, b), "the fused decode read or wrote the FP8 cache differently"


def test_ngram_speculation_keeps_the_fp8_tokens(tiny_ckpt):
    """Verified drafts read the FP8 cache through the prefill path: plain FP8 decoding's tokens."""
    path = tiny_ckpt("llama")
    kw = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=24, num_scheduler_steps=1,
              kv_cache_dtype="fp8")
    plain = LLM(path, **kw)
    spec = LLM(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}, **kw)
    vocab = plain.engine.runner.config.vocab_size
    prompts = [{"prompt_token_ids": _prompt(7, vocab, seed=2) * 5}, {"prompt_token_ids": _prompt(37, vocab, seed=9)}]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = _tokens(plain.generate(prompts, params, use_tqdm=False))
    assert _tokens(spec.generate(prompts, params, use_tqdm=False)) == want
    assert spec.engine.stats["spec_draft_tokens"] > 0
    spec.engine.kv.check_invariants()


def test_host_tier_moves_fp8_pages_bit_for_bit(tiny_ckpt):
    path = tiny_ckpt("llama")
    ref = LLM(path, dtype="float32", max_model_len=256, kv_cache_dtype="fp8", enable_prefix_caching=False)
    prompt = _prompt(70, ref.engine.runner.config.vocab_size, seed=11)
    want = run_one(ref, prompt, 8)
    for layout in ("page_first", "layer_first"):
        llm = LLM(path, dtype="float32", max_model_len=256, kv_cache_dtype="fp8", enable_hierarchical_cache=True,
                  hicache_mem_layout=layout)
        host = llm.engine.runner.host_cache
        assert llm.engine.runner.kv_caches["full"][0].dtype == torch.float8_e4m3fn
        assert assert_host_hit_at_every_boundary(llm, want, prompt, 8) == list(range(16, 70, 16))
        assert llm.engine.tier_stats["load_back_bytes"] > 0
        if layout == "layer_first":
            assert host.host["full"][0].dtype == torch.float8_e4m3fn


def test_swap_preemption_keeps_the_fp8_tokens(fp8_reference):
    path, dtype, prompts, ref = fp8_reference
    page_bytes = 2 * 2 * 2 * 16 * 1 * 16
    llm = LLM(path, dtype=dtype, kv_cache_dtype="fp8", max_model_len=128, kv_cache_memory_bytes=12 * page_bytes,
              enable_hierarchical_cache=True, preemption_mode="swap")
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == ref
    assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.kv.check_invariants()


@pytest.mark.slow
def test_two_ranks_match_one_process_with_fp8_caches(tiny_ckpt, shut_down):
    """Each rank quantizes and reads its own KV heads' shard: tensor parallelism keeps the FP8
    engine's tokens (prefix hits and chunked prefill included)."""
    path = tiny_ckpt("llama", num_key_value_heads=4)
    common = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=16, max_num_seqs=8, kv_cache_dtype="fp8")
    one = LLM(path, **common)
    prompts = prompts_with_prefix(one.engine.runner.config.vocab_size, 8)
    want = run_passes(one, prompts)
    two = LLM(path, tensor_parallel_size=2, **common)
    shut_down(two)
    assert two.engine.runner.kv_caches["full"][0].dtype == torch.float8_e4m3fn
    got = run_passes(two, prompts)
    two.shutdown()
    assert want["cached"] > 0 and got["cached"] == want["cached"]
    assert got["tokens"] == want["tokens"]
    assert_logprobs_close(got["prompt_logprobs"], want["prompt_logprobs"])


def _file_llm(path: str, store: str, **kw) -> LLM:
    return LLM(path, dtype="float32", max_model_len=256, enable_hierarchical_cache=True,
               hicache_storage_backend="file", hicache_storage_dir=store,
               hicache_storage_prefetch_policy="wait_complete", **kw)


def test_storage_tier_serves_fp8_pages_to_a_new_engine_bit_for_bit(tiny_ckpt, tmp_path):
    path = tiny_ckpt("llama")
    ref = LLM(path, dtype="float32", max_model_len=256, kv_cache_dtype="fp8", enable_prefix_caching=False)
    prompt = _prompt(100, ref.engine.runner.config.vocab_size, seed=3)
    want = run_one(ref, prompt, 10)
    first = _file_llm(path, str(tmp_path), kv_cache_dtype="fp8")
    _same(run_one(first, prompt, 10), want)
    first.engine.storage.drain()
    second = _file_llm(path, str(tmp_path), kv_cache_dtype="fp8")  # empty device and host tiers
    out = run_one(second, prompt, 10)
    assert out.metrics["prompt_tokens_from_storage"] == 96, out.metrics
    _same(out, want)
    second.engine.kv.check_invariants()


@pytest.mark.parametrize("first_kv,other_kv", [("auto", "fp8"), ("fp8", "fp8_e5m2")])
def test_an_fp8_engine_never_reads_another_kv_dtypes_stored_pages(tiny_ckpt, tmp_path, first_kv, other_kv):
    path = tiny_ckpt("llama")
    prompt = _prompt(100, 300, seed=4)
    first = _file_llm(path, str(tmp_path), kv_cache_dtype=first_kv)
    run_one(first, prompt, 2)
    first.engine.storage.drain()
    other = _file_llm(path, str(tmp_path), kv_cache_dtype=other_kv)
    out = run_one(other, prompt, 2)
    assert out.num_cached_tokens == 0, "pages of another KV dtype were served"
    assert other.engine.storage.stats.corrupt_values == 0, "keys should differ, not only headers"


# -- capacity --------------------------------------------------------------------------------------
def _pages_under_budget(path: str, kv: str, budget: int) -> dict[str, int]:
    llm = LLM(path, dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=budget, kv_cache_dtype=kv)
    device = sum(llm.engine.kv_cache_bytes["device"].values())
    assert device <= budget * 1.01, f"{kv}: {device} bytes allocated for a {budget}-byte budget"
    llm.engine.kv.check_invariants()
    return {name: s.num_pages for name, s in llm.engine.kv.spaces.items()}


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_an_equal_budget_holds_twice_the_pages_of_a_bfloat16_cache(tiny_ckpt, arch):
    """One space (full, or sliding: Mistral's takes the whole budget): exactly twice the pages."""
    auto, fp8 = (_pages_under_budget(tiny_ckpt(arch), kv, 4 << 20) for kv in ("auto", "fp8"))
    assert auto.keys() == fp8.keys() and len(auto) == 1
    assert all(1.95 <= fp8[name] / auto[name] <= 2.05 for name in auto), (auto, fp8)


def test_full_and_sliding_spaces_under_an_equal_budget(tiny_ckpt):
    """Gemma 3: the sliding space is sized for decoding (capped at what the running windows hold),
    so the bytes FP8 saves beyond the cap go to the full space: at least twice its pages."""
    auto, fp8 = (_pages_under_budget(tiny_ckpt("gemma3_text"), kv, 4 << 20) for kv in ("auto", "fp8"))
    assert fp8["full"] >= 2 * auto["full"] and fp8["swa"] >= auto["swa"], (auto, fp8)


def test_twice_the_4k_token_requests_and_twice_the_host_tier_tokens_under_equal_budgets(tiny_ckpt):
    """Capacity as a server sees it: the 4,096-token requests an equal device budget holds at
    once (whole pages each), and the tokens an equal host-tier budget (hicache_size) holds."""
    path = tiny_ckpt("llama", max_position_embeddings=4096)
    fit, host_tokens = {}, {}
    for kv in ("auto", "fp8"):
        llm = LLM(path, dtype="bfloat16", max_model_len=4096, kv_cache_memory_bytes=8 << 20, kv_cache_dtype=kv,
                  enable_hierarchical_cache=True, hicache_size=16 << 20)
        kv_manager = llm.engine.kv
        P = kv_manager.page_size
        fit[kv] = kv_manager.spaces["full"].num_pages // (4096 // P)
        host_tokens[kv] = kv_manager.host_tier.pools["full"].num_pages * P
        kv_manager.check_invariants()
    assert fit["auto"] >= 4, fit
    assert 1.95 <= fit["fp8"] / fit["auto"] <= 2.05, fit
    assert 1.95 <= host_tokens["fp8"] / host_tokens["auto"] <= 2.05, host_tokens

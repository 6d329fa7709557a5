"""DeepSeek-V4 parity with transformers' DeepseekV4ForCausalLM (float32, the golden reference).

Three tiny configs cover the cases the paged hybrid layout can get wrong:
  hca16_w16    HCA ratio 16 (HCA fires every 16 tokens), window 16 < page 128
  hca128_w160  HCA ratio 128 (the real ratio), window 160 > page 128, other layer order
  yarn_w40_p32 HCA ratio 16, window 40 > page 32, YaRN compress rope, top-k 5
Sequences of >= 600 tokens cross many C4/C128 windows, pages and windows; every position's
logits must match to 1e-4 whether the prompt is prefilled in one chunk, in random chunks or
token by token, and generation must be greedy-identical.
"""
from __future__ import annotations

import random

import pytest
import torch

from hybridkv.engine.kv_memory_plan import windowed_space_caps
from hybridkv.engine.sampling_params import SamplingParams
from hybridkv.entrypoints import LLM
from tiny_deepseek_v4 import build_v4_checkpoint, hf_v4_model, single_thread

ATOL = 1e-4

CONFIGS = {
    "hca16_w16": dict(overrides={}, block_size=None),
    "hca128_w160": dict(
        overrides=dict(
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
            sliding_window=160,
            layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                         "heavily_compressed_attention"],
            mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        ),
        block_size=None,
    ),
    "yarn_w40_p32": dict(
        overrides=dict(
            sliding_window=40,
            index_topk=5,
            rope_parameters={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256,
                             "beta_fast": 32, "beta_slow": 1},
        ),
        block_size=32,
    ),
}


@pytest.fixture(autouse=True)
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def v4_ckpt(tmp_path_factory):
    """name -> (checkpoint folder, block_size to pass or None for the model's default)."""
    built: dict[str, tuple[str, int | None]] = {}

    def get(name: str) -> tuple[str, int | None]:
        if name not in built:
            spec = CONFIGS[name]
            path = build_v4_checkpoint(str(tmp_path_factory.mktemp(f"v4_{name}")), **spec["overrides"])
            built[name] = (path, spec["block_size"])
        return built[name]

    return get


def _llm(path: str, block_size: int | None, **kw) -> LLM:
    kw.setdefault("max_model_len", 1024)
    kw.setdefault("max_num_seqs", 8)
    if block_size is not None:
        kw["block_size"] = block_size
    return LLM(path, dtype="float32", **kw)


def _run(llm: LLM, prompts: dict[str, list[int]], max_tokens: int, chunks=None) -> tuple[dict, dict]:
    """Drive the engine step by step; chunks() picks each step's token budget (None: fixed).

    Returns per request the logits of every computed position and the generated tokens.
    """
    eng = llm.engine
    eng.runner.captured_logits = {}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    user_id = {}  # the runner keys captured logits by internal sequence id
    for rid, ids in prompts.items():
        eng.add_request(rid, {"prompt_token_ids": ids}, params)
        (seq_id,) = eng.sequence_ids(rid)
        user_id[seq_id] = rid
    tokens = {}
    while eng.has_unfinished_requests():
        if chunks is not None:
            eng.scheduler.config.max_num_batched_tokens = chunks()
        for out in eng.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    logits = {user_id[sid]: torch.cat(c) for sid, c in eng.runner.captured_logits.items()}
    eng.runner.captured_logits = None
    return logits, tokens


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _reference(path: str, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_v4_model(path)(torch.tensor([ids])).logits[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("mode", ["one_chunk", "random_chunks", "token_by_token"])
def test_logits_match_transformers_at_every_position(v4_ckpt, name, mode):
    path, block_size = v4_ckpt(name)
    chunk = {"one_chunk": None, "random_chunks": None, "token_by_token": 1}[mode]
    llm = _llm(path, block_size, max_num_batched_tokens=chunk)
    prompt = _prompt(620, llm.engine.runner.config.vocab_size, seed=1)
    rng = random.Random(hash(name) % 1000)
    pick = (lambda: rng.choice([1, 2, 3, 5, 8, 31, 64, 100, 127, 130])) if mode == "random_chunks" else None
    logits, tokens = _run(llm, {"r": prompt}, max_tokens=8, chunks=pick)
    full = prompt + tokens["r"]
    ref = _reference(path, full[:-1])
    assert logits["r"].shape == ref.shape
    torch.testing.assert_close(logits["r"], ref, atol=ATOL, rtol=0)
    assert tokens["r"] == ref[len(prompt) - 1 :].argmax(-1).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hca16_w16", "hca128_w160"])
def test_greedy_generation_equals_transformers_generate(v4_ckpt, name):
    path, block_size = v4_ckpt(name)
    llm = _llm(path, block_size)
    vocab = llm.engine.runner.config.vocab_size
    prompts = {f"p{n}": _prompt(n, vocab, seed=n) for n in (610, 129, 40, 5)}
    _, tokens = _run(llm, prompts, max_tokens=16)
    hf = hf_v4_model(path)
    for rid, ids in prompts.items():
        with torch.no_grad():
            gen = hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
        assert tokens[rid] == gen[0, len(ids) :].tolist(), rid


@pytest.mark.slow
@pytest.mark.parametrize("name", ["yarn_w40_p32", "hca128_w160"])
def test_mixed_length_batch_equals_each_sequence_alone(v4_ckpt, name):
    """Decodes and prefill chunks of different sequences share steps (budget 48), yet every
    sequence gets the logits and tokens it gets alone."""
    path, block_size = v4_ckpt(name)
    llm = _llm(path, block_size, max_num_batched_tokens=48)
    vocab = llm.engine.runner.config.vocab_size
    prompts = {f"p{n}": _prompt(n, vocab, seed=n) for n in (605, 203, 45, 3)}
    batch_logits, batch_tokens = _run(llm, prompts, max_tokens=10)
    alone = _llm(path, block_size)
    for rid, ids in prompts.items():
        logits, tokens = _run(alone, {rid: ids}, max_tokens=10)
        assert batch_tokens[rid] == tokens[rid], rid
        torch.testing.assert_close(batch_logits[rid], logits[rid], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_preemption_under_a_tight_budget_keeps_outputs(v4_ckpt):
    """Too little c4/c128/indexer memory for both sequences at once: the engine preempts and
    recomputes, and outputs stay those of the unconstrained run."""
    path, block_size = v4_ckpt("hca16_w16")
    roomy = _llm(path, block_size)
    vocab = roomy.engine.runner.config.vocab_size
    prompts = {"a": _prompt(300, vocab, seed=3), "b": _prompt(290, vocab, seed=4)}
    _, want = _run(roomy, prompts, max_tokens=20)
    # Enough for one 320-token sequence in every whole-history space (3 pages of 128), not for
    # two; the windowed spaces get what the engine sizes them to for 2 sequences.
    kv = roomy.engine.kv
    P = kv.page_size
    caps = windowed_space_caps([s.spec for s in kv.spaces.values()], P, 2, 128, prefix_caching=True)
    tight = sum(s.spec.bytes_per_page(P) * min(4 + 2, caps[n]) if s.spec.windowed else s.spec.bytes_per_page(P) * 4
                for n, s in kv.spaces.items())
    llm = _llm(path, block_size, max_model_len=512, max_num_seqs=2, max_num_batched_tokens=128,
               kv_cache_memory_bytes=tight)
    assert llm.engine.kv.spaces["c4"].num_pages == 4
    _, got = _run(llm, prompts, max_tokens=20)
    assert got == want
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.slow
def test_fused_cpu_indexer_matches_transformers(v4_ckpt, monkeypatch):
    """The fused CPU indexer kernel (cpu_kernels/indexer_topk.cpp) picks the top-k C4 entries of
    prefill blocks (shared slot lists) and of decode rows (page form): logits and tokens must
    be transformers' at every position, with a long and a short prompt in one batch."""
    from hybridkv.attention_backends import hybrid_v4
    from hybridkv.attention_backends.cpu_kernels import kernels_enabled, load_indexer_topk

    if not kernels_enabled():
        pytest.skip("CPU kernels switched off (HYBRIDKV_CPU_KERNELS=0)")
    kernel = load_indexer_topk()
    assert kernel is not None, "the CPU indexer kernel did not build on this machine"
    forms = []

    def spy(q, w, keys, slots, pages, spp, visible, length, k, scale):
        forms.append("pages" if pages.numel() else "slots")
        return kernel(q, w, keys, slots, pages, spp, visible, length, k, scale)

    monkeypatch.setattr(hybrid_v4, "load_indexer_topk", lambda: spy)
    path, block_size = v4_ckpt("yarn_w40_p32")
    llm = _llm(path, block_size)
    vocab = llm.engine.runner.config.vocab_size
    prompts = {"long": _prompt(1000, vocab, seed=5), "short": _prompt(70, vocab, seed=6)}
    logits, tokens = _run(llm, prompts, max_tokens=10)
    assert {"pages", "slots"} <= set(forms), forms
    for rid, ids in prompts.items():
        ref = _reference(path, (ids + tokens[rid])[:-1])
        torch.testing.assert_close(logits[rid], ref, atol=ATOL, rtol=0)
        assert tokens[rid] == ref[len(ids) - 1 :].argmax(-1).tolist(), rid


@pytest.mark.slow
@pytest.mark.parametrize("run_entries", [1, 16])
def test_decode_reading_indexer_keys_in_place_matches_transformers(v4_ckpt, monkeypatch, run_entries):
    """Decode rows whose indexer pages are runs of consecutive pages score the key cache in
    place (views, no copy); the threshold that chooses them is lowered so that every decode
    row (1) or only the longer ones (16) take that path at this length. Logits and tokens must
    still be transformers' at every position."""
    from hybridkv.attention_backends import hybrid_v4

    monkeypatch.setattr(hybrid_v4, "IN_PLACE_RUN_ENTRIES", run_entries)
    monkeypatch.setattr(hybrid_v4, "load_indexer_topk", lambda: None)  # the torch indexer (the kernel's fallback)
    calls = []
    real = hybrid_v4._per_query_scores_chunked

    def spy(q, w, keys, scale, out=None):
        calls.append(out is not None)  # the in-place path writes straight into the row's scores
        return real(q, w, keys, scale, out=out)

    monkeypatch.setattr(hybrid_v4, "_per_query_scores_chunked", spy)
    path, block_size = v4_ckpt("yarn_w40_p32")
    llm = _llm(path, block_size)
    vocab = llm.engine.runner.config.vocab_size
    prompts = {"long": _prompt(600, vocab, seed=3), "short": _prompt(90, vocab, seed=4)}
    logits, tokens = _run(llm, prompts, max_tokens=12)
    assert any(calls), "no decode row was scored in place"
    for rid, ids in prompts.items():
        ref = _reference(path, (ids + tokens[rid])[:-1])
        torch.testing.assert_close(logits[rid], ref, atol=ATOL, rtol=0)
        assert tokens[rid] == ref[len(ids) - 1 :].argmax(-1).tolist(), rid

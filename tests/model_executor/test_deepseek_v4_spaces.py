"""DeepSeek-V4's block spaces: what the model declares, how the engine sizes and picks
pages, how much each space holds for a long sequence, and the user-facing entry points."""
from __future__ import annotations

import math

import pytest
import torch

from hybridkv.block_manager.space_spec import NULL_PAGE
from hybridkv.engine.sampling_params import SamplingParams
from hybridkv.entrypoints import LLM
from tiny_deepseek_v4 import build_v4_checkpoint, single_thread


@pytest.fixture(autouse=True)
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Tiny V4 (HCA ratio 16, window 16) with room for 8k positions."""
    return build_v4_checkpoint(str(tmp_path_factory.mktemp("v4_spaces")), max_position_embeddings=8192)


def test_model_declares_its_spaces_and_engine_picks_page_128(ckpt):
    llm = LLM(ckpt, dtype="float32", max_model_len=512, max_num_seqs=2)
    kv = llm.engine.kv
    assert kv.page_size == 128  # the default 16 is not a page for V4
    specs = kv.specs
    assert list(specs) == ["swa", "c4", "c128", "indexer", "state_c4", "state_c128"]
    D, cI, f32 = 32, 16, 4  # head_dim, index_head_dim of the tiny config; float32
    assert (specs["swa"].tokens_per_slot, specs["swa"].window, specs["swa"].bytes_per_slot) == (1, 16, 4 * D * f32)
    assert (specs["c4"].tokens_per_slot, specs["c4"].window, specs["c4"].bytes_per_slot) == (4, None, 2 * D * f32)
    assert (specs["c128"].tokens_per_slot, specs["c128"].bytes_per_slot) == (16, 1 * D * f32)
    assert (specs["indexer"].tokens_per_slot, specs["indexer"].bytes_per_slot) == (4, 2 * cI * f32)
    # compressor state: raw (C, Z) rows, float32, a ring of one window's rows per page (not 128):
    # CSA 2x2D (+ indexer 2x2cI) per layer over 2x4 rows, HCA 2D over 16 rows.
    assert (specs["state_c4"].window, specs["state_c4"].ring) == (8, 8)
    assert specs["state_c4"].bytes_per_slot == f32 * 2 * (4 * D + 4 * cI)
    assert specs["state_c4"].bytes_per_page(128) == 8 * specs["state_c4"].bytes_per_slot
    assert (specs["state_c128"].window, specs["state_c128"].ring) == (16, 16)
    assert specs["state_c128"].bytes_per_slot == f32 * 2 * D


def test_page_size_must_be_a_multiple_of_every_ratio(ckpt):
    with pytest.raises(ValueError, match=r"block_size 40 is not a multiple of this model's compression ratios \[1, 4, 16\]"):
        LLM(ckpt, dtype="float32", max_model_len=512, max_num_seqs=2, block_size=40)
    llm = LLM(ckpt, dtype="float32", max_model_len=512, max_num_seqs=2, block_size=32)  # an explicit page size is kept
    assert llm.engine.kv.page_size == 32
    # An explicit 16 (a multiple of [1, 4, 16]) is kept too: it is no longer mistaken for the default.
    llm = LLM(ckpt, dtype="float32", max_model_len=512, max_num_seqs=2, block_size=16)
    assert llm.engine.kv.page_size == 16
    out = llm.generate({"prompt_token_ids": list(range(3, 60))},
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_explicit_block_size_the_model_cannot_use_names_the_valid_sizes(tmp_path):
    """HCA ratio 128 (the real one): an explicit block_size=16 is an error naming the page sizes
    V4 can use, never silently replaced; block_size=None takes V4's default, 128."""
    path = build_v4_checkpoint(
        str(tmp_path / "v4_hca128"),
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        sliding_window=160,
    )
    with pytest.raises(ValueError, match=r"block_size 16 .* use a multiple of 128 \(128, 256, 384, \.\.\.; "
                                         r"this model's default is 128\)"):
        LLM(path, dtype="float32", max_model_len=512, max_num_seqs=2, block_size=16)
    assert LLM(path, dtype="float32", max_model_len=512, max_num_seqs=2, block_size=None).engine.kv.page_size == 128
    assert LLM(path, dtype="float32", max_model_len=512, max_num_seqs=2, block_size=256).engine.kv.page_size == 256


def test_memory_is_split_by_bytes_per_token_of_context(ckpt):
    budget = 64 << 20
    llm = LLM(ckpt, dtype="float32", max_model_len=2048, max_num_seqs=4, max_num_batched_tokens=256,
              kv_cache_memory_bytes=budget)
    kv = llm.engine.kv
    P = kv.page_size
    pages = {n: s.num_pages for n, s in kv.spaces.items()}
    # Whole-history spaces hold the same number of pages (each page = P tokens of history) ...
    assert pages["c4"] == pages["c128"] == pages["indexer"] > 100
    # ... windowed ones (windows of 16, 8 and 16 tokens, P=128) one sequence computing a
    # 256-token prefill chunk with its window (up to 271 tokens: 3 pages, 4 where the window
    # starts inside a page) while the 3 others decode (2 pages each: a window can straddle a
    # page boundary).
    for name in ("swa", "state_c4", "state_c128"):
        assert kv.specs[name].window <= 16
        assert pages[name] == 4 + 3 * 2
    used = sum(s.num_pages * s.spec.bytes_per_page(P) for s in kv.spaces.values())
    assert used <= budget
    whole_page = sum(kv.specs[n].bytes_per_page(P) for n in ("c4", "c128", "indexer"))
    assert budget - used < whole_page  # the rest of the budget went to history


def test_capacity_error_names_the_space(ckpt):
    """Room for the windows but only 8 pages of history: the error names the history spaces."""
    kv = LLM(ckpt, dtype="float32", max_model_len=512, max_num_seqs=1).engine.kv
    bpp = {n: s.bytes_per_page(128) for n, s in kv.specs.items()}
    # One sequence computing 128-token chunks with a window of <= 16 tokens holds 3 windowed pages.
    budget = 3 * (bpp["swa"] + bpp["state_c4"] + bpp["state_c128"]) + 8 * (bpp["c4"] + bpp["c128"] + bpp["indexer"])
    with pytest.raises(ValueError) as err:
        LLM(ckpt, dtype="float32", max_model_len=2048, max_num_seqs=1, max_num_batched_tokens=128,
            kv_cache_memory_bytes=budget)
    msg = str(err.value)
    for name in ("c4", "c128", "indexer"):
        assert f"{name} (needs 16 pages, has 8)" in msg
    assert "swa (" not in msg and "state_c4 (" not in msg and "state_c128 (" not in msg


@pytest.mark.slow
def test_a_4k_sequence_holds_one_window_of_swa_and_exact_compressed_pages(ckpt):
    """After every step of a 4k-token prompt + decode: SWA <= ceil(window/page)+1 pages,
    state likewise for its window, c4/c128/indexer exactly ceil(entries/slots-per-page)."""
    llm = LLM(ckpt, dtype="float32", max_model_len=8192, max_num_seqs=2, max_num_batched_tokens=512)
    eng, kv = llm.engine, llm.engine.kv
    P = kv.page_size
    prompt = torch.randint(3, 300, (4000,), generator=torch.Generator().manual_seed(0)).tolist()
    eng.add_request("long", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=140, ignore_eos=True))
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
        req = eng.scheduler.running[0] if eng.scheduler.running else None
        if req is None:
            break
        L = req.num_computed_tokens
        for name, spec in kv.specs.items():
            held = [p for p in kv.page_table(req.request_id, name) if p != NULL_PAGE]
            assert len(held) == kv.spaces[name].num_in_use
            if spec.window is not None:
                assert len(held) <= math.ceil(spec.window / P) + 1, (name, L, len(held))
            else:
                entries = L // spec.tokens_per_slot
                assert len(held) == math.ceil(entries / (P // spec.tokens_per_slot)), (name, L)
    assert steps > 130
    for space in kv.spaces.values():
        # everything released at the end (prefix caching keeps recorded pages as cached, not in use)
        assert space.num_in_use == 0 and space.num_free + space.num_cached == space.num_pages


def test_llm_with_default_arguments_generates(ckpt):
    llm = LLM(ckpt)
    out = llm.generate(["the quick brown fox"], SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) >= 1
    assert llm.engine.runner.dtype == torch.float32


def test_cli_generate(ckpt, capsys):
    from hybridkv.entrypoints.cli import main

    rc = main(["generate", "--model", ckpt, "--max-tokens", "4", "--max-model-len", "512", "--max-num-seqs", "2",
               "a lighthouse keeper"])
    assert rc == 0
    assert "### a lighthouse keeper" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_windowed_spaces_sized_for_decoding_hold_a_full_batch_without_preemption(tmp_path, prefix_caching):
    """The released shape (window 128, HCA 128, page 128): windowed spaces are sized for one
    prefill chunk while the other sequences decode. HCA's state window moves in aligned
    128-token blocks, so a decoding sequence holds 1 state_c128 page, also with prefix caching
    (no hit reads HCA state at a page end, so the index never records -- and never pins -- it).
    Four 300-token prompts prefilled in 128-token chunks beside the others' decodes never run
    short (no preemption) and give the same tokens as one sequence at a time."""
    path = build_v4_checkpoint(
        str(tmp_path / "v4_w128"), sliding_window=128,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    )
    g = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(3, 300, (300 + 7 * i,), generator=g).tolist()} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    one = LLM(path, dtype="float32", max_model_len=512, max_num_seqs=1, enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    llm = LLM(path, dtype="float32", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=128,
              enable_prefix_caching=prefix_caching)
    kv = llm.engine.kv
    # 3 decoding sequences + one 128-token chunk (with its window: 2 pages of state_c128, 3 of swa)
    assert kv.spaces["state_c128"].num_pages == 3 * 1 + 2
    assert kv.spaces["swa"].num_pages == 3 * 2 + 3
    if prefix_caching:
        assert kv.index.unread == {"state_c128"}
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.engine.scheduler.num_preemptions == 0, "a batch the windowed spaces were sized for was preempted"
    assert got == want
    if prefix_caching:
        assert all(nd.shadows["state_c128"] is None for nd in kv.index.nodes()), "the index recorded HCA state"
        kv.check_invariants()

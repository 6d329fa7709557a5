"""The model runner's contracts: block tables in, the null page never written (debug check),
attention backends by name, executor-side batch types (model_executor never imports engine)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from hybridkv.attention_backends.registry import available_attention_backends, get_attention_backend
from hybridkv.attention_backends.torch_native import TorchNativeAttention
from hybridkv.block_manager.space_spec import NULL_PAGE
from hybridkv.engine.sampling_params import SamplingParams
from hybridkv.entrypoints import LLM

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture
def llm(tiny_ckpt):
    return LLM(tiny_ckpt("llama"), dtype="float32", max_model_len=256, block_size=16, max_num_seqs=4)


def test_a_write_into_the_null_page_is_caught_naming_the_space(llm):
    eng, kv = llm.engine, llm.engine.kv
    eng.runner.debug_checks = True
    eng.add_request("r", {"prompt_token_ids": _prompt(20, eng.runner.config.vocab_size)}, GREEDY)
    eng.step()  # prefill 20 tokens: pages 0 and 1; the first decode writes position 20 (page 1)
    (req,) = eng.scheduler.running
    table = kv.block_tables["full"]
    row = kv.row_of(req.request_id)
    real = int(table.tensor[row, 1])
    assert real != NULL_PAGE
    table.set(row, 1, NULL_PAGE)  # corrupt: as if page 1 had been released one page too early
    try:
        with pytest.raises(AssertionError, match="null page of space 'full'"):
            eng.step()
    finally:
        table.set(row, 1, real)
        eng.abort_request("r")


def test_debug_checks_pass_on_a_normal_run_and_follow_the_environment(tiny_ckpt, monkeypatch):
    monkeypatch.setenv("HYBRIDKV_DEBUG_CHECKS", "1")
    llm = LLM(tiny_ckpt("mistral"), dtype="float32", max_model_len=256, block_size=8, max_num_batched_tokens=32)
    assert llm.engine.runner.debug_checks
    vocab = llm.engine.runner.config.vocab_size
    # sliding window 24 with page 8: pages are released while the requests decode past it
    outs = llm.generate([{"prompt_token_ids": _prompt(n, vocab, n)} for n in (5, 40, 70)],
                        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [30, 30, 30]


def test_step_metadata_comes_from_the_block_tables(llm):
    eng, kv = llm.engine, llm.engine.kv
    vocab = eng.runner.config.vocab_size
    for i, n in enumerate((3, 17, 40)):
        eng.add_request(f"r{i}", {"prompt_token_ids": _prompt(n, vocab, i)}, GREEDY)
    eng.step()
    batch = eng.scheduler.schedule().model_input()
    seqs = eng.runner.step_sequences(batch.sequences, kv.plan([s.request_id for s in batch.sequences]))
    for s, row in zip(batch.sequences, seqs.block_tables["full"]):
        pages = kv.page_table(s.request_id, "full")
        assert row[: len(pages)].tolist() == pages
        assert (row[len(pages) :] == NULL_PAGE).all()
    for i in range(3):
        eng.abort_request(f"r{i}")


def test_kv_pool_has_a_zeroed_null_page_per_space(llm):
    kv, runner = llm.engine.kv, llm.engine.runner
    ((cache,),) = runner.kv_caches.values()  # one space, one [layers, 2, Hkv, slots, D] tensor
    assert cache.shape[3] == kv.spaces["full"].num_physical_pages * kv.page_size
    assert (cache[:, :, :, : kv.page_size] == 0).all()


def test_attention_backends_come_from_the_registry_by_name(tiny_ckpt):
    assert "torch_native" in available_attention_backends()
    assert isinstance(get_attention_backend("torch_native"), TorchNativeAttention)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'.*torch_native"):
        get_attention_backend("flash")
    with pytest.raises(ValueError, match="torch_native"):
        LLM(tiny_ckpt("llama"), dtype="float32", max_model_len=64, attention_backend="flash")
    llm = LLM(tiny_ckpt("llama"), dtype="float32", max_model_len=64, attention_backend="torch_native")
    assert llm.engine.runner.backend.name == "torch_native"


def test_model_executor_never_imports_engine():
    """Imports point one way (docs/architecture.md, "Package layout"): no module under model_executor/ or
    attention_backends/ imports engine or entrypoints (checked on the source: `import hybridkv`
    itself loads the public API, so sys.modules cannot tell)."""
    import hybridkv.attention_backends
    import hybridkv.model_executor

    bad = []
    for pkg in (hybridkv.model_executor, hybridkv.attention_backends):
        for path in Path(pkg.__path__[0]).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                bad += [f"{path.name}: {n}" for n in names
                        if n.split(".")[:2] in (["hybridkv", "engine"], ["hybridkv", "entrypoints"])]
    assert not bad, bad


def test_weights_are_held_once_where_the_packed_copy_serves_every_input(tiny_ckpt, monkeypatch):
    """Where the column-block copy serves every input (float32 on an AVX-512 CPU other than
    Intel's), the decoder layers' linear parameters are released once packed (meta tensors of the
    same shape), and the outputs are those of a run that keeps them (packing off: the same
    tokens, logprobs to float32 rounding, as the two linears round differently)."""
    from torch import nn

    from hybridkv.model_executor.layers import packed_copy_serves_every_input

    path = tiny_ckpt("llama")
    prompts = [{"prompt_token_ids": _prompt(n, 300, seed=n)} for n in (7, 40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    packed = LLM(path, dtype="float32", max_model_len=256, max_num_seqs=4)
    model = packed.engine.runner.model
    linears = [m for m in model.layers.modules() if isinstance(m, nn.Linear)]
    monkeypatch.setenv("HYBRIDKV_PACK_WEIGHTS", "0")
    plain = LLM(path, dtype="float32", max_model_len=256, max_num_seqs=4)
    plain_linears = [m for m in plain.engine.runner.model.layers.modules() if isinstance(m, nn.Linear)]
    if not packed_copy_serves_every_input(plain_linears[0].weight):
        assert not any(m.weight.is_meta for m in linears), "a parameter some input still reads was released"
        pytest.skip("on this CPU the packed copy does not serve every input: parameters are kept")
    assert all(m.weight.is_meta for m in linears), "a packed parameter was kept beside its copy"
    assert [m.weight.shape for m in linears] == [m.weight.shape for m in plain_linears], "shapes were lost"
    assert not model.embed_tokens.weight.is_meta, "the embedding is read by lookup and must stay"
    from hybridkv.model_executor.quantization.summary import weight_inventory

    inventory = weight_inventory(model)  # what the startup log reports
    released = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    assert inventory.packed_bytes >= released, "the packed copies are missing from the weight memory"
    assert inventory.total_bytes < released, "released parameters are still counted as held"
    a, b = packed.generate(prompts, params), plain.generate(prompts, params)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for got, want in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert got.keys() == want.keys()
            assert all(abs(got[t].logprob - want[t].logprob) < 1e-4 for t in got)

"""Invariant: a request's tokens and logprobs do not depend on what the engine runs beside it,
on what it has cached, or on whether it was preempted. The same prompts give the same bits alone,
batched together (one step of more than 512 prompt rows), after a hit on their shared prefix or
on all of the prompt but its last token, in short prefill chunks beside decoding streams,
decoding beside other streams, and after recompute preemptions; greedy and seeded sampling alike.

It holds where every linear of the model runs one kernel for every row count (the kernels are
row-independent: tests/model_executor/test_blocked_linear.py) and attention runs the C++ kernels:
float32 on AVX-512 CPUs other than Intel's (the blocked kernel), bfloat16 on CPUs with
AVX512-BF16 and no AMX (the vdpbf16ps kernel). Elsewhere a step of many rows takes another kernel
(MKL, oneDNN, AMX tiles) whose bits are not verified to match, and the test says so and skips.
The attention rules it relies on: a prompt's rows go through the prefill kernel (also a one-token
last chunk), generated positions through the decode kernel (also when a preempted request
recomputes them), and the prefill kernels cut keys at absolute positions.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridkv.attention_backends import metadata
from hybridkv.entrypoints.llm import LLM
from hybridkv.model_executor.layers import BlockedLinearWeight, PackedLinearWeight, packed_forward
from hybridkv.model_executor.sampling_params import SamplingParams

# The demo model's widths (head size 64, so bfloat16 prefill attention runs its C++ kernel, not
# SDPA's flash attention, whose tiles follow the chunk; gate/up a multiple of 96, so the fused SiLU
# path runs; K 576, where oneDNN's bf16 linear past 512 rows changed a row's bits and a tiny width
# did not show it) in two layers.
SHAPE = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536)
CASES = {"llama": ("llama", SHAPE), "mistral (every layer windowed)": ("mistral", {**SHAPE, "sliding_window": 40})}
PREFIX, SUFFIXES = 70, (60, 75, 83, 96, 104, 121)  # six prompts, 1,019 rows in one step


def _one_kernel_for_every_row_count(llm: LLM) -> bool:
    model = llm.engine.runner.model
    linears = [packed_forward(m) for m in model.modules() if isinstance(m, nn.Linear)]
    linears.append(model._packed_logits)
    for linear in linears:
        if isinstance(linear, BlockedLinearWeight) and linear.max_rows is None:
            continue
        if isinstance(linear, PackedLinearWeight) and linear.blocked is not None and linear.blocked_rows is None:
            continue
        return False
    return True


def _params() -> list[SamplingParams]:
    """Greedy and seeded sampling, each reporting its top logprobs."""
    return [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3) if i % 2 == 0 else
            SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=24, ignore_eos=True, logprobs=3)
            for i in range(len(SUFFIXES))]


def _outputs(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], reset: bool = True,
             cached: list[int] | None = None):
    """Each request's (tokens, logprobs), with its prompt tokens served by the prefix cache
    appended to `cached`."""
    if reset:
        llm.reset_prefix_cache()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if cached is not None:
        cached.extend(o.num_cached_tokens for o in outs)
    return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_outputs_do_not_depend_on_batch_prefix_hits_or_chunking(tiny_ckpt, monkeypatch, case, dtype):
    arch, overrides = CASES[case]
    path = tiny_ckpt(arch, **overrides)
    llm = LLM(path, dtype=dtype, max_model_len=512, max_num_batched_tokens=2048)
    if not _one_kernel_for_every_row_count(llm):
        pytest.skip(f"{dtype} on this CPU runs some linear on another kernel past a row count: its bits "
                    "are not verified to match across batch sizes")
    g = torch.Generator().manual_seed(3)
    vocab = llm.engine.runner.config.vocab_size
    prefix = torch.randint(3, vocab, (PREFIX,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, vocab, (n,), generator=g).tolist() for n in SUFFIXES]
    params = _params()

    alone = [_outputs(llm, [p], [sp])[0] for p, sp in zip(prompts, params)]
    model, rows = llm.engine.runner.model, []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda ids, *a, **k: rows.append(ids.shape[0]) or forward(ids, *a, **k))
    batched = _outputs(llm, prompts, params)
    assert max(rows) > 512, "no step of the batch ran more than 512 rows (where bf16 linears once changed kernel)"
    # The first prompt alone caches the shared prefix; the others hit it and compute their own
    # suffixes after it (the prefill kernel over cached context).
    cached = []
    warm = _outputs(llm, prompts[:1], params[:1]) + _outputs(llm, prompts[1:], params[1:], reset=False, cached=cached)
    assert min(cached) >= PREFIX // 2, f"the later prompts did not hit the shared prefix: {cached} tokens cached"
    # Every prompt cached to its last whole page; the 145-token one (70 + 75) to all but its last
    # token, which is then computed as a one-token chunk.
    again = _outputs(llm, prompts, params, reset=False, cached=cached)
    assert any(len(p) - n == 1 for n, p in zip(cached[-len(prompts):], prompts)), (
        f"no prompt was cached to all but its last token: {cached[-len(prompts):]} of {[len(p) for p in prompts]}")
    chunked_llm = LLM(path, dtype=dtype, max_model_len=512, max_num_batched_tokens=48)
    chunked = _outputs(chunked_llm, prompts, params)

    for name, got in (("batched", batched), ("prefix hits", warm), ("cached to the last page", again),
                      ("48-token chunks", chunked)):
        for i, (want, have) in enumerate(zip(alone, got)):
            assert have[0] == want[0], f"{name}: request {i}'s tokens differ from the request run alone"
            assert have[1] == want[1], f"{name}: request {i}'s logprobs differ from the request run alone"


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_preemption_leaves_a_requests_outputs_as_they_were(tiny_ckpt, monkeypatch, case, dtype, caching):
    """A request recomputed after a preemption runs its generated tokens through the kernel that
    first computed them (the decodes' paged kernel, not the prefill kernel): its tokens and
    logprobs are the bits of an engine with room for everyone."""
    arch, overrides = CASES[case]
    path = tiny_ckpt(arch, **overrides)
    roomy = LLM(path, dtype=dtype, max_model_len=512)
    if not _one_kernel_for_every_row_count(roomy):
        pytest.skip(f"{dtype} on this CPU runs some linear on another kernel past a row count")
    g = torch.Generator().manual_seed(4)
    vocab = roomy.engine.runner.config.vocab_size
    # Short prompts, long outputs: requests are preempted while they decode, and their resume
    # recomputes generated tokens.
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (20, 30, 40, 50)]
    params = [SamplingParams(temperature=0, max_tokens=150, ignore_eos=True, logprobs=2) if i % 2 == 0 else
              SamplingParams(temperature=0.9, seed=7 + i, max_tokens=150, ignore_eos=True, logprobs=2)
              for i in range(len(prompts))]
    want = _outputs(roomy, prompts, params)
    kv = roomy.engine.kv
    page_bytes = sum(spec.bytes_per_slot for spec in kv.specs.values()) * kv.page_size
    # Room for one request of max_model_len and a little more (a windowed model keeps only its
    # window and a 32-token chunk: 6 pages): the others must preempt each other as they decode.
    pages = 8 if overrides.get("sliding_window") else 512 // kv.page_size + 4
    tight = LLM(path, dtype=dtype, max_model_len=512, max_num_batched_tokens=32, enable_prefix_caching=caching,
                kv_cache_memory_bytes=pages * page_bytes)
    regenerated = []
    build = metadata.regenerated_rows
    monkeypatch.setattr(metadata, "regenerated_rows", lambda seqs: regenerated.append(build(seqs)) or regenerated[-1])
    got = _outputs(tight, prompts, params)
    assert any(r is not None for r in regenerated), (
        f"no generated token was recomputed ({tight.engine.scheduler.num_preemptions} preemptions): "
        "the test would compare two runs that never left the decode kernel")
    for i, (w, h) in enumerate(zip(want, got)):
        assert h[0] == w[0], f"request {i}'s tokens changed after a preemption"
        assert h[1] == w[1], f"request {i}'s logprobs changed after a preemption"

"""Shared by the tensor-parallel engine tests: prompts with a shared prefix, a KV budget that gives
one process and a tp-way group the same pages, two greedy passes plus prompt logprobs, and the
fixture that shuts engines down and checks that no worker process is left."""
from __future__ import annotations

import multiprocessing

import pytest
import torch
import torch.distributed as dist

from hybridkv.entrypoints import LLM, SamplingParams
from hybridkv.model_executor.model_runner import model_skeleton
from hybridkv.model_executor.parallel.state import TensorParallel

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPT_LOGPROBS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)


def prompts_with_prefix(vocab: int, n: int, shared: int = 40, seed: int = 0) -> list[dict]:
    """n prompts sharing a `shared`-token prefix (so prefix caching has something to hit)."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, vocab, (shared,), generator=g).tolist()
    return [{"prompt_token_ids": prefix + torch.randint(3, vocab, (1 + (i * 7) % 23,), generator=g).tolist()}
            for i in range(n)]


def kv_bytes(path: str, tp: int, pages: float, page_size: int = 16) -> int:
    """The KV budget of `pages` pages of every space for one rank of a tp-way model: both engines
    then get the same pages, so they schedule (chunk, hit, preempt) the same way. A fraction of a
    page tunes how the budget is shared between windowed and growing spaces (DeepSeek-V4)."""
    parallel = TensorParallel(0, tp) if tp > 1 else None
    specs = model_skeleton(path, "float32", 128, "cpu", parallel=parallel).specs
    return int(pages * page_size * sum(s.bytes_per_slot for s in specs))


def no_workers_left() -> bool:
    return not multiprocessing.active_children() and not dist.is_initialized()


@pytest.fixture
def shut_down():
    """LLMs registered here are shut down when the test ends, passed or failed."""
    llms: list[LLM] = []
    yield llms.append
    for llm in llms:
        llm.shutdown()
    assert no_workers_left(), f"worker processes left behind: {multiprocessing.active_children()}"


def run_passes(llm: LLM, prompts: list[dict]) -> dict:
    """Greedy tokens of two passes (the second one hits the first one's prefix pages), and the
    prompt logprobs of a third."""
    passes = [llm.generate(prompts, GREEDY, use_tqdm=False) for _ in range(2)]
    logprobs = llm.generate(prompts[:3], PROMPT_LOGPROBS, use_tqdm=False)
    return {
        "tokens": [[o.outputs[0].token_ids for o in outs] for outs in passes],
        "cached": sum(o.num_cached_tokens for o in passes[1]),
        "preemptions": llm.engine.scheduler.num_preemptions,
        "prompt_logprobs": [o.prompt_logprobs for o in logprobs],
        "pages": {n: s.num_pages for n, s in llm.engine.kv.spaces.items()},
    }


def assert_logprobs_close(a: list, b: list, tol: float = 1e-3) -> None:
    for pa, pb in zip(a, b):
        assert len(pa) == len(pb)
        for ea, eb in zip(pa, pb):
            if ea is None:
                assert eb is None
                continue
            assert set(ea) == set(eb)
            for tid in ea:
                assert abs(ea[tid].logprob - eb[tid].logprob) < tol, (tid, ea[tid].logprob, eb[tid].logprob)

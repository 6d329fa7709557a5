"""The sampler's structured-outputs mask: forbidden tokens are never sampled in any mode, and
logprobs describe the masked distribution (as in vLLM, where the bitmask is applied first)."""
from __future__ import annotations

import math

import numpy as np
import torch

from hybridkv.model_executor.sampler import Sampler, SamplingBatch
from hybridkv.model_executor.sampling_params import SamplingParams
from hybridkv.model_executor.structured_outputs import StructuredOutputsParams
from hybridkv.model_executor.token_bitmask import apply_token_bitmask, token_bias

V = 100
CONSTRAINT = StructuredOutputsParams(regex="a")


def _bits(allowed_rows: list[list[int]], vocab: int = V) -> torch.Tensor:
    bits = np.zeros((len(allowed_rows), (vocab + 31) // 32), dtype=np.int64)
    for r, allowed in enumerate(allowed_rows):
        for t in allowed:
            bits[r, t // 32] |= 1 << (t % 32)
    return torch.from_numpy(bits.astype(np.uint32).view(np.int32))


def test_token_bias_is_zero_exactly_at_allowed_tokens():
    allowed = [[0, 31, 32, 63, 64, 99], [5]]
    bias = token_bias(_bits(allowed), V)
    for r, ids in enumerate(allowed):
        assert set(torch.nonzero(bias[r] == 0).flatten().tolist()) == set(ids)
        assert torch.isinf(bias[r]).sum() == V - len(ids)


def test_apply_leaves_unmasked_rows_and_the_input_untouched():
    logits = torch.randn(3, V)
    before = logits.clone()
    out = apply_token_bitmask(logits, _bits([[7, 8]]), [1])
    assert torch.equal(logits, before)
    assert torch.equal(out[0], before[0]) and torch.equal(out[2], before[2])
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [7, 8]


def _batch(params, bits, rows):
    return SamplingBatch(params=params, generators=[None] * len(params), prompt_token_ids=[[1]] * len(params),
                         output_token_ids=[[]] * len(params), token_bitmask=bits, bitmask_rows=rows)


def test_every_sampling_mode_samples_only_allowed_tokens():
    torch.manual_seed(0)
    sampler = Sampler(torch.Generator().manual_seed(0))
    allowed = [3, 40, 77]
    modes = [dict(temperature=0), dict(temperature=1.0), dict(temperature=0.7, top_p=0.5),
             dict(temperature=1.0, top_k=2), dict(temperature=1.0, min_p=0.2), dict(temperature=0, logprobs=2),
             dict(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5)]
    for mode in modes:
        params = [SamplingParams(structured_outputs=CONSTRAINT, **mode), SamplingParams(temperature=0)]
        for _ in range(20):
            logits = torch.randn(2, V) * 5
            res = sampler(logits, _batch(params, _bits([allowed]), [0]))
            assert res.token_ids[0] in allowed, mode
            assert res.token_ids[1] == int(logits[1].argmax()), "the unconstrained row is untouched"


def test_logprobs_describe_the_masked_distribution():
    sampler = Sampler(torch.Generator().manual_seed(0))
    logits = torch.randn(1, V)
    allowed = [10, 20]
    res = sampler(logits, _batch([SamplingParams(temperature=0, logprobs=5, structured_outputs=CONSTRAINT)],
                                 _bits([allowed]), [0]))
    finite = [(t, lp) for t, lp, _ in res.top_logprobs[0] if math.isfinite(lp)]
    assert sorted(t for t, _ in finite) == allowed
    assert math.isclose(sum(math.exp(lp) for _, lp in finite), 1.0, rel_tol=1e-5)
    assert res.token_ids[0] == max(allowed, key=lambda t: logits[0, t])

"""StepCost (model_executor/step_cost.py): closed-form chunk prices equal the per-position sums
they stand for, and max_chunk is the largest chunk within a FLOP budget."""
from __future__ import annotations

import pytest

from hybridkv.model_executor.step_cost import AttentionCost, StepCost, dense_step_cost


def _brute_keys(a: AttentionCost, start: int, end: int) -> float:
    total = 0.0
    for p in range(start, end):
        keys = p + 1
        total += min(keys, a.window) if a.window is not None else keys / a.stride
    return total


@pytest.mark.parametrize("a", [AttentionCost(1.0), AttentionCost(1.0, window=7), AttentionCost(1.0, window=1),
                               AttentionCost(1.0, stride=4), AttentionCost(1.0, stride=128)])
def test_keys_summed_equals_the_sum_over_positions(a):
    for start in range(0, 20):
        for end in range(start, 30):
            assert a.keys_summed(start, end) == pytest.approx(_brute_keys(a, start, end)), (start, end)


def test_chunk_flops_prices_tokens_and_every_attention_group():
    cost = StepCost(10.0, (AttentionCost(2.0), AttentionCost(3.0, window=5), AttentionCost(4.0, stride=4)))
    for start, n in [(0, 1), (0, 9), (3, 4), (100, 17)]:
        want = n * 10.0 + sum(g.flops_per_key * _brute_keys(g, start, start + n) for g in cost.attention)
        assert cost.chunk_flops(start, n) == pytest.approx(want)


def test_a_chunk_late_in_a_long_context_costs_more_than_the_same_chunk_early():
    cost = StepCost(1e6, (AttentionCost(1e3),))
    assert cost.chunk_flops(7000, 64) > 5 * cost.chunk_flops(0, 64)


def test_max_chunk_is_the_largest_chunk_within_the_budget():
    cost = StepCost(100.0, (AttentionCost(1.0),))
    for start in (0, 50, 1000):
        for budget in (50.0, 100.0, 5_000.0, 1e5):
            n = cost.max_chunk(start, 500, budget)
            if n:
                assert cost.chunk_flops(start, n) <= budget
            if n < 500:
                assert cost.chunk_flops(start, n + 1) > budget, (start, budget, n)
    assert cost.max_chunk(0, 0, 1e9) == 0


def test_decode_flops_never_under_prices_the_decodes_it_stands_for():
    cost = StepCost(5.0, (AttentionCost(2.0), AttentionCost(3.0, window=8), AttentionCost(1.0, stride=4)))
    contexts = [3, 40, 100]
    exact = sum(cost.chunk_flops(c, 1) for c in contexts)
    assert cost.decode_flops(len(contexts), sum(contexts)) >= exact * 0.95


def test_dense_step_cost_groups_layers_by_window():
    class Layer:
        def __init__(self, window):
            self.num_heads, self.head_dim, self.window = 4, 8, window

    cost = dense_step_cost(1000, [Layer(None), Layer(16), Layer(None)])
    assert cost.flops_per_token == 2000
    assert sorted((a.window or 0, a.flops_per_key) for a in cost.attention) == [(0, 256.0), (16, 128.0)]


def test_the_demo_sized_model_prices_its_parameters(tiny_ckpt):
    from hybridkv.model_executor.model_runner import ModelRunner

    runner = ModelRunner(tiny_ckpt("llama"))
    model = runner.model
    embed = sum(p.numel() for m in model.modules() if m.__class__.__name__ == "Embedding" for p in m.parameters())
    head = sum(p.numel() for p in model.lm_head.parameters()) if getattr(model, "lm_head", None) is not None else 0
    total = sum(p.numel() for p in model.parameters())
    assert runner.step_cost.flops_per_token == 2 * (total - embed - head)
    assert runner.step_cost.attention and all(a.flops_per_key > 0 for a in runner.step_cost.attention)

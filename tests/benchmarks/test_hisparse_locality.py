"""benchmarks/hisparse_locality.py: the figures in docs/tiers.md rest on its indexer stand-in
(attention mass pooled over 4-token C4 groups, closed and older than the window) and on driving
the engine's HotBuffers with the selections; a wrong pooling or a miscounted hit would make
every hit rate wrong. The model regimes are not run here (minutes on 2 cores)."""
from __future__ import annotations

import pytest
import torch

from bench_runner import load_benchmark, result_fields

loc = load_benchmark("hisparse_locality")


def test_pooled_group_scores_are_the_group_sums_aggregated_over_heads():
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(3, 40, generator=g)
    t, window = 30, 8  # groups closed and older than the window: (31 - 8) // 4 = 5
    sums = torch.stack([probs[:, 4 * i:4 * i + 4].sum(dim=1) for i in range(5)], dim=1)  # [H, 5]
    assert torch.allclose(loc.pool_groups(probs, t, window, "mean"), sums.mean(dim=0))
    assert torch.allclose(loc.pool_groups(probs, t, window, "max"), sums.amax(dim=0))
    # Without a window the group closed by t itself counts (a closing entry is visible to it).
    assert loc.pool_groups(probs, 31, 0, "mean").numel() == 8
    assert loc.pool_groups(probs, 5, 8, "mean").numel() == 0
    with pytest.raises(ValueError):
        loc.pool_groups(probs, t, window, "median")


def test_topk_picks_the_highest_groups():
    scores = torch.tensor([0.1, 0.5, 0.2, 0.9, 0.3])
    assert loc.select_topk(scores, 2).tolist() == [3, 1]
    assert sorted(loc.select_topk(scores, 9).tolist()) == [0, 1, 2, 3, 4]


def test_no_drift_gives_full_overlap_and_every_hit_once_warm():
    sels = loc.drift_selections(steps=20, entries=64, k=8, p=1.0)
    t = loc.run_buffer(sels, size=8, topk=8)
    assert t.overlap == 1.0
    assert t.lookups == 20 * 8 and t.hits == 19 * 8  # only the cold first step misses


@pytest.mark.parametrize("p", [0.75, 0.25])
def test_drift_sets_the_overlap_and_a_1x_buffer_hits_only_what_was_kept(p):
    sels = loc.drift_selections(steps=30, entries=64, k=8, p=p, seed=1)
    assert all(s.unique().numel() == 8 for s in sels)
    t1 = loc.run_buffer(sels, size=8, topk=8)
    assert t1.overlap == pytest.approx(p)
    assert t1.hits == 29 * round(p * 8)  # a 1x buffer holds exactly the previous selection
    assert loc.run_buffer(sels, size=32, topk=8).hits >= t1.hits


def test_engine_inserts_fill_the_buffer_before_the_selection():
    # Entries 0..9 closed before decode; a 4-slot buffer gets 6..9 at hand-off, so selecting
    # them hits; entry 10 closes at step 1 and is inserted before that step selects it.
    sels = [torch.tensor([8, 9]), torch.tensor([10, 9])]
    t = loc.run_buffer(sels, size=4, topk=2, closed=[10, 11], first_closed=10)
    assert (t.lookups, t.hits) == (4, 4)


def test_drift_regime_prints_a_table_and_result(capsys):
    assert loc.main(["--skip-model", "--topk", "4", "--multiples", "1", "2", "--drift", "1.0", "0.5",
                     "--drift-entries", "32", "--drift-steps", "10"]) == 0
    out = capsys.readouterr().out
    res = result_fields(out)
    assert float(res["drift_hit_1x_p1.0"]) == pytest.approx(0.9)  # 9 warm steps of 10
    assert "| synthetic drift p=0.5" in out

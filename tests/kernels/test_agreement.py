"""tests/_agreement.py: a disagreement counts as a near-tie only where the reference's own margin is below eps."""

import torch
from _agreement import greedy_agreement, top2_margin, topk_agreement


def test_greedy_agreement_tells_near_ties_from_real_disagreements():
    ref = [[5, 6, 7], [5, 6, 7], [5, 6, 7], [5, 6]]
    margins = [[1.0, 1.0, 1.0], [1.0, 0.01, 1.0], [1.0, 0.5, 1.0], [1.0, 1.0]]
    got = [[5, 6, 7], [5, 9, 9], [5, 9, 7], [5, 6, 2]]
    out = greedy_agreement(got, ref, margins, eps=0.05)
    assert (out["equal"], out["near_tie"], out["differ"]) == (1, 1, 2)
    assert [(d["prompt"], d["step"], d["kind"]) for d in out["details"]] == [
        (1, 1, "near_tie"), (2, 1, "differ"), (3, 2, "differ")]  # a longer continuation is a real difference


def test_top2_margin_and_topk_agreement():
    assert abs(top2_margin(torch.tensor([0.1, 2.0, 1.5])) - 0.5) < 1e-12
    scores = torch.tensor([[3.0, 1.0, 2.0, 2.0 + 1e-7], [0.0, 5.0, 4.0, -1.0]], dtype=torch.float64)
    exact = torch.tensor([[0, 3], [1, 2]])
    swapped_tie = torch.tensor([[0, 2], [1, 2]])
    wrong = torch.tensor([[0, 1], [2, 1]])
    assert topk_agreement(exact, scores, 2, 1e-5) == {"rows": 2, "exact": 2, "near_tie": 0, "differ": 0}
    assert topk_agreement(swapped_tie, scores, 2, 1e-5) == {"rows": 2, "exact": 1, "near_tie": 1, "differ": 0}
    assert topk_agreement(wrong, scores, 2, 1e-5)["differ"] == 2

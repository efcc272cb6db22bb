"""Agreement of two implementations' discrete outputs (greedy tokens, top-k indices) that is robust to near-ties.

Two correct implementations of the same model agree on an argmax only where the reference's top-2 margin is
larger than their numerical difference: GEMM paths picked by the CPU's ISA (AVX2, AVX-512, AMX), batch shapes
and bf16 rounding move logits by a few ulps to a few hundredths of a nat, and a near-tie flips. The helpers here
count a disagreement as a near-tie when the reference's margin at the first differing step (or between the
k-th and (k+1)-th scores) is below ``eps``, and as a real disagreement otherwise; tests assert there are no real
disagreements and report the near-ties.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def top2_margin(logits: torch.Tensor) -> float:
    """Gap between the largest and second-largest entry of a 1-D ``logits`` (any float dtype), in float64."""
    top = logits.detach().double().topk(2).values
    return float(top[0] - top[1])


def greedy_agreement(tokens: Sequence[Sequence[int]], ref_tokens: Sequence[Sequence[int]],
                     ref_margins: Sequence[Sequence[float]], eps: float) -> dict:
    """Compare greedy continuations ``tokens`` against ``ref_tokens`` (one list per prompt); ``ref_margins[i][t]`` is
    the reference's top-2 logit margin at step ``t`` of prompt ``i``. Returns ``{"equal", "near_tie", "differ",
    "details"}``: each prompt is equal, or first differs at a step whose reference margin is below ``eps``
    (near_tie; the continuations after it are not comparable), or differs where the reference was decided."""
    if not len(tokens) == len(ref_tokens) == len(ref_margins):
        raise ValueError(f"tokens, ref_tokens and ref_margins must have one entry per prompt: {len(tokens)}, "
                         f"{len(ref_tokens)}, {len(ref_margins)}")
    out = {"equal": 0, "near_tie": 0, "differ": 0, "details": []}
    for i, (got, ref, margins) in enumerate(zip(tokens, ref_tokens, ref_margins, strict=True)):
        got, ref = list(got), list(ref)
        if got == ref:
            out["equal"] += 1
            continue
        step = next((t for t, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b), min(len(got), len(ref)))
        margin = float(margins[step]) if step < len(margins) else float("inf")
        kind = "near_tie" if margin < eps else "differ"
        out[kind] += 1
        out["details"].append({"prompt": i, "step": step, "ref_margin": margin, "kind": kind})
    return out


def topk_agreement(index: torch.Tensor, ref_scores: torch.Tensor, k: int, eps: float) -> dict:
    """Check top-``k`` indices ``index`` (..., k) against the reference scores ``ref_scores`` (..., V): per row, the
    reference's scores at ``index`` must be its own top-k scores, in order, within ``eps``. A row where the set or
    order differs from the reference's own top-k is a near-tie when the reference's gaps there are below ``eps``.
    Returns ``{"rows", "exact", "near_tie", "differ"}``."""
    ref = ref_scores.detach().double().reshape(-1, ref_scores.shape[-1])
    idx = index.reshape(-1, k)
    ref_top = ref.topk(k, dim=-1)
    picked = ref.gather(-1, idx.long())
    exact = (idx.long() == ref_top.indices).all(-1)
    close = ((picked - ref_top.values).abs() <= eps).all(-1)
    return {"rows": int(idx.shape[0]), "exact": int(exact.sum()), "near_tie": int((~exact & close).sum()),
            "differ": int((~close).sum())}

"""Agreement of two implementations: discrete outputs (greedy tokens, top-k indices) robust to near-ties, and the
tolerance of two fp32 training runs' losses derived from what they sum.

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


FP32_UNIT_ROUNDOFF = 2.0 ** -24


def loss_term_scale(advantages: torch.Tensor, logprob: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean magnitude of the per-token terms a policy loss sums: |A_t|·max(1, |log π_t|) over the valid tokens of
    ``mask`` [B, T] (``advantages`` [B] or [B, T], ``logprob`` [B, T]). It bounds every loss of the GRPO family:
    ratio terms are |A·r| with r ≈ 1, REINFORCE-style terms (VESPO, CISPO) |A·log π|, and the KL terms are far
    smaller; the terms cancel in the mean, so the loss itself can be much smaller than this."""
    adv = advantages.detach().double()
    adv = adv[:, None] if adv.dim() == 1 else adv
    terms = adv.abs() * logprob.detach().double().abs().clamp(min=1.0)
    valid = mask.bool()
    return float(terms.expand_as(valid)[valid].mean()) if bool(valid.any()) else 0.0


def fp32_loss_tolerance(tokens: int, term_scale: float, step: int) -> float:
    """How far two correct fp32 implementations' losses may lie apart at optimizer step ``step`` (1-based) when the
    loss is a mean of ``tokens`` terms of mean magnitude ``term_scale`` (``loss_term_scale``).

    One evaluation: recursive summation of n terms errs by at most (n − 1)·u·Σ|t_i|, so the mean by n·u·S (u the
    fp32 unit roundoff); the two sides also order their sums differently, by thread count and ISA. Each earlier step
    left the two sides' parameters apart by that step's own rounding, which the loss carries forward at first
    order: one such share per step. A real difference (a wrong sign, a missing term, a token off the mask) moves
    the loss by about S/n or more, orders of magnitude above this."""
    return step * tokens * FP32_UNIT_ROUNDOFF * term_scale

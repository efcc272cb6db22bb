"""The policy's passes over micro-batches (steps 4 and 5 of trainer/train.py) and what step 5 computes once per
mini-batch: the micro-batch options of the run, the forward at each sequence's sampling temperature, a mini-batch's
rollout weights and, in ``algo.scope: global``, its Clip-Cov/KL-Cov selection over all ranks."""

from __future__ import annotations

import torch

from fastcov.losses import LossConfig, Selection, compute_global_selection
from fastcov.trainer.config import Config
from fastcov.trainer.runtime.batch import MicroBatch, Sequence, sequence_tensors
from fastcov.trainer.runtime.distributed import all_max, all_sum


def batching(cfg: Config, engine, no_grad: bool = False) -> dict:
    """``micro_batches`` options of the run: token budget (``trainer.logprob_token_budget`` for step 4's
    no-grad pass over the rollout batch when set) and packing (flash-attn packs one row per micro-batch, taking the
    sequence boundaries from the position ids)."""
    t = cfg.trainer
    budget = (t.logprob_token_budget or t.micro_token_budget) if no_grad else t.micro_token_budget
    flash = engine.policy.lm.config._attn_implementation.startswith("flash_attention")
    return {"budget": budget, "packing": t.packing, "row_capacity": budget if (t.packing and flash) else None}


def forward(engine, mb: MicroBatch, temperature: float, vocab_cov: bool = False, sum_p2: bool = False):
    """The policy's per-token log-probs and entropies ([rows, L]) on one micro-batch, any layout, each token at the
    temperature its sequence was sampled with (``mb.temperature``; ``temperature`` where none was recorded)."""
    return engine(**mb.model_inputs(), temperature=mb.temperature_or(temperature), entropy=True, vocab_cov=vocab_cov,
                  sum_p2=sum_p2)


def mini_batch_weights(mini: list[Sequence], device: torch.device) -> torch.Tensor | None:
    """The rollout weights of a mini-batch in the per-sequence layout [S, T] (``MicroBatch.from_sequences``
    maps them to a micro-batch); None when the run does not correct its rollouts."""
    if not mini or any(s.rollout_weight is None for s in mini):
        return None
    out = torch.zeros((len(mini), max(1, max(len(s.response) for s in mini))), device=device)
    for i, s in enumerate(mini):
        weight = s.rollout_weight or []
        out[i, : len(weight)] = torch.tensor(weight, device=device)
    return out


def mini_batch_selection(engine, mini: list[Sequence], mbs: list[MicroBatch], cfg: Config, loss_cfg: LossConfig,
                         device: torch.device, generator: torch.Generator, group, reuse_old: bool) -> Selection:
    """Global scope: the Clip-Cov/KL-Cov (and high-entropy) selection of one mini-batch over all ranks, once.

    Works in the per-sequence layout [S, T]: row s is ``mini[s]``, column t its t-th response token, T
    the longest response of the mini-batch on any rank. Ranks hold consecutive blocks of the mini-batch's
    sequences (rank order = global order), so the flat position of a token in the concatenation over
    ranks, which Clip-Cov's random keys and all tie-breaks use, is (global sequence index) × T + t: it
    does not depend on the number of ranks or on the micro-batch split. The current log-probs are
    ``old_logprob`` when ``reuse_old`` (the policy has not moved since step 4), else a no-grad forward
    over ``mbs``. Every rank must call it. Returns bool [S, T] masks (``MicroBatch.from_sequences``
    turns them into a micro-batch's).
    """
    T = max(1, all_max(max((len(s.response) for s in mini), default=0), device))
    per_seq = sequence_tensors(mini, T, device)
    need_entropy = loss_cfg.high_entropy_fraction is not None
    need_kappa = loss_cfg.cov_score == "vocab"
    stored = {"logprob": "old_logprob", "entropy": "old_entropy", "vocab_cov": "old_vocab_cov"}
    wanted = ["logprob"] + ["entropy"] * need_entropy + ["vocab_cov"] * need_kappa
    # whether to forward must agree over ranks (ZeRO-3 forwards are collective)
    missing = 0.0 if all(stored[k] in per_seq for k in wanted) else 1.0
    if reuse_old and all_sum([missing], device)[0] == 0:
        current = {k: per_seq[stored[k]] for k in wanted}
    else:
        current = {k: torch.zeros((len(mini), T), device=device) for k in wanted}
        with torch.no_grad():
            for mb in mbs:
                res = forward(engine, mb, cfg.rollout.temperature, vocab_cov=need_kappa)
                if mb.weight > 0:
                    for k in wanted:
                        mb.to_sequences(getattr(res, k), current[k])
    return compute_global_selection(
        current["logprob"], per_seq["old_logprob"], per_seq["advantages"], per_seq["mask"],
        mode=cfg.algo.mode, config=loss_cfg, entropy=current.get("entropy"), vocab_cov=current.get("vocab_cov"),
        group=group, generator=generator,
    )


def selected_position_sum(cov: torch.Tensor | None, mini: list[Sequence]) -> float:
    """Σ over the selected tokens of their relative position t / (n − 1) in their response (0: the first token,
    1: the last) in the per-sequence layout [S, T] of ``mini_batch_selection``; 0.0 without a selection."""
    if cov is None or cov.numel() == 0:
        return 0.0
    last = torch.tensor([max(len(s.response) - 1, 1) for s in mini], dtype=torch.float64, device=cov.device)
    position = torch.arange(cov.shape[1], dtype=torch.float64, device=cov.device)[None, :] / last[:, None]
    return float((cov * position).sum())

"""Which tokens a mode's penalty reaches: the input checks, the covariance scores, the selection in the
call (``scope="microbatch"``) or once per mini-batch over every rank (``compute_global_selection``), and
the random controls."""

from __future__ import annotations

from dataclasses import replace

import torch

from fastcov.covariance import token_covariance, token_covariance_and_keys
from fastcov.losses.config import RANDOM_CONTROLS, LossConfig, Selection, SelectionInputs
from fastcov.losses.modes import get_policy_loss
from fastcov.selection import (
    check_like,
    decorrelated_keys,
    draw_seed,
    select_random_matched,
    select_top_covariance,
)

# ---------------------------------------------------------------- checks


def _check_loss_inputs(logprob, old_logprob, advantages, mask, entropy, vocab_cov) -> None:
    if not isinstance(logprob, torch.Tensor):
        raise TypeError(f"logprob must be a torch.Tensor, got {type(logprob).__name__}")
    if logprob.dim() != 2:
        raise ValueError(f"logprob must be [B, T], got shape {tuple(logprob.shape)}")
    if not logprob.is_floating_point():
        raise TypeError(f"logprob must be a floating tensor, got {logprob.dtype}")
    for name, tensor in (
        ("old_logprob", old_logprob),
        ("advantages", advantages),
        ("mask", mask),
        ("entropy", entropy),
        ("vocab_cov", vocab_cov),
    ):
        if name in ("old_logprob", "advantages", "mask") and tensor is None:
            raise TypeError(f"{name} must be a torch.Tensor, got None")
        check_like(name, tensor, logprob, "logprob")
        if tensor is not None and name != "mask" and not tensor.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {tensor.dtype}")


def _check_selection_mask(name: str, tensor, logprob: torch.Tensor) -> None:
    check_like(name, tensor, logprob, "logprob")
    if tensor is not None and tensor.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor, got {tensor.dtype}")


# ---------------------------------------------------------------- selection


def _selection_scores(mode, logprob, advantages, valid, config, vocab_cov, group, generator, impl):
    """(scores, keys) for a mode's selector; logprob and advantages are detached and sanitized."""
    if config.cov_score == "random":
        random_seed = draw_seed(generator, logprob.device, group)
        _, keys = token_covariance_and_keys(logprob, advantages, valid, seed=random_seed, group=group, impl=impl)
        assert keys is not None  # a seed gives keys
        # 53 random bits of the key -> u in (0, 1), strictly inside the band (lb, ub)
        u = ((keys & ((1 << 53) - 1)).to(torch.float64) + 0.5) / float(1 << 53)
        lo, hi = config.clip_cov_lb, config.clip_cov_ub
        scores = torch.where(valid, (lo + (hi - lo) * u).to(logprob.dtype), torch.zeros_like(logprob))
        return scores, keys
    if config.cov_score == "vocab":
        if vocab_cov is None:
            raise ValueError("vocab_cov is required when cov_score='vocab'")
        scores = torch.where(valid, advantages * vocab_cov.detach(), torch.zeros_like(advantages))
        return scores, None
    needs_keys = mode.random_keys or config.cov_score == "random_matched"
    seed = draw_seed(generator, logprob.device, group) if needs_keys else None
    return token_covariance_and_keys(logprob, advantages, valid, seed=seed, group=group, impl=impl)


def _select_tokens(mode, logprob, old_logprob, advantages, valid, config, entropy, vocab_cov, group, generator,
                   impl) -> tuple[Selection, torch.Tensor | None]:
    """(Selection, scores or None) over this call's tokens and, with ``group``, all its ranks."""
    scores = cov_selected = reference = None
    if mode.selector is not None:
        scores, keys = _selection_scores(mode, logprob, advantages, valid, config, vocab_cov, group, generator, impl)
        inputs = SelectionInputs(scores, keys, logprob, old_logprob, advantages, valid, config, group, generator)
        cov_selected = mode.selector(inputs) & valid
        if config.cov_score in RANDOM_CONTROLS:
            cov_selected, reference = _random_control(mode, inputs, cov_selected, impl)
    high_entropy = None
    if config.high_entropy_fraction is not None:
        if entropy is None:
            raise ValueError("entropy is required when high_entropy_fraction is set")
        high_entropy = select_top_covariance(entropy.detach(), valid, config.high_entropy_fraction, group=group)
    return Selection(cov_selected, high_entropy, reference), scores


def _random_control(mode, inputs: SelectionInputs, picked: torch.Tensor, impl: str):
    """(the control's selection, what the covariance rule picks on the same tokens) of a random control.

    "random_matched": ``picked`` is the rule's own pick (scores c_t); the control takes as many tokens
    uniformly among all valid ones. "random": ``picked`` already is the control (random scores); the
    rule is re-run on c_t for the overlap diagnostic. Either way the second pick re-hashes the keys, so
    the two sets are independent draws of one seed, and no random number is drawn here.
    """
    keys = None if inputs.keys is None else decorrelated_keys(inputs.keys)
    if inputs.config.cov_score == "random_matched":
        assert keys is not None  # _selection_scores draws them for this score
        return select_random_matched(picked, inputs.valid, keys, group=inputs.group) & inputs.valid, picked
    c_t = token_covariance(inputs.logprob, inputs.advantages, inputs.valid, group=inputs.group, impl=impl)
    return picked, mode.selector(replace(inputs, scores=c_t, keys=keys)) & inputs.valid


def _sanitize(tensor: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    # Padding may hold garbage (inf, NaN); zero it before any arithmetic so neither the loss nor
    # its gradient can pick it up (a torch.where after exp() would still back-propagate 0·inf).
    return torch.where(valid, tensor, torch.zeros_like(tensor))


def compute_global_selection(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str,
    config: LossConfig = LossConfig(),
    entropy: torch.Tensor | None = None,
    vocab_cov: torch.Tensor | None = None,
    group=None,
    generator: torch.Generator | None = None,
    impl: str = "auto",
) -> Selection:
    """Covariance statistics and token selection of a whole mini-batch (this rank's part), once.

    Call it before the micro-batch loop with the mini-batch's *current* log-probs (a no-grad
    forward; on the first mini-batch of a rollout they equal ``old_logprob``), then pass
    ``selection.rows(rows_of_microbatch)`` as ``selection=`` to each
    ``policy_loss(..., scope="global")`` call. With ``group`` the means, k and the selection cover all
    ranks' mini-batches (every rank must call it, with the same ``mode`` and ``config``).

    Args:
        logprob: floating [B, T].
        old_logprob: floating [B, T].
        advantages: floating [B, T].
        mask: [B, T] (nonzero = valid).
        entropy: [B, T], needed when ``config.high_entropy_fraction`` is set.
        vocab_cov: [B, T] κ, needed when ``config.cov_score == "vocab"``.
        generator: seed source for Clip-Cov (group rank 0's draw is broadcast).
    Returns:
        Selection with bool [B, T] masks (``cov`` None for modes without a selector).
    """
    loss_mode = get_policy_loss(mode)
    if not isinstance(config, LossConfig):
        raise TypeError(f"config must be a LossConfig, got {type(config).__name__}")
    _check_loss_inputs(logprob, old_logprob, advantages, mask, entropy, vocab_cov)
    with torch.no_grad():
        valid = mask.bool()
        selection, _ = _select_tokens(
            loss_mode,
            _sanitize(logprob.detach(), valid),
            _sanitize(old_logprob.detach(), valid),
            _sanitize(advantages.detach(), valid),
            valid,
            config,
            None if entropy is None else _sanitize(entropy.detach(), valid),
            None if vocab_cov is None else _sanitize(vocab_cov.detach(), valid),
            group,
            generator,
            impl,
        )
    return selection


def _coerce_selection(selection, loss_mode, config, logprob, valid, entropy, scope) -> Selection:
    if isinstance(selection, torch.Tensor):
        selection = Selection(cov=selection)
    if not isinstance(selection, Selection):
        raise TypeError(f"selection must be a Selection or a bool tensor, got {type(selection).__name__}")
    _check_selection_mask("selection.cov", selection.cov, logprob)
    _check_selection_mask("selection.high_entropy", selection.high_entropy, logprob)
    _check_selection_mask("selection.reference", selection.reference, logprob)
    high_entropy = selection.high_entropy
    if config.high_entropy_fraction is not None and high_entropy is None:
        if scope == "global":
            raise ValueError(
                "selection.high_entropy is required with scope='global' and high_entropy_fraction set "
                "(compute_global_selection provides it)"
            )
        if entropy is None:
            raise ValueError("entropy is required when high_entropy_fraction is set")
        high_entropy = select_top_covariance(entropy.detach(), valid, config.high_entropy_fraction)
    cov, reference = (None if x is None else x & valid for x in (selection.cov, selection.reference))
    return Selection(cov, None if high_entropy is None else high_entropy & valid, reference)

"""The training loop, top to bottom.

    prompts -> n rollouts each -> rewards -> advantages -> (DAPO filter) -> old log-probs
    -> ppo_epochs x mini-batches x token-budget micro-batches of fastcov.policy_loss -> weight sync
    -> metrics, evaluation, checkpoints

``_train`` at the bottom is the loop; each step is a named function above it: ``start_run`` (checks,
data, policy, rollout engine, resume), ``collect_rollouts`` (steps 1-3, with DAPO's refill),
``score_and_update`` (4-6: ``compute_old_logprobs``, ``update_policy``, the weight sync), ``step_metrics``
(7) and ``end_step`` (8-9: evaluation, checkpoint, the metrics row). A ``Run`` carries the state between
steps; tests call ``compute_old_logprobs`` and ``update_policy`` with fixed rollouts. In
``algo.scope: global`` (the default) Clip-Cov/KL-Cov select tokens once per mini-batch over all ranks
(``mini_batch_selection``), so the update does not depend on the micro-batch split or the number of ranks.
Micro-batches are padded or, with ``trainer.packing``, packed (trainer/runtime/batch.py).

``train(cfg)`` runs in every data-parallel process (one on CPU without a launcher). Every tensor that
reaches the loss comes from ``fastcov.linear_logprob_entropy`` on the last hidden states: full logits
are never built.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import signal
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fastcov.advantages import dapo_filter, get_advantage
from fastcov.errors import UserError, one_line
from fastcov.losses import LossConfig, Selection, compute_global_selection, get_policy_loss, policy_loss
from fastcov.trainer import entropy_control
from fastcov.trainer.config import Config, ConfigError, positive_weight_schedule, rollout_correction_enabled
from fastcov.trainer.data.loading import PromptSampler, load_train_val, prepare_data
from fastcov.trainer.evaluation import evaluate
from fastcov.trainer.rewards import REWARD_TASKS, RewardFn  # noqa: F401 - RewardFn: the name tests patch
from fastcov.trainer.rollout import SamplingParams, make_rollout_engine
from fastcov.trainer.rollout.base import sample_seed
from fastcov.trainer.runtime.batch import MicroBatch, Sequence, micro_batches, sequence_tensors
from fastcov.trainer.runtime.checkpoint import (
    CheckpointError,
    fsync_path,
    latest_checkpoint,
    load_checkpoint,
    publish_checkpoint,
    write_atomic,
    write_checkpoint,
)
from fastcov.trainer.runtime.distributed import (
    all_gather_floats,
    all_max,
    all_reduce_,
    all_sum,
    broadcast_text,
    init_distributed,
    lost_peer,
    pick_device,
    world_size,
)
from fastcov.trainer.runtime.lora import count_parameters
from fastcov.trainer.runtime.metrics import MetricsLogger
from fastcov.trainer.runtime.model import (
    PolicyModel,
    build_model,
    check_model_source,
    export_final,
    load_tokenizer,
    use_liger,
)
from fastcov.trainer.runtime.offload import activation_offload
from fastcov.trainer.runtime.policy import DeepSpeedPolicy, ds_config, lr_at
from fastcov.trainer.runtime.precision import param_dtype
from fastcov.trainer.runtime.run_dir import (
    CONFIG,
    RunDirBusy,
    RunDirLock,
    check_run_dir,
    checkpoints_dir,
    io_error,
    metrics_path,
    prepare_run_dir,
    trim_metrics,
)
from fastcov.trainer.token_level.advantages import make_token_advantages, prime_keep

# policy_loss metrics averaged over the update's tokens; its "entropy" is logged as "update_entropy"
# ("entropy" is the rollout-token mean of the pre-update policy).
LOSS_METRICS = ("ppo_kl", "clipfrac", "selected_frac", "selected_pos_adv", "selected_prob", "selected_cov",
                "cov_mean", "cov_max", "entropy")
LOSS_METRIC_NAMES = {"entropy": "update_entropy"}
# summed like LOSS_METRICS, logged only as sel/* ratios: the overlap of a random control with the covariance
# rule's pick (policy_loss), and the selected tokens' relative position in their response (global scope)
SELECTION_DIAGNOSTICS = ("selected_and_ref", "selected_or_ref", "selected_pos")


class RolloutError(RuntimeError):
    pass


def _user_error(exc: ValueError) -> Exception:
    """model.py / engine.py raise ValueError naming the config key for a bad model, tokenizer or device:
    those are the user's to fix (one line on the CLI); anything else stays what it was."""
    msg = str(exc)
    if msg.startswith(("model.", "trainer.device")):
        return ConfigError(msg.splitlines()[0][:500])
    return exc


def loss_config(a, pos_adv_weight: float) -> LossConfig:
    """The LossConfig of one update from the run's ``algo`` section (λ from its schedule)."""
    return LossConfig(
        clip_low=a.clip_low, clip_high=a.clip_high, dual_clip_c=a.dual_clip_c,
        clip_cov_ratio=a.clip_cov_ratio, clip_cov_lb=a.clip_cov_lb, clip_cov_ub=a.clip_cov_ub,
        kl_cov_ratio=a.kl_cov_ratio, kl_cov_coef=a.kl_cov_coef, entropy_coef=a.entropy_coef,
        pos_adv_weight=pos_adv_weight, neg_adv_weight=a.neg_adv_weight,
        high_entropy_fraction=a.high_entropy_fraction, cov_score=a.cov_score,
        cispo_clip_max=a.cispo_clip_max, cispo_clip_min=a.cispo_clip_min, sapo_tau_pos=a.sapo_tau_pos,
        sapo_tau_neg=a.sapo_tau_neg,
        check_finite=False,  # a non-finite loss skips the step instead of raising
    )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------------------- steps 4 and 5

def batching(cfg: Config, engine) -> dict:
    """``micro_batches`` options of the run: token budget and packing (flash-attn packs one row per
    micro-batch, taking the sequence boundaries from the position ids)."""
    t = cfg.trainer
    flash = engine.policy.lm.config._attn_implementation.startswith("flash_attention")
    return {"budget": t.micro_token_budget, "packing": t.packing,
            "row_capacity": t.micro_token_budget if (t.packing and flash) else None}


def forward(engine, mb: MicroBatch, temperature: float, vocab_cov: bool = False):
    """The policy's per-token log-probs and entropies ([rows, L]) on one micro-batch, any layout."""
    return engine(**mb.model_inputs(), temperature=temperature, entropy=True, vocab_cov=vocab_cov)


def compute_old_logprobs(engine, seqs: list[Sequence], cfg: Config, pad_id: int, device: torch.device,
                         keep_entropy: bool = False, keep_vocab_cov: bool = False
                         ) -> tuple[float, float, float, float]:
    """Step 4: fill ``old_logprob`` of every sequence (and ``old_entropy`` / ``old_vocab_cov`` when asked)
    with a no-grad pass over token-budget micro-batches. Returns (entropy sum, response tokens,
    Σ |old − sampling log-prob|, max |old − sampling log-prob|) over this rank's sequences: the rollout
    engine's log-probs against the policy's before the update. Every rank must call it."""
    engine.eval()
    ent_sum = tok_sum = lp_diff = lp_diff_max = 0.0
    with torch.no_grad():
        for mb in micro_batches(seqs, pad_id=pad_id, device=device, **batching(cfg, engine)):
            res = forward(engine, mb, cfg.rollout.temperature, vocab_cov=keep_vocab_cov)
            if mb.weight == 0:
                continue
            for si, (row, start, n) in zip(mb.seq_index, mb.spans):
                s = seqs[si]
                lp = res.logprob[row, start : start + n].float()
                ent = res.entropy[row, start : start + n].float()
                s.old_logprob = lp.tolist()
                if keep_entropy:
                    s.old_entropy = ent.tolist()
                if keep_vocab_cov:
                    s.old_vocab_cov = res.vocab_cov[row, start : start + n].float().tolist()
                ent_sum += float(ent.sum())
                gap = (lp - torch.tensor(s.sample_logprob, device=lp.device)).abs()
                lp_diff += float(gap.sum())
                lp_diff_max = max(lp_diff_max, float(gap.max())) if n else lp_diff_max
                tok_sum += n
    return ent_sum, tok_sum, lp_diff, lp_diff_max


def correct_rollouts(seqs: list[Sequence], cfg: Config, device: torch.device) -> dict[str, float]:
    """Step 4b (algo.rollout_correction): each sequence's ``rollout_weight`` from its ``old_logprob`` against the
    rollout's ``sample_logprob``: the importance weights, times 0 where rejection or the off-policy sequence mask
    drop a token. Returns the ``rollout_corr/*`` metrics (verl's names) over all ranks: token-weighted means of
    the ranks' values, and the maximum / minimum of the ranks' ``*_max`` / ``*_min``. Every rank must call it.

    The weights are per sequence (no statistic crosses sequences), so they do not depend on the number of ranks
    or the micro-batch split, and they multiply the per-token loss after the Clip-Cov/KL-Cov selection: they do
    not change which tokens are selected (a rejected token stays in the denominators and may be selected).
    """
    from fastcov.correction import mismatch_metrics, off_policy_sequence_mask, rollout_correction, rollout_rejection

    rc = cfg.algo.rollout_correction
    width = max((len(s.response) for s in seqs), default=0)
    n_tokens = sum(len(s.response) for s in seqs)
    if n_tokens:
        per_seq = sequence_tensors(seqs, width, device)
        mask, old = per_seq["mask"], per_seq["old_logprob"].double()
        sampled = torch.zeros_like(old)
        for i, s in enumerate(seqs):
            sampled[i, : len(s.sample_logprob)] = torch.tensor(s.sample_logprob, dtype=torch.float64)
    else:  # no token on this rank: a neutral one-token batch keeps the metric names and the collectives in step
        mask, old, sampled = torch.ones((1, 1), dtype=torch.bool), torch.zeros((1, 1)), torch.zeros((1, 1))
        per_seq = {"advantages": torch.zeros((1, 1))}
    log_ratio = old - sampled
    weights, metrics = rollout_correction(log_ratio, mask, level=rc.level, mode=rc.mode, clip_max=rc.clip_max,
                                          clip_min=rc.clip_min)
    if rc.rejection is not None:
        keep, rs_metrics = rollout_rejection(log_ratio, mask, rc.rejection, rc.rejection_threshold)
        weights, metrics = weights * keep, {**metrics, **rs_metrics}
    if rc.off_policy_mask_threshold is not None:
        keep, op_metrics = off_policy_sequence_mask(log_ratio, per_seq["advantages"].to(log_ratio.dtype), mask,
                                                    rc.off_policy_mask_threshold)
        weights, metrics = weights * keep, {**metrics, **op_metrics}
    metrics.update(mismatch_metrics(old, sampled, mask))
    if n_tokens:
        for i, s in enumerate(seqs):
            s.rollout_weight = weights[i, : len(s.response)].float().tolist()
    names = sorted(metrics)
    values = [float(metrics[k]) for k in names]
    sums = all_sum([n_tokens] + [v * n_tokens for v in values], device)
    highs = all_reduce_(torch.tensor([v if k.endswith("_max") else -math.inf for k, v in zip(names, values)],
                                     dtype=torch.float64, device=device), "max").tolist()
    lows = all_reduce_(torch.tensor([-v if k.endswith("_min") else -math.inf for k, v in zip(names, values)],
                                    dtype=torch.float64, device=device), "max").tolist()
    out = {}
    for k, total, high, low in zip(names, sums[1:], highs, lows):
        value = high if k.endswith("_max") else -low if k.endswith("_min") else total / max(sums[0], 1)
        out[f"rollout_corr/{k}"] = value
    return out


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


@dataclass
class UpdateStats:
    """What step 5 reports: loss and ``LOSS_METRICS`` sums (weighted by micro-batch tokens) on this rank,
    optimizer steps applied / skipped (agreed over ranks), gradient norms, mini-batches per epoch."""

    loss_sum: float = 0.0
    metric_sums: dict[str, float] = field(default_factory=dict)
    metric_tokens: int = 0
    applied_steps: int = 0
    skipped_steps: int = 0
    grad_norms: list[float] = field(default_factory=list)
    n_mini: int = 1


def update_policy(engine, seqs: list[Sequence], kept_groups: list[int], cfg: Config, loss_cfg: LossConfig,
                  lr: float, pad_id: int, device: torch.device, generator: torch.Generator) -> UpdateStats:
    """Step 5: ppo_epochs × mini-batches × token-budget micro-batches of ``policy_loss``, one optimizer step
    per mini-batch.

    ``seqs``: this rank's kept sequences, ``old_logprob`` set (step 4), ranks holding consecutive
    prompt groups in rank order; ``kept_groups``: the global indices of the kept groups (the same list
    on every rank). Mini-batches split the kept groups (global order), so every rank steps together.
    In ``algo.scope: global`` each mini-batch's selection is computed once (``mini_batch_selection``)
    and each micro-batch gets its slice. Every rank must call it.
    """
    missing = [i for i, s in enumerate(seqs) if s.old_logprob is None]
    if missing:
        raise ValueError(f"update_policy: sequences {missing[:5]} have no old_logprob (run compute_old_logprobs)")
    a, world = cfg.algo, world_size()
    group = dist.group.WORLD if world > 1 else None
    global_scope = a.scope == "global"
    needs_selection = get_policy_loss(a.mode).selector is not None or loss_cfg.high_entropy_fraction is not None
    engine.train()
    offloaded = activation_offload(cfg.trainer.offload_activations, device)  # a null context unless asked
    n_mini = min(a.mini_batches, max(1, len(kept_groups)))
    group_chunks = [kept_groups[j::n_mini] for j in range(n_mini)] if kept_groups else [[]]
    stats = UpdateStats(n_mini=n_mini)
    for epoch in range(a.ppo_epochs):
        for m, chunk in enumerate(group_chunks):
            cset = set(chunk)
            mini = [s for s in seqs if s.group in cset]
            local_tok = sum(len(s.response) for s in mini)
            g_tok, g_seq = all_sum([local_tok, len(mini)], device)
            mbs = micro_batches(mini, pad_id=pad_id, device=device, **batching(cfg, engine))
            selection, rollout_weights = None, mini_batch_weights(mini, device)
            if global_scope and needs_selection:
                selection = mini_batch_selection(engine, mini, mbs, cfg, loss_cfg, device, generator, group,
                                                 reuse_old=epoch == 0 and m == 0)
                stats.metric_sums["selected_pos"] = (stats.metric_sums.get("selected_pos", 0.0)
                                                     + selected_position_sum(selection.cov, mini))
            poisoned = False
            for j, mb in enumerate(mbs):
                with offloaded():
                    res = forward(engine, mb, cfg.rollout.temperature, vocab_cov=a.cov_score == "vocab")
                mb_selection = None
                if selection is not None:
                    mb_selection = Selection(*(None if x is None else mb.from_sequences(x)
                                               for x in (selection.cov, selection.high_entropy, selection.reference)))
                loss, metrics = policy_loss(
                    res.logprob, mb.old_logprob, mb.advantages, mb.mask,
                    mode=a.mode, agg=a.loss_agg, scope=a.scope, config=loss_cfg,
                    entropy=res.entropy, vocab_cov=res.vocab_cov, group=group,
                    global_tokens=g_tok, global_seqs=g_seq, generator=generator, selection=mb_selection,
                    weights=None if rollout_weights is None else mb.from_sequences(rollout_weights),
                    segments=mb.segment_ids(),
                )
                # Divided by the mini-batch totals over all ranks, the micro-batch losses sum to the
                # mini-batch loss; DeepSpeed averages gradients over ranks, hence the world factor.
                scaled = loss * (world * mb.weight)
                finite = all_sum([0.0 if bool(torch.isfinite(loss)) else 1.0], device)[0] == 0
                if not finite:
                    poisoned = True
                engine.backward(scaled, boundary=j == len(mbs) - 1)
                if mb.weight > 0 and bool(torch.isfinite(loss)):
                    stats.loss_sum += float(loss.detach())
                    for k in LOSS_METRICS + SELECTION_DIAGNOSTICS[:2]:
                        v = float(metrics.get(k, 0.0))
                        if math.isfinite(v):
                            stats.metric_sums[k] = stats.metric_sums.get(k, 0.0) + v * mb.n_tokens
                    stats.metric_tokens += mb.n_tokens
            applied, norm = engine.step(lr, poisoned)
            if applied:
                stats.applied_steps += 1
                if norm is not None:
                    stats.grad_norms.append(norm)
            else:
                stats.skipped_steps += 1
    return stats


@dataclass
class Collected:
    """Steps 1-3 of a training step on this rank: its kept sequences (advantages set), the global ids of
    the kept prompt groups (the same list on every rank, ordered rank by rank so ``update_policy``'s
    rank order is global order), and what the metrics need about everything generated this step."""

    seqs: list[Sequence]
    kept_groups: list[int]
    prompts: list[list[int]]
    token_ids: list[list[int]]
    rewards: list[float]
    n_generated: int
    gen_batches: int
    times: dict[str, float]


def collect_rollouts(cfg: Config, step: int, sampler, train_set, rollout, reward_fn, tokenizer,
                     generator: torch.Generator, counters: dict, rank: int, device: torch.device,
                     ckpt_root: Path) -> Collected:
    """Steps 1-3: sample prompts, generate ``rollout.n`` responses each, score them, compute advantages
    and drop the groups the filters reject (DAPO: all rewards equal; PRIME: accuracy out of band).

    With ``algo.dapo_filter`` and ``algo.max_gen_batches`` != 1 this repeats with fresh prompts until
    ``prompts_per_step`` groups are kept (verl's dynamic sampling): the first ``prompts_per_step`` kept
    groups in generation order are trained on; a step still short after ``max_gen_batches`` batches
    trains on what it has. Advantages are computed per generated batch. Every rank must call it.
    """
    t, a, r = cfg.trainer, cfg.algo, cfg.rollout
    world = world_size()
    local = t.prompts_per_step // world
    limit = a.max_gen_batches if a.dapo_filter else 1
    span = local * (limit if limit > 0 else 1_000_000)  # group ids: rank-major, then batch, then prompt
    sampling = SamplingParams(r.temperature, r.top_p, r.max_new_tokens)
    times = {"rollout": 0.0, "reward": 0.0}
    kept: list[int] = []  # group ids of the kept groups, in generation order
    pending: dict[int, list[Sequence]] = {}
    all_prompts, all_ids, all_rewards = [], [], []
    n_batches = 0
    while True:
        n_batches += 1
        t0 = time.perf_counter()
        batch_idx = sampler.next(t.prompts_per_step)  # same global order on every rank
        examples = [train_set[i] for i in batch_idx[rank * local : (rank + 1) * local]]
        prompts = [ex.prompt_ids for ex in examples for _ in range(r.n)]
        if r.seeding == "per_sample":  # response j of global prompt g: its own seed, on any topology
            first = (n_batches - 1) * t.prompts_per_step + rank * local
            sampling.seeds = [sample_seed(t.seed, step, first + i // r.n, i % r.n) for i in range(len(prompts))]
        try:
            out = rollout.generate(prompts, sampling, generator)
        except Exception as exc:
            last = latest_checkpoint(ckpt_root)
            raise RolloutError(
                f"rollout engine failed at step {step}: {type(exc).__name__}: {exc}. "
                f"Last checkpoint: {last if last else 'none'} (intact); resume with --resume."
            ) from exc
        times["rollout"] += time.perf_counter() - t0

        t0 = time.perf_counter()
        texts = tokenizer.batch_decode(out.token_ids, skip_special_tokens=True)
        timeouts_before = reward_fn.timeouts
        local_rewards = reward_fn.batch(texts, [examples[i // r.n].ground_truth for i in range(len(texts))])
        counters["reward_timeouts"] += int(all_sum([reward_fn.timeouts - timeouts_before], device)[0])
        times["reward"] += time.perf_counter() - t0

        rewards = torch.tensor(all_gather_floats(local_rewards, device), dtype=torch.float32)
        # prime: RLOO here as a placeholder; token_adv.apply (after step 4) sets the token-level advantages
        seq_estimator = "rloo" if a.adv_estimator == "prime" else a.adv_estimator
        adv = get_advantage(seq_estimator)(rewards, r.n).view(t.prompts_per_step, r.n)
        keep = torch.ones(t.prompts_per_step, dtype=torch.bool)
        if a.dapo_filter:
            keep = dapo_filter(rewards, r.n).view(t.prompts_per_step, r.n)[:, 0]
        if a.adv_estimator == "prime" and a.prime.acc_filter:
            keep &= prime_keep(rewards, r.n, cfg.reward.kind, a.prime.acc_low, a.prime.acc_high)
        counters["filtered_groups"] += int((~keep).sum())
        batch = n_batches - 1

        def group_id(g: int) -> int:  # global prompt index in this batch -> the group's id
            owner, j = divmod(g, local)
            return owner * span + batch * local + j

        kept += [group_id(g) for g in range(t.prompts_per_step) if keep[g]]
        for i in range(len(prompts)):
            g = rank * local + i // r.n
            if keep[g]:
                pending.setdefault(group_id(g), []).append(Sequence(
                    prompts[i], out.token_ids[i], out.logprobs[i], group_id(g),
                    reward=local_rewards[i], advantage=float(adv[g, i % r.n])))
        all_prompts += prompts
        all_ids += out.token_ids
        all_rewards += local_rewards
        if len(kept) >= t.prompts_per_step or (limit > 0 and n_batches >= limit):
            break
    chosen = sorted(kept[: t.prompts_per_step])
    seqs = [s for gid in chosen for s in pending.get(gid, [])]
    return Collected(seqs, chosen, all_prompts, all_ids, all_rewards, sum(len(x) for x in all_ids), n_batches, times)


class _StopFlag:
    """SIGINT sets a flag the loop checks between steps; a second Ctrl-C interrupts at once."""

    def __init__(self):
        self.set = False
        self._old = None

    def __enter__(self):
        def handler(signum, frame):
            if self.set:
                raise KeyboardInterrupt
            self.set = True
            print("\n[fastcov] Ctrl-C: finishing this step, saving a checkpoint, exiting "
                  "(press again to abort without saving)", flush=True)

        try:
            self._old = signal.signal(signal.SIGINT, handler)
        except ValueError:  # not the main thread
            self._old = None
        return self

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


def train(cfg: Config, resume: bool | str = False, stop_at: int | None = None, on_end=None,
          overwrite: bool = False) -> Path:
    """Run (or resume) training; returns the run directory.

    ``resume``: True for the newest checkpoint of the run, or a checkpoint directory. A fresh run refuses
    a ``trainer.run_dir`` that already holds a run unless ``overwrite``, which moves the old run aside
    (``<run_dir>.old-<time>``); nothing is ever deleted. ``stop_at``: save and stop after that step, as
    Ctrl-C would. ``on_end(policy_engine, rollout_engine)`` is called on every rank after the last step
    (inspection, e.g. by tests). However the run ends (an error included), its metrics file, progress
    bar and reward worker processes are closed.

    Crash safety (docs/reliability.md): each step's metrics row is flushed and fsynced before the
    checkpoint of that step is published (written to a temporary directory, fsynced, renamed), and a
    resume trims metrics.jsonl back to the checkpoint (a torn last line included), so a run killed at any
    moment and resumed ends with the same parameters and one metrics row per step.
    """
    with contextlib.ExitStack() as closing:
        return _train(cfg, resume, stop_at, on_end, closing, overwrite)


@dataclass
class Run:
    """Everything a training run holds between steps (built by ``start_run``)."""

    cfg: Config
    device: torch.device
    rank: int
    world: int
    run_dir: Path
    tokenizer: Any
    train_set: list
    val_set: list
    engine: DeepSpeedPolicy
    rollout: Any
    reward_fn: Any
    token_adv: Any  # REINFORCE++'s KL / PRIME's token-level advantages, or None
    sampler: PromptSampler
    gens: dict[str, torch.Generator]
    lam_sched: Any  # Jin et al.'s λ schedule, or None
    counters: dict[str, int]
    step: int = 0
    entropy_ctl: Any = None  # algo.entropy_control's EntropyController, or None
    logger: Any = None
    pbar: Any = None
    warned: dict[str, bool] = field(default_factory=lambda: {"empty_band": False})
    last_save: float = field(default_factory=lambda: time.monotonic())  # for trainer.save_every_minutes
    synced: bool = False  # a first weight sync has happened (LoRA: later ones send the adapters only)

    @property
    def ckpt_root(self) -> Path:
        return checkpoints_dir(self.run_dir)

    def sync_weights(self) -> int | None:
        """Policy weights -> rollout engine. LoRA: everything once, then the adapters only; returns the
        bytes sent (None without LoRA)."""
        if not self.engine.frozen_base:
            self.rollout.update_weights(self.engine.weight_buckets(self.cfg.rollout.sync_bucket_mb))
            return None
        sent = [0]

        def counted(buckets):
            for bucket in buckets:
                sent[0] += sum(t.numel() * t.element_size() for t in bucket.tensors)
                yield bucket

        self.rollout.update_weights(counted(self.engine.weight_buckets(
            self.cfg.rollout.sync_bucket_mb, trainable_only=self.synced)))
        self.synced = True
        return sent[0]

    def evaluate(self, step: int) -> dict:
        return evaluate(self.rollout, self.val_set, self.reward_fn, self.tokenizer, self.cfg, self.rank,
                        self.world, self.device, step)

    def log_durably(self, rec: dict) -> None:
        """One metrics row, flushed and fsynced (before the step's checkpoint can be published)."""
        if self.logger:
            self.logger.log(rec)
            fsync_path(self.logger.path)

    def trainer_state(self) -> dict:
        return {"step": self.step, "sampler": self.sampler.state_dict(), "counters": self.counters,
                "lambda": self.lam_sched.state_dict() if self.lam_sched is not None else None, "world": self.world,
                **({"entropy_control": self.entropy_ctl.state_dict()} if self.entropy_ctl is not None else {})}


class LostRankError(UserError):
    """A collective failed because another rank went away (its host died, its process was killed) or did not
    answer within ``trainer.collective_timeout_s``: the run stops, exit status 1, naming the lost rank and
    the last intact checkpoint, from which every host resumes."""

    exit_code = 1


@contextlib.contextmanager
def _lost_rank_exit(run: Run):
    """A collective that fails for a lost peer becomes a ``LostRankError``; any other error stays what it was."""
    try:
        yield
    except RuntimeError as exc:
        who = lost_peer(exc, run.rank)
        if who is None:
            raise
        last = latest_checkpoint(run.ckpt_root)
        raise LostRankError(f"lost {who} (at step {run.step}); the last intact checkpoint is "
                            f"{str(last) if last else 'none'}; start every host again with --resume") from None


class RunIOError(UserError):
    """A run file that cannot be written mid-run (disk full, permissions): the run stops, exit status 1,
    with the path and the last intact checkpoint; nothing published is damaged."""

    exit_code = 1


def hold_run_dir(run_dir: Path, rank: int) -> RunDirLock | None:
    """Rank 0 takes the run directory's lock before anything is written; every rank stops with its one-line
    error when it cannot (another live run holds the directory, or it cannot be written)."""
    lock, why, kind = None, "", ""
    if rank == 0 and not (run_dir.exists() and not run_dir.is_dir()):  # a file: check_run_dir says so
        try:
            lock = RunDirLock.acquire(run_dir)
        except UserError as exc:
            why, kind = str(exc), type(exc).__name__
    why, kind = broadcast_text(why), broadcast_text(kind)
    if why:
        raise (RunDirBusy if kind == RunDirBusy.__name__ else UserError)(why)
    return lock


def _check_and_prepare(cfg: Config, resume, overwrite: bool, closing: contextlib.ExitStack):
    """Setup up to the first write. Everything a user can get wrong is checked before it: nothing on disk
    changes when a run stops with a user error (bad run dir, --resume target, model path, data file).
    Returns (device, rank, world, resume_path, tokenizer, train_set, val_set, data_stats)."""
    t = cfg.trainer
    try:
        device = pick_device(t.device)
    except ValueError as exc:
        raise _user_error(exc) from None
    if device.type == "cpu" and t.threads:
        torch.set_num_threads(t.threads)  # results must not depend on the machine's core count
    rank, world = init_distributed(device, t.collective_timeout_s)
    if t.prompts_per_step % world:
        raise ConfigError(f"trainer.prompts_per_step: {t.prompts_per_step} is not divisible by the "
                          f"{world} data-parallel ranks; pick a multiple of {world}")
    run_dir = Path(t.run_dir)
    lock = hold_run_dir(run_dir, rank)
    try:
        setup = _checked_setup(cfg, resume, overwrite, device, rank, world, lock)
    except BaseException:
        if lock is not None:
            lock.abandon()  # a user error leaves the disk as it was
        raise
    if lock is not None:
        closing.callback(lock.release)
    return setup


def _checked_setup(cfg: Config, resume, overwrite: bool, device, rank: int, world: int, lock):
    t = cfg.trainer
    run_dir = Path(t.run_dir)
    resume_path = check_run_dir(run_dir, resume, overwrite, rank)
    check_model_source(cfg.model)
    try:
        use_liger(cfg.model.liger, device)
    except ValueError as exc:
        raise _user_error(exc) from None
    dist.barrier()  # every rank has checked before rank 0 moves or writes anything
    seed_everything(t.seed)  # identical model init on every rank
    try:
        tokenizer = load_tokenizer(cfg.model)
    except ValueError as exc:
        raise _user_error(exc) from None
    if not cfg.data.synthetic.enabled:  # the user's files, read (and checked) before any write
        train_set, val_set, data_stats = load_train_val(cfg, tokenizer, *prepare_data(cfg, tokenizer, run_dir, rank))
    if rank == 0:
        try:
            if prepare_run_dir(run_dir, overwrite) is not None:
                lock.move_to(run_dir)  # the old run went aside with its lock file
        except OSError as exc:
            raise io_error(run_dir, exc) from None
    dist.barrier()
    if cfg.data.synthetic.enabled:
        train_files, val_files = prepare_data(cfg, tokenizer, run_dir, rank)
        dist.barrier()
        train_set, val_set, data_stats = load_train_val(cfg, tokenizer, train_files, val_files)
    return device, rank, world, resume_path, tokenizer, train_set, val_set, data_stats


def _build(cfg: Config, device: torch.device, rank: int, world: int, tokenizer, closing: contextlib.ExitStack):
    """(policy engine, rollout engine, reward function, token-level advantages or None)."""
    try:
        lm = build_model(cfg.model, device, param_dtype(cfg.model, device), tokenizer,
                         ds_config=ds_config(cfg, device, world))
    except ValueError as exc:
        raise _user_error(exc) from None
    # REINFORCE++'s KL reference, PRIME's reference and reward model: copies of the starting weights,
    # taken before DeepSpeed wraps (and under ZeRO-3 shards) the policy (with LoRA no reference copy)
    token_adv = make_token_advantages(cfg, lm)
    engine = DeepSpeedPolicy(PolicyModel(lm), cfg, device, world)
    if token_adv is not None:
        token_adv.bind_policy(engine)  # LoRA: the reference is the policy with its adapters off
    if engine.frozen_base and rank == 0:
        trainable, total = count_parameters(lm)
        base = " on a 4-bit base" if cfg.model.quantization == "4bit" else ""
        print(f"[fastcov] LoRA rank {cfg.model.lora_rank}{base}: {trainable:,} of {total:,} parameters train",
              flush=True)
    # the HF engine samples from the policy's own module (ZeRO 0-2) or one empty copy per node (ZeRO-3)
    rollout = make_rollout_engine(cfg, engine.policy.lm, tokenizer, device=device, rank=rank, world=world,
                                  zero_stage=cfg.trainer.zero_stage)
    reward_fn = REWARD_TASKS.get(cfg.reward.task)(cfg.reward)  # math: \boxed{} answers; code: a sandbox
    closing.callback(reward_fn.close)
    return engine, rollout, reward_fn, token_adv


def _resume(run: Run, path: Path) -> None:
    """Model, optimizer, RNG, data position, counters, λ and PRIME's reward model from a checkpoint."""
    state = load_checkpoint(path, run.engine, run.gens, run.rank)
    run.step = state["step"]
    try:
        run.sampler.load_state_dict(state["sampler"])
        run.counters.update(state["counters"])
        if run.lam_sched is not None:
            run.lam_sched.load_state_dict(state["lambda"])
        if run.entropy_ctl is not None:
            run.entropy_ctl.load_state_dict(state["entropy_control"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"--resume: {str(path)!r} does not fit this run's config or data "
                              f"({type(exc).__name__}: {one_line(exc)})") from None
    if run.token_adv is not None and run.token_adv.prm is not None:
        try:
            run.token_adv.prm.load(path)
        except (OSError, RuntimeError, KeyError, ValueError) as exc:
            raise CheckpointError(f"--resume: PRIME's reward model: {one_line(exc)}") from None
    if run.rank == 0:
        print(f"[fastcov] resumed from {path} at step {run.step}", flush=True)
        trimmed = trim_metrics(metrics_path(run.run_dir), run.step)
        if trimmed["dropped"] or trimmed["torn"]:
            print(f"[fastcov] metrics.jsonl: dropped {trimmed['dropped']} row(s) after step {run.step}"
                  f"{' and a torn last line' if trimmed['torn'] else ''}", flush=True)


def start_run(cfg: Config, resume, overwrite: bool, closing: contextlib.ExitStack) -> Run:
    """Checks, data, policy, rollout engine, rewards, RNG, a resumed state, the metrics log, a progress bar."""
    t, a = cfg.trainer, cfg.algo
    device, rank, world, resume_path, tokenizer, train_set, val_set, data_stats = _check_and_prepare(
        cfg, resume, overwrite, closing)
    engine, rollout, reward_fn, token_adv = _build(cfg, device, rank, world, tokenizer, closing)
    seed_everything(t.seed + 1000 * rank)
    gens = {"sample": torch.Generator(device=device).manual_seed(t.seed * 1_000_003 + rank),
            "select": torch.Generator(device=device).manual_seed(t.seed * 1_000_033 + rank + 17)}
    run = Run(cfg, device, rank, world, Path(t.run_dir), tokenizer, train_set, val_set, engine, rollout, reward_fn,
              token_adv, PromptSampler(len(train_set), t.seed), gens,
              positive_weight_schedule(a) if a.pos_weight_schedule else None,  # Jin et al.'s λ
              {"skipped_steps": 0, "filtered_groups": 0, "reward_timeouts": 0})
    run.entropy_ctl = entropy_control.start(a, rank)  # algo.entropy_control (None when off); KL-Cov's warning
    if resume_path is not None:
        _resume(run, resume_path)
    if rank == 0:
        _open_run_files(run, resume_path is not None, closing)
        print(f"[fastcov] run {run.run_dir}: {len(train_set)} train / {len(val_set)} val prompts "
              f"({json.dumps(data_stats)}), world {world}, device {device}, zero {t.zero_stage}, "
              f"mode {a.mode}", flush=True)
        if t.progress:
            from tqdm.auto import tqdm

            # in a log file (not a terminal) a line every 30 s instead of one per step
            run.pbar = tqdm(total=t.max_steps, initial=run.step, desc=f"train {a.mode}", dynamic_ncols=True,
                            mininterval=0.1 if sys.stderr.isatty() else 30.0)
            closing.callback(run.pbar.close)
    return run


def _open_run_files(run: Run, resumed: bool, closing: contextlib.ExitStack) -> None:
    """Rank 0: config.yaml (rewritten atomically) and the metrics log; one line if the directory refuses."""
    import yaml

    t = run.cfg.trainer
    try:
        write_atomic(run.run_dir / CONFIG, yaml.safe_dump(run.cfg.to_dict(), sort_keys=False).encode())
        run.logger = MetricsLogger(run.run_dir, run.cfg.to_dict(), t.tensorboard, t.wandb, t.wandb_project,
                                   resume_step=run.step if resumed else None)
    except OSError as exc:
        raise io_error(getattr(exc, "filename", None) or run.run_dir, exc) from None
    closing.callback(run.logger.close)


def score_and_update(run: Run, col: Collected, rec: dict) -> tuple[UpdateStats, list[float], float]:
    """Steps 4-6: old log-probs (and token-level advantages), the policy update, the weight sync.
    Returns (update stats, [entropy sum, token count, rollout log-prob gap sum] on this rank, lr)."""
    cfg, a, times = run.cfg, run.cfg.algo, col.times
    pad_id = run.tokenizer.pad_token_id
    t0 = time.perf_counter()
    global_scope = a.scope == "global"  # its first mini-batch's selection reuses these
    shaping = a.entropy_advantage.alpha > 0  # Cheng et al.'s shaping reads the rollout entropies
    old = compute_old_logprobs(run.engine, col.seqs, cfg, pad_id, run.device,
                               keep_entropy=(global_scope and a.high_entropy_fraction is not None) or shaping,
                               keep_vocab_cov=global_scope and a.cov_score == "vocab")
    times["old_logprob"] = time.perf_counter() - t0
    if run.token_adv is not None:  # REINFORCE++ with KL penalty, PRIME: token-level advantages
        t0 = time.perf_counter()
        rec.update(run.token_adv.apply(col.seqs, pad_id, run.device, batching(cfg, run.engine)))
        times["token_rewards"] = time.perf_counter() - t0
    if rollout_correction_enabled(cfg):
        rec.update(correct_rollouts(col.seqs, cfg, run.device))
    if shaping:  # A_t + min(alpha * H_t, |A_t| / kappa); logs entropy_advantage/bonus
        rec.update(entropy_control.shape_advantages(col.seqs, a, run.device))
    t0 = time.perf_counter()
    rec["lambda"] = run.lam_sched.value if run.lam_sched is not None else a.pos_adv_weight
    lr = lr_at(run.engine.steps, cfg.optim, cfg.trainer.max_steps * a.ppo_epochs * a.mini_batches)
    loss_cfg = entropy_control.controlled(loss_config(a, pos_adv_weight=rec["lambda"]), run.entropy_ctl)
    upd = update_policy(run.engine, col.seqs, col.kept_groups, cfg, loss_cfg, lr, pad_id, run.device,
                        run.gens["select"])
    if upd.skipped_steps:
        run.counters["skipped_steps"] += upd.skipped_steps
        if run.rank == 0:
            warnings.warn(f"step {run.step}: non-finite loss or gradient; {upd.skipped_steps} optimizer "
                          f"step(s) skipped ({run.counters['skipped_steps']} so far)", stacklevel=1)
    times["update"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    sync_bytes = run.sync_weights()
    times["sync"] = time.perf_counter() - t0
    if sync_bytes is not None:
        rec["sync_bytes"] = sync_bytes
    return upd, list(old), lr


def step_metrics(run: Run, col: Collected, upd: UpdateStats, old: list[float], lr: float, rec: dict) -> float:
    """Step 7: the step's metrics over all ranks into ``rec``; returns the prompt + response tokens."""
    cfg, a = run.cfg, run.cfg.algo
    resp_lens = [len(x) for x in col.token_ids]
    (r_sum, r_n, len_sum, e_sum, tk_sum, d_sum, p_sum, m_n, l_sum) = all_sum(
        [sum(col.rewards), len(col.rewards), sum(resp_lens), *old[:3], sum(len(p) for p in col.prompts),
         float(upd.metric_tokens), upd.loss_sum], run.device)
    # rollout/policy mismatch (diagnostics only): max and mean |rollout log-prob - policy's| over all ranks
    d_max = all_reduce_(torch.tensor([old[3]], dtype=torch.float64, device=run.device), "max").item()
    mvals = all_sum([upd.metric_sums.get(k, 0.0) for k in LOSS_METRICS], run.device)
    reward = r_sum / max(r_n, 1)
    rec.update({
        "reward_mean": reward, "acc_mean": reward if cfg.reward.kind == "binary" else (reward + 1) / 2,
        "entropy": e_sum / max(tk_sum, 1), "response_len": len_sum / max(r_n, 1),
        "rollout_logprob_diff": d_sum / max(tk_sum, 1), "rollout_logprob_diff_mean": d_sum / max(tk_sum, 1),
        "rollout_logprob_diff_max": d_max, "loss": l_sum / max(a.ppo_epochs * upd.n_mini, 1),
        "lr": lr, "grad_norm": float(np.mean(upd.grad_norms)) if upd.grad_norms else None,
        "applied_steps": upd.applied_steps,
        **{LOSS_METRIC_NAMES.get(k, k): v / max(m_n, 1) for k, v in zip(LOSS_METRICS, mvals)},
        **run.counters,
    })
    sel = rec["selected_frac"]
    if a.mode == "clip_cov" and sel == 0 and run.rank == 0 and not run.warned["empty_band"]:
        run.warned["empty_band"] = True
        warnings.warn(
            f"step {run.step}: Clip-Cov selected no token: no selection score fell in the band "
            f"({a.clip_cov_lb:g}, {a.clip_cov_ub:g}) (cov_score={a.cov_score}: mean {rec['cov_mean']:.3g}, "
            f"max {rec['cov_max']:.3g} this step); widen algo.clip_cov_lb/clip_cov_ub to the scores' scale "
            "(said once per run)", stacklevel=1)
    if sel > 0:  # which tokens Clip-Cov/KL-Cov acted on: advantage sign, probability, covariance
        rec["sel/tokens_per_update"] = sel * m_n / max(a.ppo_epochs * upd.n_mini, 1)
        rec["sel/pos_adv_share"] = rec["selected_pos_adv"] / sel
        rec["sel/mean_prob"] = rec["selected_prob"] / sel
        rec["sel/mean_cov"] = rec["selected_cov"] / sel
    rec.update(selection_diagnostics(run, upd, sel, m_n))
    if run.lam_sched is not None:
        run.lam_sched.step(entropy=rec["entropy"])
    entropy_control.after_step(run.entropy_ctl, rec["entropy"], rec)  # entropy_control/value, /error
    return p_sum + len_sum


def selection_diagnostics(run: Run, upd: UpdateStats, sel: float, m_n: float) -> dict:
    """sel/mean_pos (global scope: the selected tokens' mean relative position in their response) and, for a
    random control, sel/jaccard_vs_cov: |control ∩ c_t's pick| / |control ∪ c_t's pick|, pooled over the step."""
    a = run.cfg.algo
    both, either, pos = all_sum([upd.metric_sums.get(k, 0.0) for k in SELECTION_DIAGNOSTICS], run.device)
    out = {}
    if sel > 0 and a.scope == "global":
        out["sel/mean_pos"] = pos / (sel * max(m_n, 1))
    if a.cov_score in ("random", "random_matched") and either > 0:
        out["sel/jaccard_vs_cov"] = both / either
    return out


def _save_is_due(run: Run) -> bool:
    """``trainer.save_every_minutes`` since the last checkpoint (rank 0's clock decides for every rank)."""
    minutes = run.cfg.trainer.save_every_minutes
    if not minutes:
        return False
    due = run.rank == 0 and time.monotonic() - run.last_save >= 60.0 * minutes
    return all_max(int(due), run.device) > 0


@contextlib.contextmanager
def _run_io(run: Run, what: str):
    """An OSError while writing ``what`` stops the run with one line: the path, why, the last intact
    checkpoint (temporary checkpoints are never published, so nothing published is damaged)."""
    try:
        yield
    except OSError as exc:
        last = latest_checkpoint(run.ckpt_root)
        raise RunIOError(f"{what}: cannot write {str(getattr(exc, 'filename', None) or run.run_dir)!r} "
                         f"({exc.strerror or exc}); the last intact checkpoint is "
                         f"{str(last) if last else 'none'}; fix the disk, then --resume") from None


def end_step(run: Run, rec: dict, col: Collected, tokens: float, t_step: float, stop_now: bool) -> None:
    """Steps 8-9: evaluation, then the checkpoint in two phases around the metrics row. The step's row is
    on disk before its checkpoint is: a crash in between resumes from the previous checkpoint and trims
    the row, so no step is lost or logged twice."""
    t, times, step = run.cfg.trainer, col.times, run.step
    if t.eval_every and run.val_set and (step % t.eval_every == 0 or step == t.max_steps):
        t0 = time.perf_counter()
        rec.update(run.evaluate(step))
        times["eval"] = time.perf_counter() - t0
    pending = None
    if step == t.max_steps or stop_now or (t.save_every and step % t.save_every == 0) or _save_is_due(run):
        t0 = time.perf_counter()
        with _run_io(run, f"the checkpoint of step {step}"):
            pending = write_checkpoint(run.ckpt_root, step, run.engine, run.trainer_state(), run.gens, run.rank)
            if run.token_adv is not None and run.token_adv.prm is not None and run.rank == 0:
                run.token_adv.prm.save(pending)  # identical on every rank (averaged gradients)
        run.last_save = time.monotonic()
        times["save"] = time.perf_counter() - t0
    dt = time.perf_counter() - t_step
    rec.update({f"time/{k}": v for k, v in times.items()})
    rec.update({"time/step": dt, "tokens_per_s": tokens / dt,
                "tokens_per_s/rollout": all_sum([float(col.n_generated)], run.device)[0] / max(times["rollout"], 1e-9)})
    with _run_io(run, f"the metrics row of step {step}"):
        run.log_durably(rec)
        if pending is not None:
            publish_checkpoint(pending, t.keep_last, run.rank)
    if run.pbar is not None:
        run.pbar.set_postfix(reward=f"{rec['reward_mean']:.3f}", H=f"{rec['entropy']:.3f}",
                             **({"val": f"{rec['val_acc']:.3f}"} if "val_acc" in rec else {}),
                             refresh=False)  # update() redraws, at most every mininterval
        run.pbar.update(1)


def _train(cfg: Config, resume, stop_at, on_end, closing: contextlib.ExitStack, overwrite: bool = False) -> Path:
    """The loop: rollouts → rewards → advantages → old log-probs → update → sync → metrics → eval → checkpoint."""
    run = start_run(cfg, resume, overwrite, closing)
    t = cfg.trainer
    with _lost_rank_exit(run):
        run.sync_weights()
        if run.step == 0 and t.eval_every and run.val_set:
            run.log_durably({"step": 0, **run.evaluate(0)})
    with _StopFlag() as stop, _lost_rank_exit(run):
        while run.step < t.max_steps:
            run.step += 1
            t_step = time.perf_counter()
            # 1-3. rollouts, rewards, advantages (with DAPO's filter: refills until prompts_per_step groups)
            col = collect_rollouts(cfg, run.step, run.sampler, run.train_set, run.rollout, run.reward_fn,
                                   run.tokenizer, run.gens["sample"], run.counters, run.rank, run.device,
                                   run.ckpt_root)
            rec: dict = {"step": run.step, "kept_groups": len(col.kept_groups), "gen_batches": col.gen_batches}
            upd, old, lr = score_and_update(run, col, rec)  # 4-6. old log-probs, update, weight sync
            tokens = step_metrics(run, col, upd, old, lr, rec)  # 7. metrics over all ranks
            stop_now = all_sum([1.0 if stop.set else 0.0], run.device)[0] > 0 or run.step == stop_at
            end_step(run, rec, col, tokens, t_step, stop_now)  # 8-9. evaluation, checkpoint, log
            if stop_now:
                if run.rank == 0:
                    print(f"[fastcov] stopped at step {run.step}; checkpoint saved", flush=True)
                break
    if run.pbar is not None:
        run.pbar.close()  # before on_end and the export print; closing again is a no-op
    if on_end is not None:
        on_end(run.engine, run.rollout)
    if run.step == t.max_steps:
        with _lost_rank_exit(run):
            with run.engine.gathered_model() as model:
                if run.rank == 0:
                    export_final(model, run.tokenizer, run.run_dir)
            dist.barrier()
    return run.run_dir

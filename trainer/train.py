"""The training loop, top to bottom: each step is a function of ``run`` (built by trainer/start.py), in the order the
loop calls them, and ``_train`` at the bottom is the loop.

    prompts -> n rollouts each -> rewards -> advantages -> (DAPO filter) -> old log-probs
    -> ppo_epochs x mini-batches x token-budget micro-batches of fastcov.policy_loss -> weight sync
    -> metrics, evaluation, checkpoints

Steps 1-3 ``collect_rollouts`` (with DAPO's refill); 4 ``old_logprobs`` (then the token-level advantages, the
rollout correction, the entropy shaping); 5 ``update``; 6 ``sync_weights``; 7 ``step_metrics``; then
``after_step`` moves λ and the entropy controller for the next step (trainer/controls.py); 8-9 ``end_step``
(evaluation, checkpoint, the metrics row). Each step hands the next a typed record and writes its metrics into the
step's ``StepRow`` (trainer/records.py), so the row's entries come in the order the steps run. Tests call
``compute_old_logprobs`` and ``update_policy`` with fixed rollouts. In ``algo.scope: global`` (the default)
Clip-Cov/KL-Cov select tokens once per mini-batch over all ranks (trainer/mini_batch.py), so the update does not
depend on the micro-batch split or the number of ranks.

``train(cfg)`` runs in every data-parallel process (one on CPU without a launcher). Every tensor that
reaches the loss comes from ``fastcov.linear_logprob_entropy`` on the last hidden states: full logits
are never built.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from fastcov.advantages import dapo_filter, get_advantage
from fastcov.losses import LossConfig, Selection, get_policy_loss, policy_loss
from fastcov.trainer.config import Config
from fastcov.trainer.controls import after_step, rollout_correction_enabled, shape_advantages, step_loss_config
from fastcov.trainer.evaluation import evaluate_run
from fastcov.trainer.mini_batch import (
    batching,
    forward,
    mini_batch_selection,
    mini_batch_weights,
    selected_position_sum,
)
from fastcov.trainer.records import (
    LOSS_METRIC_NAMES,
    LOSS_METRICS,
    SELECTION_DIAGNOSTICS,
    Collected,
    OldLogprobStats,
    StepRow,
    StepSums,
    UpdateStats,
)
from fastcov.trainer.rollout.engine_process import engine_failure
from fastcov.trainer.rollout.staleness import request
from fastcov.trainer.rollout_correction import correct_rollouts
from fastcov.trainer.runtime.batch import Sequence, micro_batches
from fastcov.trainer.runtime.checkpoint import fsync_path, publish_checkpoint, write_checkpoint
from fastcov.trainer.runtime.distributed import all_gather_floats, all_reduce_, all_sum, world_size
from fastcov.trainer.runtime.errors import RolloutError, StopFlag, last_intact, lost_rank_exit, run_io
from fastcov.trainer.runtime.hub import push_to_hub
from fastcov.trainer.runtime.model import export_final
from fastcov.trainer.runtime.offload import activation_offload
from fastcov.trainer.runtime.policy import lr_at
from fastcov.trainer.runtime.run_dir import save_is_due
from fastcov.trainer.runtime.weight_buckets import counted
from fastcov.trainer.start import Run, start_run
from fastcov.trainer.timeline import flush_timeline
from fastcov.trainer.token_level.advantages import (
    TOKEN_LEVEL_ESTIMATORS,
    optimal_token_baseline_advantages,
    prime_keep,
)

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------- steps 1-3

def collect_rollouts(run: Run, row: StepRow) -> Collected:
    """Steps 1-3: sample prompts, generate ``rollout.n`` responses each, score them, compute advantages
    and drop the groups the filters reject (DAPO: all rewards equal; PRIME: accuracy out of band).

    With ``algo.dapo_filter`` and ``algo.max_gen_batches`` != 1 this repeats with fresh prompts until
    ``prompts_per_step`` groups are kept (verl's dynamic sampling): the first ``prompts_per_step`` kept
    groups in generation order are trained on; a step still short after ``max_gen_batches`` batches
    trains on what it has. Advantages are computed per generated batch. Every rank must call it.
    ``run.source`` (rollout.async's, trainer/rollout/staleness.py) hands out the generated batches instead
    (the "rollout" time is then the wait for them) and is told when the step's rollouts are collected.
    """
    cfg, step, rank, device, source = run.cfg, run.step, run.rank, run.device, run.source
    t, a, r = cfg.trainer, cfg.algo, cfg.rollout
    world = world_size()
    local = t.prompts_per_step // world
    limit = a.max_gen_batches if a.dapo_filter else 1
    span = local * (limit if limit > 0 else 1_000_000)  # group ids: rank-major, then batch, then prompt
    kept: list[int] = []  # group ids of the kept groups, in generation order
    pending: dict[int, list[Sequence]] = {}
    all_prompts, all_ids, all_rewards = [], [], []
    n_batches = 0
    version = None
    while True:
        n_batches += 1
        with row.timed("rollout"):
            try:
                if source is not None:
                    drawn = source.draw(step, n_batches)
                    examples, prompts, out, version = drawn.examples, drawn.prompts, drawn.out, drawn.version
                else:  # the same global order of prompts on every rank; rollout.seeding per_sample: one seed each
                    examples, prompts, sampling = request(cfg, run.sampler.next(t.prompts_per_step), run.train_set,
                                                          rank, world, step, n_batches)
                    sampling.seeds = sampling.seeds if r.seeding == "per_sample" else None
                    out = run.rollout.generate(prompts, sampling, run.gens["sample"])
            except Exception as exc:
                raise RolloutError(f"rollout engine failed at step {step}: {type(exc).__name__}: {exc}; the last "
                                   f"intact checkpoint is {last_intact(run.ckpt_root)}; resume with --resume") from exc
        with row.timed("reward"):
            texts = run.tokenizer.batch_decode(out.token_ids, skip_special_tokens=True)
            timeouts_before = run.reward_fn.timeouts
            local_rewards = run.reward_fn.batch(texts, [examples[i // r.n].ground_truth for i in range(len(texts))])
            run.counters["reward_timeouts"] += int(all_sum([run.reward_fn.timeouts - timeouts_before], device)[0])

        rewards = torch.tensor(all_gather_floats(local_rewards, device), dtype=torch.float32)
        # prime, optimal_token_baseline: RLOO here as a placeholder; the token-level advantages are set after step 4
        seq_estimator = "rloo" if a.adv_estimator in TOKEN_LEVEL_ESTIMATORS else a.adv_estimator
        adv = get_advantage(seq_estimator)(rewards, r.n).view(t.prompts_per_step, r.n)
        keep = torch.ones(t.prompts_per_step, dtype=torch.bool)
        if a.dapo_filter:
            keep = dapo_filter(rewards, r.n).view(t.prompts_per_step, r.n)[:, 0]
        if a.adv_estimator == "prime" and a.prime.acc_filter:
            keep &= prime_keep(rewards, r.n, cfg.reward.kind, a.prime.acc_low, a.prime.acc_high)
        run.counters["filtered_groups"] += int((~keep).sum())
        batch = n_batches - 1

        def group_id(g: int, batch: int = batch) -> int:  # global prompt index in this batch -> the group's id
            owner, j = divmod(g, local)
            return owner * span + batch * local + j

        kept += [group_id(g) for g in range(t.prompts_per_step) if keep[g]]
        for i in range(len(prompts)):
            g = rank * local + i // r.n
            if keep[g]:
                pending.setdefault(group_id(g), []).append(Sequence(
                    prompts[i], out.token_ids[i], out.logprobs[i], group_id(g),
                    reward=local_rewards[i], advantage=float(adv[g, i % r.n]), policy_version=version,
                    temperature=r.temperature))
        all_prompts += prompts
        all_ids += out.token_ids
        all_rewards += local_rewards
        if len(kept) >= t.prompts_per_step or (limit > 0 and n_batches >= limit):
            break
    if source is not None:
        source.collected(step)  # one_step: the next step's batch starts generating
    chosen = sorted(kept[: t.prompts_per_step])
    row.metrics.update({"kept_groups": len(chosen), "gen_batches": n_batches})
    seqs = [s for gid in chosen for s in pending.get(gid, [])]
    return Collected(seqs, chosen, all_prompts, all_ids, all_rewards, sum(len(x) for x in all_ids), n_batches)


# ---------------------------------------------------------------------------------------- step 4

def compute_old_logprobs(engine, seqs: list[Sequence], cfg: Config, pad_id: int, device: torch.device,
                         keep_entropy: bool = False, keep_vocab_cov: bool = False, keep_sum_p2: bool = False
                         ) -> OldLogprobStats:
    """Fill ``old_logprob`` of every sequence (and ``old_entropy`` / ``old_vocab_cov`` / ``old_sum_p2`` when asked)
    with a no-grad pass over token-budget micro-batches: the policy before the update against the rollout
    engine's log-probs, summed over this rank's sequences. Every rank must call it."""
    engine.eval()
    ent_sum = tok_sum = lp_diff = lp_diff_max = 0.0
    with torch.no_grad():
        for mb in micro_batches(seqs, pad_id=pad_id, device=device, **batching(cfg, engine, no_grad=True)):
            res = forward(engine, mb, cfg.rollout.temperature, vocab_cov=keep_vocab_cov, sum_p2=keep_sum_p2)
            if mb.weight == 0:
                continue
            for si, (row, start, n) in zip(mb.seq_index, mb.spans, strict=True):
                s = seqs[si]
                lp = res.logprob[row, start : start + n].float()
                ent = res.entropy[row, start : start + n].float()
                s.old_logprob = lp.tolist()
                if keep_entropy:
                    s.old_entropy = ent.tolist()
                if keep_vocab_cov:
                    s.old_vocab_cov = res.vocab_cov[row, start : start + n].float().tolist()
                if keep_sum_p2:
                    s.old_sum_p2 = res.sum_p2[row, start : start + n].float().tolist()
                ent_sum += float(ent.sum())
                gap = (lp - torch.tensor(s.sample_logprob, device=lp.device)).abs()
                lp_diff += float(gap.sum())
                lp_diff_max = max(lp_diff_max, float(gap.max())) if n else lp_diff_max
                tok_sum += n
    return OldLogprobStats(ent_sum, tok_sum, lp_diff, lp_diff_max)


def old_logprobs(run: Run, col: Collected, row: StepRow) -> OldLogprobStats:
    """Step 4: the old log-probs (``compute_old_logprobs``), then what needs them: the token-level advantages
    (REINFORCE++'s KL, PRIME, the Optimal Token Baseline), the rollout correction's weights and Cheng et al.'s
    entropy shaping, each logging its metrics."""
    cfg, a, pad_id = run.cfg, run.cfg.algo, run.tokenizer.pad_token_id
    global_scope = a.scope == "global"  # its first mini-batch's selection reuses these
    shaping = a.entropy_advantage.alpha > 0  # Cheng et al.'s shaping reads the rollout entropies
    with row.timed("old_logprob"):
        old = compute_old_logprobs(run.engine, col.seqs, cfg, pad_id, run.device,
                                   keep_entropy=(global_scope and a.loss.high_entropy_fraction is not None) or shaping,
                                   keep_vocab_cov=global_scope and a.loss.cov_score == "vocab",
                                   keep_sum_p2=a.adv_estimator == "optimal_token_baseline")
    if run.token_adv is not None:  # REINFORCE++ with KL penalty, PRIME: token-level advantages
        with row.timed("token_rewards"):
            row.metrics.update(run.token_adv.apply(col.seqs, pad_id, run.device, batching(cfg, run.engine)))
    if rollout_correction_enabled(cfg):
        row.metrics.update(correct_rollouts(col.seqs, cfg, run.device))
    if a.adv_estimator == "optimal_token_baseline":  # needs the old log-probs, Σπ² and the rollout weights
        row.metrics.update(optimal_token_baseline_advantages(col.seqs, run.device))
    if shaping:  # A_t + min(alpha * H_t, |A_t| / kappa); logs entropy_advantage/bonus
        row.metrics.update(shape_advantages(col.seqs, a, run.device))
    return old


# ---------------------------------------------------------------------------------------- step 5

def update_policy(engine, seqs: list[Sequence], kept_groups: list[int], cfg: Config, loss_cfg: LossConfig,
                  lr: float, pad_id: int, device: torch.device, generator: torch.Generator) -> UpdateStats:
    """ppo_epochs × mini-batches × token-budget micro-batches of ``policy_loss``, one optimizer step per mini-batch.

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
    stats = UpdateStats(n_mini=n_mini, lr=lr)
    for epoch in range(a.ppo_epochs):
        for m, chunk in enumerate(group_chunks):
            cset = set(chunk)
            mini = [s for s in seqs if s.group in cset]
            local_tok = sum(len(s.response) for s in mini)
            g_tok, g_seq = all_sum([local_tok, len(mini)], device)
            mbs = micro_batches(mini, pad_id=pad_id, device=device, **batching(cfg, engine))
            selection, rollout_weights = None, mini_batch_weights(mini, device)
            if global_scope and needs_selection:
                # bypass: old_logprob is the rollout's, not the current policy's (a forward gives those)
                selection = mini_batch_selection(engine, mini, mbs, cfg, loss_cfg, device, generator, group,
                                                 reuse_old=epoch == 0 and m == 0 and not a.rollout_correction.bypass)
                stats.metric_sums["selected_pos"] = (stats.metric_sums.get("selected_pos", 0.0)
                                                     + selected_position_sum(selection.cov, mini))
            poisoned = False
            for j, mb in enumerate(mbs):
                with offloaded():
                    res = forward(engine, mb, cfg.rollout.temperature, vocab_cov=a.loss.cov_score == "vocab")
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
                poisoned |= all_sum([0.0 if bool(torch.isfinite(loss)) else 1.0], device)[0] > 0  # on any rank
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


def update(run: Run, col: Collected, row: StepRow) -> UpdateStats:
    """Step 5: the update with this step's loss settings (λ and the controlled knob, trainer/controls.py) at the
    scheduled learning rate; a skipped optimizer step (non-finite loss or gradient) is counted and said."""
    cfg, a = run.cfg, run.cfg.algo
    with row.timed("update"):
        loss_cfg = step_loss_config(run)
        row.metrics["lambda"] = loss_cfg.pos_adv_weight  # the λ this update uses
        lr = lr_at(run.engine.steps, cfg.optim, cfg.trainer.max_steps * a.ppo_epochs * a.mini_batches)
        upd = update_policy(run.engine, col.seqs, col.kept_groups, cfg, loss_cfg, lr, run.tokenizer.pad_token_id,
                            run.device, run.gens["select"])
        if upd.skipped_steps:
            run.counters["skipped_steps"] += upd.skipped_steps
            if run.rank == 0:
                warnings.warn(f"step {run.step}: non-finite loss or gradient; {upd.skipped_steps} optimizer "
                              f"step(s) skipped ({run.counters['skipped_steps']} so far)", stacklevel=1)
    return upd


# ---------------------------------------------------------------------------------------- step 6

def sync_weights(run: Run, row: StepRow | None = None) -> None:
    """Step 6 (and once before step 1): the policy's weights to the rollout engine; LoRA: everything once, then the
    adapters only (logged as ``sync_bytes``). Asynchronous rollouts: when the source says a push is due (first the
    batch in flight finishes with the old weights), the engine then holding this step's weights."""
    with row.timed("sync") if row is not None else contextlib.nullcontext():
        sent = None
        if run.source is None:
            sent = _push(run, {})
        elif not run.pushed or run.source.push_due(run.step):
            with engine_failure(run.step, run.ckpt_root):
                run.source.before_push(run.step)
                if run.source.engine.restarted:  # a restarted engine process holds some step's weights: resend all
                    run.synced, run.source.engine.restarted = False, False
                run.pushed = True
                sent = _push(run, {"version": run.step})
    if sent is not None and row is not None:
        row.metrics["sync_bytes"] = sent


def _push(run: Run, push: dict) -> int | None:
    """One push of weight buckets; the bytes sent with LoRA (the first push whole, then the trainable ones)."""
    bucket_mb = run.cfg.rollout.sync_bucket_mb
    if not run.engine.frozen_base:
        run.rollout.update_weights(run.engine.weight_buckets(bucket_mb), **push)
        return None
    sent = [0]  # bytes, added up as the buckets go
    run.rollout.update_weights(counted(run.engine.weight_buckets(bucket_mb, trainable_only=run.synced), sent), **push)
    run.synced = True
    return sent[0]


# ---------------------------------------------------------------------------------------- step 7

def step_metrics(run: Run, col: Collected, old: OldLogprobStats, upd: UpdateStats, row: StepRow) -> StepSums:
    """Step 7: the step's metrics over all ranks into the row; returns the sums they divide."""
    cfg, a, metrics = run.cfg, run.cfg.algo, row.metrics
    # rollout.async: staleness, queue depth (its dropped samples go into the counters logged below)
    async_rec = run.source.step_metrics() if run.source is not None else {}
    s = StepSums.reduced(col, old, upd, run.device)
    # rollout/policy mismatch (diagnostics only): max and mean |rollout log-prob - policy's| over all ranks
    gap_max = all_reduce_(torch.tensor([old.gap_max], dtype=torch.float64, device=run.device), "max").item()
    mvals = all_sum([upd.metric_sums.get(k, 0.0) for k in LOSS_METRICS], run.device)
    reward, updates = s.reward / max(s.responses, 1), max(a.ppo_epochs * upd.n_mini, 1)
    metrics.update({
        "reward_mean": reward, "acc_mean": reward if cfg.reward.kind == "binary" else (reward + 1) / 2,
        "entropy": s.entropy / max(s.scored_tokens, 1), "response_len": s.response_tokens / max(s.responses, 1),
        "rollout_logprob_diff": s.logprob_gap / max(s.scored_tokens, 1),
        "rollout_logprob_diff_mean": s.logprob_gap / max(s.scored_tokens, 1),
        "rollout_logprob_diff_max": gap_max, "loss": s.loss / updates,
        "lr": upd.lr, "grad_norm": float(np.mean(upd.grad_norms)) if upd.grad_norms else None,
        "applied_steps": upd.applied_steps,
        **{LOSS_METRIC_NAMES.get(k, k): v / max(s.update_tokens, 1) for k, v in zip(LOSS_METRICS, mvals, strict=True)},
        **run.counters, **async_rec,
    })
    sel = metrics["selected_frac"]
    if a.mode == "clip_cov" and sel == 0 and run.rank == 0 and not run.warned["empty_band"]:
        run.warned["empty_band"] = True
        warnings.warn(
            f"step {run.step}: Clip-Cov selected no token: no selection score fell in the band "
            f"({a.loss.clip_cov_lb:g}, {a.loss.clip_cov_ub:g}) (cov_score={a.loss.cov_score}: "
            f"mean {metrics['cov_mean']:.3g}, "
            f"max {metrics['cov_max']:.3g} this step); widen algo.loss.clip_cov_lb/clip_cov_ub to the scores' scale "
            "(said once per run)", stacklevel=1)
    if sel > 0:  # which tokens Clip-Cov/KL-Cov acted on: advantage sign, probability, covariance
        metrics["sel/tokens_per_update"] = sel * s.update_tokens / updates
        metrics["sel/pos_adv_share"] = metrics["selected_pos_adv"] / sel
        metrics["sel/mean_prob"] = metrics["selected_prob"] / sel
        metrics["sel/mean_cov"] = metrics["selected_cov"] / sel
    # the selected tokens' mean relative position in their response; a random control's overlap |R ∩ C| / |R ∪ C|
    both, either, pos = all_sum([upd.metric_sums.get(k, 0.0) for k in SELECTION_DIAGNOSTICS], run.device)
    if sel > 0 and a.scope == "global":
        metrics["sel/mean_pos"] = pos / (sel * max(s.update_tokens, 1))
    if a.loss.cov_score in ("random", "random_matched") and either > 0:
        metrics["sel/jaccard_vs_cov"] = both / either
    return s


# ---------------------------------------------------------------------------------------- steps 8 and 9

def end_step(run: Run, row: StepRow, col: Collected, sums: StepSums, stop_now: bool) -> None:
    """Steps 8-9: evaluation, then the checkpoint in two phases around the metrics row. The step's row is
    on disk before its checkpoint is: a crash in between resumes from the previous checkpoint and trims
    the row, so no step is lost or logged twice."""
    t, times, step, rec = run.cfg.trainer, row.times, run.step, row.metrics
    if run.eval_due(step):
        with row.timed("eval"):
            rec.update(evaluate_run(run, step))
    pending = None
    if (step == t.max_steps or stop_now or (t.save_every and step % t.save_every == 0)
            or save_is_due(t.save_every_minutes, run.last_save, run.rank, run.device)):
        with row.timed("save"):
            with run_io(run, f"the checkpoint of step {step}"):
                pending = write_checkpoint(run.ckpt_root, step, run.engine, run.trainer_state(), run.gens,
                                           run.rank)
                if run.token_adv is not None and run.token_adv.prm is not None and run.rank == 0:
                    run.token_adv.prm.save(pending)  # identical on every rank (averaged gradients)
                if run.source is not None:
                    run.source.save(pending)  # rollout.async one_step: this rank's finished batch of the next step
            run.last_save = time.monotonic()
    dt = time.perf_counter() - row.started
    rec.update({f"time/{k}": v for k, v in times.items()})
    rec.update({"time/step": dt, "tokens_per_s": (sums.prompt_tokens + sums.response_tokens) / dt,
                "tokens_per_s/rollout": all_sum([float(col.n_generated)], run.device)[0] / max(times["rollout"], 1e-9)})
    with run_io(run, f"the metrics row of step {step}"):
        log_durably(run, rec)
        flush_timeline(step)  # trainer.timeline: the step's phase spans
        if pending is not None:
            publish_checkpoint(pending, t.keep_last, run.rank)
    if run.pbar is not None:
        run.pbar.set_postfix(reward=f"{rec['reward_mean']:.3f}", H=f"{rec['entropy']:.3f}",
                             **({"val": f"{rec['val_acc']:.3f}"} if "val_acc" in rec else {}),
                             refresh=False)  # update() redraws, at most every mininterval
        run.pbar.update(1)


def log_durably(run: Run, rec: dict) -> None:
    """Step 9: one metrics row, flushed and fsynced (before the step's checkpoint can be published)."""
    if run.logger:
        run.logger.log(rec)
        fsync_path(run.logger.path)


# ---------------------------------------------------------------------------------------- the loop

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


def _train(cfg: Config, resume, stop_at, on_end, closing: contextlib.ExitStack, overwrite: bool = False) -> Path:
    """The loop: rollouts → rewards → advantages → old log-probs → update → sync → metrics → eval → checkpoint."""
    run = start_run(cfg, resume, overwrite, closing)
    t = cfg.trainer
    with lost_rank_exit(run):
        sync_weights(run)  # the rollout engine starts from the policy's weights
        if run.step == 0 and t.eval_every and run.val_set:
            log_durably(run, {"step": 0, **evaluate_run(run, 0)})
    with StopFlag() as stop, lost_rank_exit(run):
        while run.step < t.max_steps:
            run.step += 1
            row = StepRow({"step": run.step})
            col = collect_rollouts(run, row)  # 1-3. rollouts, rewards, advantages (DAPO: refills, then filters)
            old = old_logprobs(run, col, row)  # 4. old log-probs; token-level advantages, correction, shaping
            upd = update(run, col, row)  # 5. ppo_epochs x mini-batches x micro-batches of policy_loss
            sync_weights(run, row)  # 6. the policy's weights to the rollout engine
            sums = step_metrics(run, col, old, upd, row)  # 7. the metrics, over all ranks
            row.metrics.update(after_step(run, row.metrics["entropy"]))  # λ, the entropy controller: for step + 1
            stop_now = all_sum([1.0 if stop.set else 0.0], run.device)[0] > 0 or run.step == stop_at
            end_step(run, row, col, sums, stop_now)  # 8-9. evaluation, checkpoint, the metrics row
            if stop_now:
                if run.rank == 0:
                    logger.info(f"stopped at step {run.step}; checkpoint saved")
                break
    if run.pbar is not None:
        run.pbar.close()  # before on_end and the export print; closing again is a no-op
    if on_end is not None:
        on_end(run.engine, run.rollout)
    if run.step == t.max_steps:
        with lost_rank_exit(run):
            with run.engine.gathered_model() as model:
                if run.rank == 0:
                    export_final(model, run.tokenizer, run.run_dir)
            dist.barrier()
        if t.push_to_hub and run.rank == 0:  # after the barrier: the other ranks wait for no upload
            logger.info(f"pushed final/ to {t.push_to_hub}: {push_to_hub(run.run_dir, t.push_to_hub)}")
    return run.run_dir

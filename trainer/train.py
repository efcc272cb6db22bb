"""The training loop, top to bottom: each step is a function, in the order the loop calls them, and ``_train``
at the bottom is the loop.

    prompts -> n rollouts each -> rewards -> advantages -> (DAPO filter) -> old log-probs
    -> ppo_epochs x mini-batches x token-budget micro-batches of fastcov.policy_loss -> weight sync
    -> metrics, evaluation, checkpoints

Steps 1-3 ``collect_rollouts`` (with DAPO's refill); 4 ``compute_old_logprobs`` (then trainer/rollout_correction.py);
5 ``update_policy``; 4-6 together ``logprobs_update_sync`` (with the weight sync); 7 ``step_metrics``
(trainer/step_metrics.py); 8-9 ``end_step`` (evaluation, checkpoint, the metrics row). The set-up before step 1
(``start_run``) and ``Run``, the state carried between steps, are in trainer/start.py. Tests call
``compute_old_logprobs`` and ``update_policy`` with fixed rollouts. In ``algo.scope: global`` (the default)
Clip-Cov/KL-Cov select tokens once per mini-batch over all ranks (``mini_batch_selection``), so the update
does not depend on the micro-batch split or the number of ranks. Micro-batches are padded or, with
``trainer.packing``, packed (trainer/runtime/batch.py).

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
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from fastcov.advantages import dapo_filter, get_advantage
from fastcov.losses import LossConfig, Selection, compute_global_selection, get_policy_loss, policy_loss
from fastcov.trainer import entropy_control
from fastcov.trainer.config import Config
from fastcov.trainer.controls import loss_config, rollout_correction_enabled
from fastcov.trainer.rollout import SamplingParams
from fastcov.trainer.rollout.base import RolloutBatch, sample_seed
from fastcov.trainer.rollout_correction import correct_rollouts
from fastcov.trainer.runtime.batch import MicroBatch, Sequence, micro_batches, sequence_tensors
from fastcov.trainer.runtime.checkpoint import publish_checkpoint, write_checkpoint
from fastcov.trainer.runtime.distributed import all_gather_floats, all_max, all_sum, world_size
from fastcov.trainer.runtime.errors import RolloutError, last_intact, lost_rank_exit, run_io
from fastcov.trainer.runtime.hub import push_to_hub
from fastcov.trainer.runtime.model import export_final
from fastcov.trainer.runtime.offload import activation_offload
from fastcov.trainer.runtime.policy import lr_at
from fastcov.trainer.runtime.run_dir import save_is_due
from fastcov.trainer.start import Run, StopFlag, start_run
from fastcov.trainer.step_metrics import LOSS_METRICS, SELECTION_DIAGNOSTICS, UpdateStats, step_metrics, timed
from fastcov.trainer.timeline import flush_timeline
from fastcov.trainer.token_level.advantages import (
    TOKEN_LEVEL_ESTIMATORS,
    optimal_token_baseline_advantages,
    prime_keep,
)

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------- steps 1-3

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


def generate_batch(cfg: Config, step: int, n_batches: int, sampler, train_set, rollout, sampling: SamplingParams,
                   generator: torch.Generator, rank: int) -> tuple[list, list[list[int]], RolloutBatch]:
    """The synchronous loop's batch ``n_batches`` of ``step`` on this rank: its prompts (the same global order on
    every rank), ``rollout.n`` copies of each, generated now; returns (examples, prompts, the engine's output)."""
    t, r = cfg.trainer, cfg.rollout
    local = t.prompts_per_step // world_size()
    batch_idx = sampler.next(t.prompts_per_step)  # same global order on every rank
    examples = [train_set[i] for i in batch_idx[rank * local : (rank + 1) * local]]
    prompts = [ex.prompt_ids for ex in examples for _ in range(r.n)]
    if r.seeding == "per_sample":  # response j of global prompt g: its own seed, on any topology
        first = (n_batches - 1) * t.prompts_per_step + rank * local
        sampling.seeds = [sample_seed(t.seed, step, first + i // r.n, i % r.n) for i in range(len(prompts))]
    return examples, prompts, rollout.generate(prompts, sampling, generator)


def collect_rollouts(cfg: Config, step: int, sampler, train_set, rollout, reward_fn, tokenizer,
                     generator: torch.Generator, counters: dict, rank: int, device: torch.device,
                     ckpt_root: Path, source=None) -> Collected:
    """Steps 1-3: sample prompts, generate ``rollout.n`` responses each, score them, compute advantages
    and drop the groups the filters reject (DAPO: all rewards equal; PRIME: accuracy out of band).

    With ``algo.dapo_filter`` and ``algo.max_gen_batches`` != 1 this repeats with fresh prompts until
    ``prompts_per_step`` groups are kept (verl's dynamic sampling): the first ``prompts_per_step`` kept
    groups in generation order are trained on; a step still short after ``max_gen_batches`` batches
    trains on what it has. Advantages are computed per generated batch. Every rank must call it.
    ``source``: rollout.async's (trainer/rollout/staleness.py), which hands out the generated batches instead
    (the "rollout" time is then the wait for them) and is told when the step's rollouts are collected.
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
    version = None
    while True:
        n_batches += 1
        with timed(times, "rollout"):
            try:
                if source is not None:
                    drawn = source.draw(step, n_batches)
                    examples, prompts, out, version = drawn.examples, drawn.prompts, drawn.out, drawn.version
                else:
                    examples, prompts, out = generate_batch(cfg, step, n_batches, sampler, train_set, rollout,
                                                            sampling, generator, rank)
            except Exception as exc:
                raise RolloutError(f"rollout engine failed at step {step}: {type(exc).__name__}: {exc}; the last "
                                   f"intact checkpoint is {last_intact(ckpt_root)}; resume with --resume") from exc
        with timed(times, "reward"):
            texts = tokenizer.batch_decode(out.token_ids, skip_special_tokens=True)
            timeouts_before = reward_fn.timeouts
            local_rewards = reward_fn.batch(texts, [examples[i // r.n].ground_truth for i in range(len(texts))])
            counters["reward_timeouts"] += int(all_sum([reward_fn.timeouts - timeouts_before], device)[0])

        rewards = torch.tensor(all_gather_floats(local_rewards, device), dtype=torch.float32)
        # prime, optimal_token_baseline: RLOO here as a placeholder; the token-level advantages are set after step 4
        seq_estimator = "rloo" if a.adv_estimator in TOKEN_LEVEL_ESTIMATORS else a.adv_estimator
        adv = get_advantage(seq_estimator)(rewards, r.n).view(t.prompts_per_step, r.n)
        keep = torch.ones(t.prompts_per_step, dtype=torch.bool)
        if a.dapo_filter:
            keep = dapo_filter(rewards, r.n).view(t.prompts_per_step, r.n)[:, 0]
        if a.adv_estimator == "prime" and a.prime.acc_filter:
            keep &= prime_keep(rewards, r.n, cfg.reward.kind, a.prime.acc_low, a.prime.acc_high)
        counters["filtered_groups"] += int((~keep).sum())
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
                    temperature=sampling.temperature))
        all_prompts += prompts
        all_ids += out.token_ids
        all_rewards += local_rewards
        if len(kept) >= t.prompts_per_step or (limit > 0 and n_batches >= limit):
            break
    if source is not None:
        source.collected(step)  # one_step: the next step's batch starts generating
    chosen = sorted(kept[: t.prompts_per_step])
    seqs = [s for gid in chosen for s in pending.get(gid, [])]
    return Collected(seqs, chosen, all_prompts, all_ids, all_rewards, sum(len(x) for x in all_ids), n_batches, times)



# ---------------------------------------------------------------------------------------- steps 4 and 5

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


def compute_old_logprobs(engine, seqs: list[Sequence], cfg: Config, pad_id: int, device: torch.device,
                         keep_entropy: bool = False, keep_vocab_cov: bool = False, keep_sum_p2: bool = False
                         ) -> tuple[float, float, float, float]:
    """Step 4: fill ``old_logprob`` of every sequence (and ``old_entropy`` / ``old_vocab_cov`` / ``old_sum_p2``
    when asked)
    with a no-grad pass over token-budget micro-batches. Returns (entropy sum, response tokens,
    Σ |old − sampling log-prob|, max |old − sampling log-prob|) over this rank's sequences: the rollout
    engine's log-probs against the policy's before the update. Every rank must call it."""
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
    return ent_sum, tok_sum, lp_diff, lp_diff_max


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



# ---------------------------------------------------------------------------------------- steps 4-6

def logprobs_update_sync(run: Run, col: Collected, rec: dict) -> tuple[UpdateStats, list[float], float]:
    """Steps 4-6: old log-probs (then token-level advantages, the rollout correction, entropy shaping), the
    policy update, the weight sync. Returns (update stats, ``compute_old_logprobs``'s four values on this
    rank: [entropy sum, response tokens, Σ and max |old − rollout log-prob|], the update's lr)."""
    cfg, a, times = run.cfg, run.cfg.algo, col.times
    pad_id = run.tokenizer.pad_token_id
    global_scope = a.scope == "global"  # its first mini-batch's selection reuses these
    shaping = a.entropy_advantage.alpha > 0  # Cheng et al.'s shaping reads the rollout entropies
    with timed(times, "old_logprob"):
        old = compute_old_logprobs(run.engine, col.seqs, cfg, pad_id, run.device,
                                   keep_entropy=(global_scope and a.loss.high_entropy_fraction is not None) or shaping,
                                   keep_vocab_cov=global_scope and a.loss.cov_score == "vocab",
                                   keep_sum_p2=a.adv_estimator == "optimal_token_baseline")
    if run.token_adv is not None:  # REINFORCE++ with KL penalty, PRIME: token-level advantages
        with timed(times, "token_rewards"):
            rec.update(run.token_adv.apply(col.seqs, pad_id, run.device, batching(cfg, run.engine)))
    if rollout_correction_enabled(cfg):
        rec.update(correct_rollouts(col.seqs, cfg, run.device))
    if a.adv_estimator == "optimal_token_baseline":  # needs the old log-probs, Σπ² and the rollout weights
        rec.update(optimal_token_baseline_advantages(col.seqs, run.device))
    if shaping:  # A_t + min(alpha * H_t, |A_t| / kappa); logs entropy_advantage/bonus
        rec.update(entropy_control.shape_advantages(col.seqs, a, run.device))
    with timed(times, "update"):
        rec["lambda"] = run.lam_sched.value if run.lam_sched is not None else a.loss.pos_adv_weight
        lr = lr_at(run.engine.steps, cfg.optim, cfg.trainer.max_steps * a.ppo_epochs * a.mini_batches)
        loss_cfg = entropy_control.controlled(loss_config(a, pos_adv_weight=rec["lambda"]), run.entropy_ctl)
        upd = update_policy(run.engine, col.seqs, col.kept_groups, cfg, loss_cfg, lr, pad_id, run.device,
                            run.gens["select"])
        if upd.skipped_steps:
            run.counters["skipped_steps"] += upd.skipped_steps
            if run.rank == 0:
                warnings.warn(f"step {run.step}: non-finite loss or gradient; {upd.skipped_steps} optimizer "
                              f"step(s) skipped ({run.counters['skipped_steps']} so far)", stacklevel=1)
    with timed(times, "sync"):
        sync_bytes = run.sync_weights()
    if sync_bytes is not None:
        rec["sync_bytes"] = sync_bytes
    return upd, list(old), lr


# ---------------------------------------------------------------------------------------- steps 8 and 9

def end_step(run: Run, rec: dict, col: Collected, tokens: float, t_step: float, stop_now: bool) -> None:
    """Steps 8-9: evaluation, then the checkpoint in two phases around the metrics row. The step's row is
    on disk before its checkpoint is: a crash in between resumes from the previous checkpoint and trims
    the row, so no step is lost or logged twice."""
    t, times, step = run.cfg.trainer, col.times, run.step
    if t.eval_every and run.val_set and (step % t.eval_every == 0 or step == t.max_steps):
        with timed(times, "eval"):
            rec.update(run.evaluate(step))
    pending = None
    if (step == t.max_steps or stop_now or (t.save_every and step % t.save_every == 0)
            or save_is_due(t.save_every_minutes, run.last_save, run.rank, run.device)):
        with timed(times, "save"):
            with run_io(run, f"the checkpoint of step {step}"):
                pending = write_checkpoint(run.ckpt_root, step, run.engine, run.trainer_state(), run.gens,
                                           run.rank)
                if run.token_adv is not None and run.token_adv.prm is not None and run.rank == 0:
                    run.token_adv.prm.save(pending)  # identical on every rank (averaged gradients)
                if run.source is not None:
                    run.source.save(pending)  # rollout.async one_step: this rank's finished batch of the next step
            run.last_save = time.monotonic()
    dt = time.perf_counter() - t_step
    rec.update({f"time/{k}": v for k, v in times.items()})
    rec.update({"time/step": dt, "tokens_per_s": tokens / dt,
                "tokens_per_s/rollout": all_sum([float(col.n_generated)], run.device)[0] / max(times["rollout"], 1e-9)})
    with run_io(run, f"the metrics row of step {step}"):
        run.log_durably(rec)
        flush_timeline(step)  # trainer.timeline: the step's phase spans
        if pending is not None:
            publish_checkpoint(pending, t.keep_last, run.rank)
    if run.pbar is not None:
        run.pbar.set_postfix(reward=f"{rec['reward_mean']:.3f}", H=f"{rec['entropy']:.3f}",
                             **({"val": f"{rec['val_acc']:.3f}"} if "val_acc" in rec else {}),
                             refresh=False)  # update() redraws, at most every mininterval
        run.pbar.update(1)


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
        run.sync_weights()
        if run.step == 0 and t.eval_every and run.val_set:
            run.log_durably({"step": 0, **run.evaluate(0)})
    with StopFlag() as stop, lost_rank_exit(run):
        while run.step < t.max_steps:
            run.step += 1
            t_step = time.perf_counter()
            # 1-3. rollouts, rewards, advantages (with DAPO's filter: refills until prompts_per_step groups)
            col = collect_rollouts(cfg, run.step, run.sampler, run.train_set, run.rollout, run.reward_fn,
                                   run.tokenizer, run.gens["sample"], run.counters, run.rank, run.device,
                                   run.ckpt_root, source=run.source)
            rec: dict = {"step": run.step, "kept_groups": len(col.kept_groups), "gen_batches": col.gen_batches}
            upd, old, lr = logprobs_update_sync(run, col, rec)  # 4-6. old log-probs, update, weight sync
            tokens = step_metrics(run, col.rewards, col.prompts, col.token_ids, upd, old, lr, rec)  # 7. metrics
            stop_now = all_sum([1.0 if stop.set else 0.0], run.device)[0] > 0 or run.step == stop_at
            end_step(run, rec, col, tokens, t_step, stop_now)  # 8-9. evaluation, checkpoint, log
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

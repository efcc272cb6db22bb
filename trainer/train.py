"""The training loop, top to bottom.

    prompts -> n rollouts each -> rewards -> advantages -> (DAPO filter) -> old log-probs
    -> ppo_epochs x mini-batches x token-budget micro-batches of fastcov.policy_loss -> weight sync
    -> metrics, evaluation, checkpoints

``train(cfg)`` runs in every data-parallel process (one on CPU without a launcher). Every tensor that
reaches the loss comes from ``fastcov.linear_logprob_entropy`` on the last hidden states: full logits
are never built.
"""

from __future__ import annotations

import copy
import json
import math
import random
import signal
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from fastcov.advantages import dapo_filter, get_advantage
from fastcov.losses import LossConfig, policy_loss
from fastcov.schedules import PositiveWeightSchedule
from fastcov.trainer.batch import Sequence, micro_batches
from fastcov.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from fastcov.trainer.config import Config, save_config
from fastcov.trainer.data import PromptSampler, load_train_val, prepare_data
from fastcov.trainer.engine import PolicyEngine, init_distributed, lr_at, pick_device
from fastcov.trainer.metrics import MetricsLogger
from fastcov.trainer.model import PolicyModel, build_model, load_tokenizer
from fastcov.trainer.rewards import RewardFn
from fastcov.trainer.rollout import HFRolloutEngine, SamplingParams

# policy_loss metrics averaged over the update's tokens; its "entropy" is logged as "update_entropy"
# ("entropy" is the rollout-token mean of the pre-update policy).
LOSS_METRICS = ("ppo_kl", "clipfrac", "selected_frac", "cov_mean", "cov_max", "entropy")
LOSS_METRIC_NAMES = {"entropy": "update_entropy"}
SAMPLED_EVAL_SOURCES = ("aime", "aime25", "amc")  # evaluated at eval_temperature; others greedily


class RolloutError(RuntimeError):
    pass


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _dist():
    import torch.distributed as dist

    return dist


def world_size() -> int:
    dist = _dist()
    return dist.get_world_size() if dist.is_initialized() else 1


def all_sum(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if world_size() > 1:
        _dist().all_reduce(t)
    return t.tolist()


def all_gather_floats(values: list[float], device: torch.device) -> list[float]:
    """Concatenation over ranks in rank order (every rank passes the same length)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    world = world_size()
    if world == 1:
        return t.tolist()
    out = [torch.empty_like(t) for _ in range(world)]
    _dist().all_gather(out, t)
    return torch.cat(out).tolist()


def eval_sampling(data_source: str, tcfg, max_new_tokens: int) -> tuple[SamplingParams, bool]:
    """(sampling params, sampled?) for one validation prompt: aime/aime25/amc sample, others greedy."""
    src = data_source.lower()
    sampled = any(src == s or src.startswith(s + "_") or src.endswith("/" + s) for s in SAMPLED_EVAL_SOURCES)
    temp = tcfg.eval_temperature if sampled else 0.0
    return SamplingParams(temperature=temp, top_p=1.0, max_new_tokens=max_new_tokens), sampled


def evaluate(rollout, val_set, reward_fn, tokenizer, cfg: Config, rank: int, world: int,
             device: torch.device, step: int) -> dict[str, float]:
    """avg@k accuracy over the validation prompts (split across ranks); also per data source."""
    t = cfg.trainer
    k = t.eval_k
    max_new = t.eval_max_new_tokens or cfg.rollout.max_new_tokens
    gen = torch.Generator(device=rollout.device).manual_seed(cfg.trainer.seed * 7919 + step)
    mine = val_set[rank::world]
    sources = sorted({e.data_source for e in val_set})
    per_source = {s: [0.0, 0.0] for s in sources}
    by_mode: dict[tuple[float, bool], list] = {}
    for ex in mine:
        sp, sampled = eval_sampling(ex.data_source, t, max_new)
        by_mode.setdefault((sp.temperature, sampled), []).append(ex)
    for (temp, sampled), exs in sorted(by_mode.items()):
        reps = k if sampled else 1  # greedy decoding gives k identical samples
        prompts = [e.prompt_ids for e in exs for _ in range(reps)]
        out = rollout.generate(prompts, SamplingParams(temp, 1.0, max_new), gen)
        texts = tokenizer.batch_decode(out.token_ids, skip_special_tokens=True)
        for i, e in enumerate(exs):
            acc = sum(reward_fn.is_correct(texts[i * reps + j], e.ground_truth) for j in range(reps)) / reps
            per_source[e.data_source][0] += acc
            per_source[e.data_source][1] += 1
    flat = all_sum([v for s in sources for v in per_source[s]], device)
    res = {}
    tot_acc = tot_n = 0.0
    for i, s in enumerate(sources):
        acc, n = flat[2 * i], flat[2 * i + 1]
        tot_acc += acc
        tot_n += n
        if len(sources) > 1 and n:
            res[f"val_acc/{s}"] = acc / n
    res["val_acc"] = tot_acc / max(tot_n, 1.0)
    return res


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


def train(cfg: Config, resume: bool | str = False, stop_at: int | None = None, on_end=None) -> Path:
    """Run (or resume) training; returns the run directory.

    ``resume``: True for the newest checkpoint of the run, or a checkpoint directory. ``stop_at``: save and
    stop after that step, as Ctrl-C would. ``on_end(policy_engine, rollout_engine)`` is called on every
    rank after the last step (inspection, e.g. by tests).
    """
    t, a, r = cfg.trainer, cfg.algo, cfg.rollout
    # ------------------------------------------------------------------ setup
    device = pick_device(t.device)
    rank, world = init_distributed(device)
    dist = _dist()
    if t.prompts_per_step % world:
        raise ValueError(f"trainer.prompts_per_step: {t.prompts_per_step} is not divisible by the "
                         f"{world} data-parallel ranks")
    run_dir = Path(t.run_dir)
    ckpt_root = run_dir / "checkpoints"
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    dist.barrier()

    seed_everything(t.seed)  # identical model init on every rank
    tokenizer = load_tokenizer(cfg.model)
    train_files, val_files = prepare_data(cfg, tokenizer, run_dir, rank)
    dist.barrier()
    train_set, val_set, data_stats = load_train_val(cfg, tokenizer, train_files, val_files)

    use_bf16 = device.type == "cuda" and cfg.model.dtype != "fp32"
    lm = build_model(cfg.model, device, torch.float32, tokenizer)
    rollout_lm = copy.deepcopy(lm).to(torch.bfloat16 if use_bf16 else torch.float32)
    rollout_lm.config.use_cache = True
    engine = PolicyEngine(PolicyModel(lm), cfg, device, world)
    eos_ids = [tokenizer.eos_token_id]
    rollout = HFRolloutEngine(rollout_lm, eos_ids, tokenizer.pad_token_id, r.batch_size)
    reward_fn = RewardFn(cfg.reward.kind, cfg.reward.timeout_s, cfg.reward.sandbox)
    pad_id = tokenizer.pad_token_id

    seed_everything(t.seed + 1000 * rank)
    sampler = PromptSampler(len(train_set), t.seed)
    gens = {
        "sample": torch.Generator(device=device).manual_seed(t.seed * 1_000_003 + rank),
        "select": torch.Generator(device=device).manual_seed(t.seed * 1_000_033 + rank + 17),
    }
    lam_sched = (PositiveWeightSchedule("entropy", init=a.pos_adv_weight, threshold=a.pos_weight_target_entropy,
                                        step_size=a.pos_weight_delta)
                 if a.pos_weight_schedule else None)
    counters = {"skipped_steps": 0, "filtered_groups": 0, "reward_timeouts": 0}
    step = 0
    if resume:
        path = latest_checkpoint(ckpt_root) if resume is True else Path(resume)
        if path is None:
            raise FileNotFoundError(f"--resume: no checkpoint under {str(ckpt_root)!r}")
        state = load_checkpoint(path, engine, gens, rank)
        step = state["step"]
        sampler.load_state_dict(state["sampler"])
        counters.update(state["counters"])
        if lam_sched is not None:
            lam_sched.load_state_dict(state["lambda"])
        if rank == 0:
            print(f"[fastcov] resumed from {path} at step {step}", flush=True)
    logger = (MetricsLogger(run_dir, cfg.to_dict(), t.tensorboard, t.wandb, t.wandb_project,
                            resume_step=step if resume else None) if rank == 0 else None)
    if rank == 0:
        print(f"[fastcov] run {run_dir}: {len(train_set)} train / {len(val_set)} val prompts "
              f"({json.dumps(data_stats)}), world {world}, device {device}, zero {t.zero_stage}, "
              f"mode {a.mode}", flush=True)

    def sync_weights() -> None:
        rollout.update_weights(engine.named_weights())

    def trainer_state() -> dict:
        return {"step": step, "sampler": sampler.state_dict(), "counters": counters,
                "lambda": lam_sched.state_dict() if lam_sched is not None else None,
                "world": world}

    def checkpoint() -> Path:
        return save_checkpoint(ckpt_root, step, engine, trainer_state(), gens, rank, t.keep_last)

    sync_weights()
    pbar = None
    if rank == 0 and t.progress:
        from tqdm.auto import tqdm

        pbar = tqdm(total=t.max_steps, initial=step, desc=f"train {a.mode}", dynamic_ncols=True)

    if step == 0 and t.eval_every and val_set:
        res = evaluate(rollout, val_set, reward_fn, tokenizer, cfg, rank, world, device, 0)
        if logger:
            logger.log({"step": 0, **res})

    local_prompts = t.prompts_per_step // world
    with _StopFlag() as stop:
        while step < t.max_steps:
            step += 1
            t_step = time.perf_counter()
            times: dict[str, float] = {}
            rec: dict = {"step": step}

            # ---------------------------------------------------------- 1. prompts and rollouts
            t0 = time.perf_counter()
            batch_idx = sampler.next(t.prompts_per_step)  # same global order on every rank
            my_idx = batch_idx[rank * local_prompts : (rank + 1) * local_prompts]
            examples = [train_set[i] for i in my_idx]
            prompts = [ex.prompt_ids for ex in examples for _ in range(r.n)]
            sampling = SamplingParams(r.temperature, r.top_p, r.max_new_tokens)
            try:
                out = rollout.generate(prompts, sampling, gens["sample"])
            except Exception as exc:
                last = latest_checkpoint(ckpt_root)
                raise RolloutError(
                    f"rollout engine failed at step {step}: {type(exc).__name__}: {exc}. "
                    f"Last checkpoint: {last if last else 'none'} (intact); resume with --resume."
                ) from exc
            times["rollout"] = time.perf_counter() - t0

            # ---------------------------------------------------------- 2. rewards
            t0 = time.perf_counter()
            texts = tokenizer.batch_decode(out.token_ids, skip_special_tokens=True)
            timeouts_before = reward_fn.timeouts
            local_rewards = [reward_fn(txt, examples[i // r.n].ground_truth) for i, txt in enumerate(texts)]
            counters["reward_timeouts"] += int(all_sum([reward_fn.timeouts - timeouts_before], device)[0])
            times["reward"] = time.perf_counter() - t0

            # ---------------------------------------------------------- 3. advantages (+ DAPO filter)
            rewards = torch.tensor(all_gather_floats(local_rewards, device), dtype=torch.float32)
            adv = get_advantage(a.adv_estimator)(rewards, r.n).view(t.prompts_per_step, r.n)
            keep = torch.ones(t.prompts_per_step, dtype=torch.bool)
            if a.dapo_filter:
                keep = dapo_filter(rewards, r.n).view(t.prompts_per_step, r.n)[:, 0]
                counters["filtered_groups"] += int((~keep).sum())
            rec["kept_groups"] = int(keep.sum())
            first = rank * local_prompts
            seqs: list[Sequence] = []
            for i in range(len(prompts)):
                g = first + i // r.n
                if keep[g]:
                    seqs.append(Sequence(prompts[i], out.token_ids[i], out.logprobs[i], g,
                                         reward=local_rewards[i], advantage=float(adv[g, i % r.n])))

            # ---------------------------------------------------------- 4. old log-probs, entropy
            t0 = time.perf_counter()
            engine.eval()
            ent_sum = tok_sum = lp_diff = 0.0
            all_seqs = seqs
            with torch.no_grad():
                for mb in micro_batches(all_seqs, t.micro_token_budget, pad_id, device):
                    res = engine(mb.input_ids, mb.attention_mask, mb.labels, temperature=r.temperature,
                                 entropy=True)
                    if mb.weight == 0:
                        continue
                    for row, si in enumerate(mb.seq_index):
                        s = all_seqs[si]
                        p = len(s.prompt)
                        lp = res.logprob[row, p - 1 : len(s) - 1].float()
                        s.old_logprob = lp.tolist()
                        ent_sum += float(res.entropy[row, p - 1 : len(s) - 1].sum())
                        lp_diff += float((lp - torch.tensor(s.sample_logprob, device=lp.device)).abs().sum())
                        tok_sum += len(s.response)
            times["old_logprob"] = time.perf_counter() - t0

            # ---------------------------------------------------------- 5. policy update
            t0 = time.perf_counter()
            engine.train()
            lam = lam_sched.value if lam_sched is not None else a.pos_adv_weight
            loss_cfg = LossConfig(
                clip_low=a.clip_low, clip_high=a.clip_high, dual_clip_c=a.dual_clip_c,
                clip_cov_ratio=a.clip_cov_ratio, clip_cov_lb=a.clip_cov_lb, clip_cov_ub=a.clip_cov_ub,
                kl_cov_ratio=a.kl_cov_ratio, kl_cov_coef=a.kl_cov_coef, entropy_coef=a.entropy_coef,
                pos_adv_weight=lam, neg_adv_weight=a.neg_adv_weight,
                high_entropy_fraction=a.high_entropy_fraction, cov_score=a.cov_score,
                check_finite=False,  # a non-finite loss skips the step below instead of raising
            )
            # Mini-batches split the kept prompt groups (global order), so every rank steps together.
            kept_groups = [g for g in range(t.prompts_per_step) if keep[g]]
            n_mini = min(a.mini_batches, max(1, len(kept_groups)))
            group_chunks = [kept_groups[j::n_mini] for j in range(n_mini)] if kept_groups else [[]]
            msum: dict[str, float] = {}
            mcount = 0
            loss_sum = 0.0
            applied_steps = 0
            grad_norms = []
            lr = lr_at(engine.steps, cfg.optim, t.max_steps * a.ppo_epochs * a.mini_batches)
            for _epoch in range(a.ppo_epochs):
                for chunk in group_chunks:
                    cset = set(chunk)
                    mini = [s for s in seqs if s.group in cset]
                    local_tok = sum(len(s.response) for s in mini)
                    g_tok, g_seq = all_sum([local_tok, len(mini)], device)
                    mbs = micro_batches(mini, t.micro_token_budget, pad_id, device)
                    poisoned = False
                    for j, mb in enumerate(mbs):
                        res = engine(mb.input_ids, mb.attention_mask, mb.labels, temperature=r.temperature,
                                     entropy=True, vocab_cov=a.cov_score == "vocab")
                        loss, metrics = policy_loss(
                            res.logprob, mb.old_logprob, mb.advantages, mb.mask,
                            mode=a.mode, agg=a.loss_agg, scope=a.scope, config=loss_cfg,
                            entropy=res.entropy, vocab_cov=res.vocab_cov,
                            global_tokens=g_tok, global_seqs=g_seq, generator=gens["select"],
                        )
                        # Divided by the mini-batch totals over all ranks, the micro-batch losses sum to the
                        # mini-batch loss; DeepSpeed averages gradients over ranks, hence the world factor.
                        scaled = loss * (world * mb.weight)
                        finite = all_sum([0.0 if bool(torch.isfinite(loss)) else 1.0], device)[0] == 0
                        if not finite:
                            poisoned = True
                        engine.backward(scaled, boundary=j == len(mbs) - 1)
                        if mb.weight > 0 and bool(torch.isfinite(loss)):
                            loss_sum += float(loss.detach())
                            for k in LOSS_METRICS:
                                v = float(metrics.get(k, 0.0))
                                if math.isfinite(v):
                                    msum[k] = msum.get(k, 0.0) + v * mb.n_tokens
                            mcount += mb.n_tokens
                    applied, norm = engine.step(lr, poisoned)
                    if applied:
                        applied_steps += 1
                        if norm is not None:
                            grad_norms.append(norm)
                    else:
                        counters["skipped_steps"] += 1
                        if rank == 0:
                            warnings.warn(f"step {step}: non-finite loss or gradient; optimizer step skipped "
                                          f"({counters['skipped_steps']} so far)", stacklevel=1)
            times["update"] = time.perf_counter() - t0

            # ---------------------------------------------------------- 6. weight sync
            t0 = time.perf_counter()
            sync_weights()
            times["sync"] = time.perf_counter() - t0

            # ---------------------------------------------------------- 7. metrics
            resp_lens = [len(x) for x in out.token_ids]
            n_prompt_tok = sum(len(p) for p in prompts)
            tot = all_sum([sum(local_rewards), len(local_rewards), sum(resp_lens), ent_sum, tok_sum, lp_diff,
                           n_prompt_tok, float(mcount), loss_sum], device)
            (r_sum, r_n, len_sum, e_sum, tk_sum, d_sum, p_sum, m_n, l_sum) = tot
            keys = list(LOSS_METRICS)
            mvals = all_sum([msum.get(k, 0.0) for k in keys], device)
            rec.update({
                "reward_mean": r_sum / max(r_n, 1),
                "acc_mean": (r_sum / max(r_n, 1)) if cfg.reward.kind == "binary"
                else (r_sum / max(r_n, 1) + 1) / 2,
                "entropy": e_sum / max(tk_sum, 1),
                "response_len": len_sum / max(r_n, 1),
                "rollout_logprob_diff": d_sum / max(tk_sum, 1),
                "loss": l_sum / max(a.ppo_epochs * n_mini, 1),
                "lr": lr,
                "lambda": lam,
                "grad_norm": float(np.mean(grad_norms)) if grad_norms else None,
                "applied_steps": applied_steps,
                **{LOSS_METRIC_NAMES.get(k, k): v / max(m_n, 1) for k, v in zip(keys, mvals)},
                **counters,
            })
            if lam_sched is not None:
                lam_sched.step(entropy=rec["entropy"])

            # ---------------------------------------------------------- 8. evaluation
            if t.eval_every and val_set and (step % t.eval_every == 0 or step == t.max_steps):
                t0 = time.perf_counter()
                rec.update(evaluate(rollout, val_set, reward_fn, tokenizer, cfg, rank, world, device, step))
                times["eval"] = time.perf_counter() - t0

            # ---------------------------------------------------------- 9. checkpoint, stop
            stop_now = all_sum([1.0 if stop.set else 0.0], device)[0] > 0 or step == stop_at
            if step == t.max_steps or stop_now or (t.save_every and step % t.save_every == 0):
                t0 = time.perf_counter()
                checkpoint()
                times["save"] = time.perf_counter() - t0
            dt = time.perf_counter() - t_step
            rec.update({f"time/{k}": v for k, v in times.items()})
            rec["time/step"] = dt
            rec["tokens_per_s"] = (p_sum + len_sum) / dt
            if logger:
                logger.log(rec)
            if pbar is not None:
                pbar.update(1)
                pbar.set_postfix(reward=f"{rec['reward_mean']:.3f}", H=f"{rec['entropy']:.3f}",
                                 **({"val": f"{rec['val_acc']:.3f}"} if "val_acc" in rec else {}))
            if stop_now:
                if rank == 0:
                    print(f"[fastcov] stopped at step {step}; checkpoint saved", flush=True)
                break
    if pbar is not None:
        pbar.close()
    if on_end is not None:
        on_end(engine, rollout)
    if step == t.max_steps:
        with engine.gathered_model() as model:
            if rank == 0:
                model.save_pretrained(run_dir / "final")
                tokenizer.save_pretrained(run_dir / "final")
        dist.barrier()
    if logger:
        logger.close()
    reward_fn.close()
    return run_dir

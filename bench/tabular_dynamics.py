"""A GRPO simulator on a tabular softmax policy: entropy dynamics over whole runs.

The first-order theory it checks (Lemma 1, Theorems 1 and 2 of Cui et al. 2025) is the library's
``fastcov.dynamics``; the simulator left the library after 0.4 (it was part of ``fastcov.dynamics``).

Simulator: :class:`TabularProblem` holds P prompts × K candidate answers (logits [P, K] and a fixed
verifiable correct/incorrect table); :func:`simulate` runs GRPO on it — n samples per prompt from π,
group-normalised advantages, one "token" per sampled answer — with any policy-loss mode of
``fastcov.losses.policy_loss`` ("vanilla", "clip_cov", "kl_cov", ...), updating the logits either by
vanilla PG (autograd of the loss through log_softmax) or by natural PG (Δz = η·c on the sampled
logits, c the per-token coefficient that the loss puts on log π). It records entropy, expected
accuracy and the Lemma-1 prediction of every step's entropy change next to the actual change.

``python -m bench.tabular_figure --plot docs/entropy_dynamics.png`` compares vanilla GRPO, Clip-Cov and
KL-Cov on it (bench/tabular_figure.py). Everything here is float64 on CPU.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fastcov.dynamics import UPDATES, check_logits, policy_entropy, predicted_entropy_change
from fastcov.entropy_control import controlled

__all__ = [
    "TabularProblem",
    "DynamicsConfig",
    "DynamicsRun",
    "grpo_advantages",
    "simulate",
    "TABULAR_LOSS_OVERRIDES",
]

DTYPE = torch.float64

# Loss settings for the tabular demo. A tabular "token" is one sampled answer, so a mini-batch holds
# only P·n/minibatches = 128 tokens (with the defaults) instead of the ~10^5–10^6 of an LLM batch: the
# paper's ratios (Clip-Cov 2e-4, KL-Cov 2e-3/2e-4) would give k = max(1, ⌊ratio·128⌋) = 1 token per
# update, which does nothing visible. 0.1 gives k = 12. What the ratio is meant to reach is the
# high-covariance tail of the batch — in the tabular batch only the tokens of groups with mixed
# rewards carry advantage, and few of them lie in the tail, so a few percent of the batch is that tail
# (the paper's 2e-4 of an LLM batch is likewise the handful of tokens that dominate Cov(log π, A)).
# Clip-Cov's band lb < c_t < ub (1, 5) and KL-Cov's β = 1 keep LossConfig's defaults: the scale of
# c_t = (A − Ā)(log π − mean log π) is the same here (normalised A, log-probs a few nats apart), and
# the band, not k, often limits how many tokens Clip-Cov drops (about 5 of its 12).
TABULAR_LOSS_OVERRIDES: dict[str, dict[str, Any]] = {
    "vanilla": {},
    "clip_cov": {"clip_cov_ratio": 0.1},
    "kl_cov": {"kl_cov_ratio": 0.1},
}


def _vocab_cov(logp_all: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """κ = Cov_π(log π, e_y − π) = π_y(log π_y + H) − (Σπ² log π + H·Σπ²) for y = actions.

    logp_all [P, K], actions [P, n] -> [P, n].
    """
    p = logp_all.exp()
    h = -(p * logp_all).sum(-1, keepdim=True)
    s2 = (p * p).sum(-1, keepdim=True)
    s2l = (p * p * logp_all).sum(-1, keepdim=True)
    lp_y = logp_all.gather(1, actions)
    return lp_y.exp() * (lp_y + h) - (s2l + h * s2)


# -------------------------------------------------------------------------------------- simulator
@dataclass
class TabularProblem:
    """P prompts × K candidate answers with verifiable rewards.

    Attributes:
        logits: initial logits, float64 [P, K].
        correct: bool [P, K]; answer k of prompt p earns reward 1 when True, else 0.
    """

    logits: torch.Tensor
    correct: torch.Tensor

    def __post_init__(self) -> None:
        check_logits(self.logits)
        if self.logits.ndim != 2:
            raise ValueError(f"logits must be [P, K], got shape {tuple(self.logits.shape)}")
        if self.correct.shape != self.logits.shape or self.correct.dtype != torch.bool:
            raise ValueError(f"correct must be a bool tensor of shape {tuple(self.logits.shape)}, "
                             f"got {self.correct.dtype} {tuple(self.correct.shape)}")
        self.logits = self.logits.to(DTYPE)

    @property
    def n_prompts(self) -> int:
        return self.logits.shape[0]

    @property
    def n_answers(self) -> int:
        return self.logits.shape[1]

    @classmethod
    def random(cls, n_prompts: int = 64, n_answers: int = 64, *, max_correct: int = 24,
               logit_scale: float = 1.0, correct_shift: float = -1.0, seed: int = 0) -> TabularProblem:
        """A random problem, deterministic given ``seed``.

        Logits ~ N(0, logit_scale²), plus ``correct_shift`` on the correct answers (negative: the
        prompts start hard, so learning takes a while); each prompt gets between 1 and
        ``max_correct`` correct answers (uniform count, uniformly chosen answers). The defaults start
        at mean entropy ≈ 3.6 nats and expected accuracy ≈ 0.09."""
        for name, value in (("n_prompts", n_prompts), ("n_answers", n_answers), ("max_correct", max_correct)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if n_answers < 2:
            raise ValueError(f"n_answers must be at least 2, got {n_answers}")
        if max_correct >= n_answers:
            raise ValueError(f"max_correct must be below n_answers={n_answers}, got {max_correct}")
        if not math.isfinite(logit_scale) or logit_scale < 0:
            raise ValueError(f"logit_scale must be a non-negative number, got {logit_scale!r}")
        if not math.isfinite(correct_shift):
            raise ValueError(f"correct_shift must be a finite number, got {correct_shift!r}")
        g = torch.Generator().manual_seed(seed)
        logits = logit_scale * torch.randn(n_prompts, n_answers, generator=g, dtype=DTYPE)
        counts = torch.randint(1, max_correct + 1, (n_prompts,), generator=g)
        order = torch.rand(n_prompts, n_answers, generator=g).argsort(dim=1)
        correct = order < counts[:, None]
        return cls(logits + correct_shift * correct.to(DTYPE), correct)

    def accuracy(self, logits: torch.Tensor | None = None) -> torch.Tensor:
        """Expected reward per prompt, Σ_a π_a·correct_a: float64 [P]."""
        z = self.logits if logits is None else logits
        return (torch.softmax(z, dim=-1) * self.correct.to(z.dtype)).sum(-1)


def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO group normalisation (r − mean_g)/(std_g + eps), unbiased std, per row: [P, n] -> [P, n].
    Groups whose rewards are all equal get advantage 0."""
    if rewards.ndim != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [P, n] with n >= 2, got shape {tuple(rewards.shape)}")
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=True)
    return (rewards - mean) / (std + eps)


@dataclass
class DynamicsConfig:
    """Settings of :func:`simulate`.

    Attributes:
        steps: rollout batches (each = one sampling round of ``group_size`` answers per prompt).
        group_size: n answers sampled per prompt (GRPO group).
        update: "vanilla" (autograd of the loss through log_softmax; Δz = −lr·P·∂L/∂z, the factor
            P = number of prompts making ``lr`` the per-prompt step of the token-mean loss) or
            "natural" (Δz[p, a] = lr · mean over that prompt's samples of a of c_t, with
            c_t = −n_tokens·∂L/∂logπ_t, so vanilla on-policy token-mean gives Δz = lr·A exactly).
        lr: step size η.
        epochs: optimizer updates per rollout batch on the same samples (old log-probs fixed at
            sampling time); updates after the first are off-policy, which is where the PPO clip and
            the KL-Cov penalty act.
        minibatches: each epoch, the N = P·n tokens are shuffled (seeded) and split into this many
            mini-batches, one optimizer update each (as in the paper's 8 mini-batches per rollout); a
            prompt's tokens then land in several updates, so later ones are off-policy even with
            ``epochs=1``. 1 = full-batch updates in token order.
        mode, agg, scope: passed to ``fastcov.losses.policy_loss``.
        loss_config: a ``fastcov.losses.LossConfig``, a mapping of overrides of its defaults, or None
            (defaults updated with ``TABULAR_LOSS_OVERRIDES[mode]``).
        positive_weight: optional ``PositiveWeightSchedule``: its λ weights the loss of tokens with
            A > 0 (``LossConfig.pos_adv_weight``); it is stepped with the mean entropy after every
            rollout batch.
        entropy_control: optional ``fastcov.entropy_control.EntropyController``: its knob's applied value goes
            into the step's ``LossConfig``; it is updated with the mean entropy after every rollout batch.
        seed: sampling seed (the problem has its own).
    """

    steps: int = 300
    group_size: int = 8
    update: str = "vanilla"
    lr: float = 0.1
    epochs: int = 1
    minibatches: int = 4
    mode: str = "vanilla"
    agg: str = "token-mean"
    scope: str = "microbatch"
    loss_config: Any = None
    positive_weight: Any = None
    seed: int = 0
    entropy_control: Any = None

    def validate(self) -> None:
        for name in ("steps", "group_size", "epochs", "minibatches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "steps" else 1):
                kind = "non-negative" if name == "steps" else "positive"
                raise ValueError(f"{name} must be a {kind} int, got {value!r}")
        if self.group_size < 2:
            raise ValueError(f"group_size must be at least 2 (GRPO normalises within a group), got {self.group_size}")
        if self.update not in UPDATES:
            raise ValueError(f"update must be one of {', '.join(UPDATES)}, got {self.update!r}")
        if not isinstance(self.lr, (int, float)) or not math.isfinite(self.lr) or self.lr <= 0:
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")


@dataclass
class DynamicsRun:
    """History of one :func:`simulate` run (NumPy float64 arrays; ``steps`` = S).

    Attributes:
        label: a name for plots.
        entropy: mean policy entropy over prompts, [S + 1] (index 0 = start).
        accuracy: mean expected accuracy over prompts, [S + 1].
        predicted_dH: Lemma-1 prediction of each step's mean entropy change from its total Δz, [S].
        actual_dH: the actual mean entropy change, [S].
        positive_weight: λ used at each step, [S] (1.0 without a schedule).
        metrics: per-step means over that step's updates of the scalar metrics the loss returned
            (e.g. ``selected_frac``, ``clipfrac``), each [S].
        final_logits: float64 [P, K].
        seconds: wall time.
    """

    label: str
    entropy: np.ndarray
    accuracy: np.ndarray
    predicted_dH: np.ndarray
    actual_dH: np.ndarray
    positive_weight: np.ndarray
    metrics: dict[str, np.ndarray] = field(default_factory=dict)
    final_logits: torch.Tensor | None = None
    seconds: float = 0.0

    def entropy_at_accuracy(self, level: float) -> float:
        """Mean entropy at the first step whose accuracy reaches ``level`` (NaN if it never does)."""
        hit = np.flatnonzero(self.accuracy >= level)
        return float(self.entropy[hit[0]]) if hit.size else math.nan

    def summary(self) -> dict[str, float]:
        """Start/final/mean entropy, entropy at accuracy 0.8, start/final accuracy, and the relative
        error of the summed Lemma-1 predictions, Σ|pred − actual| / Σ|actual|."""
        denom = float(np.abs(self.actual_dH).sum())
        return {
            "entropy_start": float(self.entropy[0]),
            "entropy_final": float(self.entropy[-1]),
            "entropy_mean": float(self.entropy.mean()),
            "entropy_at_accuracy_0.8": self.entropy_at_accuracy(0.8),
            "accuracy_start": float(self.accuracy[0]),
            "accuracy_final": float(self.accuracy[-1]),
            "lemma1_rel_error": float(np.abs(self.predicted_dH - self.actual_dH).sum()) / denom if denom else math.nan,
        }


def _resolve_loss_config(mode: str, loss_config: Any) -> Any:
    if loss_config is not None and not isinstance(loss_config, Mapping):
        return loss_config
    from fastcov.losses import LossConfig  # imported late: the simulator's theory part needs no losses

    if loss_config is None:
        return dataclasses.replace(LossConfig(), **TABULAR_LOSS_OVERRIDES.get(mode, {}))
    return dataclasses.replace(LossConfig(), **dict(loss_config))


def _default_loss_fn() -> Callable[..., Any]:
    from fastcov.losses import policy_loss

    return policy_loss


def _scalar_metrics(metrics: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    if not isinstance(metrics, Mapping):
        return out
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                continue
            value = value.detach().item()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[str(key)] = float(value)
    return out


def _update(z: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
            old_logprob: torch.Tensor, adv: torch.Tensor, cfg: DynamicsConfig, loss_config: Any,
            loss_fn: Callable[..., Any], sel_gen: torch.Generator) -> tuple[torch.Tensor, Any]:
    """One optimizer update of the logits z [P, K] on the tokens ``idx`` (int64 [M]) of the batch."""
    P, K = z.shape
    M = idx.numel()
    r, c = rows[idx], cols[idx]
    z_leaf = z.detach().clone().requires_grad_(True)
    logp_all = torch.log_softmax(z_leaf, dim=-1)
    logprob = logp_all[r, c].reshape(M, 1)
    tok_entropy = (-(logp_all.exp() * logp_all).sum(-1))[r].reshape(M, 1)
    kappa = _vocab_cov(logp_all.detach()[r], c.reshape(M, 1))
    if cfg.update == "natural":
        tok_entropy = tok_entropy.detach()
    loss, metrics = loss_fn(logprob, old_logprob[idx], adv[idx], torch.ones(M, 1, dtype=torch.bool),
                            mode=cfg.mode, agg=cfg.agg, scope=cfg.scope, config=loss_config,
                            entropy=tok_entropy, vocab_cov=kappa, generator=sel_gen)
    if cfg.update == "vanilla":
        (grad_z,) = torch.autograd.grad(loss, z_leaf)
        delta = -cfg.lr * P * grad_z
    else:
        (grad_lp,) = torch.autograd.grad(loss, logprob)
        coef = (-M * grad_lp).reshape(M)
        total = torch.zeros(P, K, dtype=z.dtype).index_put_((r, c), coef, accumulate=True)
        count = torch.zeros(P, K, dtype=z.dtype).index_put_((r, c), torch.ones(M, dtype=z.dtype), accumulate=True)
        delta = cfg.lr * total / count.clamp_min(1.0)
    return (z + delta).detach(), metrics


def simulate(problem: TabularProblem, config: DynamicsConfig | None = None, *,
             loss_fn: Callable[..., Any] | None = None, label: str | None = None, **overrides: Any) -> DynamicsRun:
    """Run GRPO on a tabular softmax policy and record its entropy dynamics.

    Each step: sample ``group_size`` answers per prompt from π = softmax(z) (``torch.multinomial``,
    seeded), reward 1/0 from ``problem.correct``, GRPO advantages per prompt, then ``epochs`` passes of
    ``minibatches`` updates each; an update on the M tokens of one mini-batch calls

        loss, metrics = loss_fn(logprob, old_logprob, advantages, mask, mode=..., agg=..., scope=...,
                                config=..., entropy=..., vocab_cov=..., generator=...)

    on M one-token sequences: ``logprob`` (with grad), ``old_logprob`` (from sampling time),
    ``advantages``, ``entropy`` (the prompt's policy entropy, detached for ``update="natural"``) and
    ``vocab_cov`` (the exact κ of the sampled answer, detached) are float64 [M, 1], ``mask`` is bool
    [M, 1] all True, ``generator`` a seeded stream for Clip-Cov's random picks (separate from the
    sampling stream, so every mode sees the same first batch). With a ``positive_weight`` schedule,
    λ goes into ``config.pos_adv_weight`` (or, for a config without that field, multiplies A > 0).

    Args:
        problem: the start (its ``logits`` are not modified).
        config: :class:`DynamicsConfig`; keyword ``overrides`` replace its fields.
        loss_fn: defaults to ``fastcov.losses.policy_loss``.
        label: name for the run (defaults to the mode).
    """
    cfg = dataclasses.replace(config or DynamicsConfig(), **overrides)
    cfg.validate()
    loss_fn = loss_fn or _default_loss_fn()
    loss_config = _resolve_loss_config(cfg.mode, cfg.loss_config)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # [P, K] tensors: intra-op threads only add overhead (restored below)
    try:
        return _simulate(problem, cfg, loss_fn, loss_config, label)
    finally:
        torch.set_num_threads(threads)


def _simulate(problem: TabularProblem, cfg: DynamicsConfig, loss_fn: Callable[..., Any], loss_config: Any,
              label: str | None) -> DynamicsRun:
    schedule = cfg.positive_weight
    t0 = time.perf_counter()

    P, n = problem.n_prompts, cfg.group_size
    N = P * n
    gen = torch.Generator().manual_seed(cfg.seed)  # sampling and mini-batch shuffles
    sel_gen = torch.Generator().manual_seed(cfg.seed + 1)  # Clip-Cov's random picks: a separate stream
    z = problem.logits.detach().clone().to(DTYPE)
    reward_table = problem.correct.to(DTYPE)
    rows = torch.arange(P).repeat_interleave(n)  # prompt index of each token [N]

    ent = [float(policy_entropy(z).mean())]
    acc = [float(problem.accuracy(z).mean())]
    pred_dh: list[float] = []
    act_dh: list[float] = []
    lams: list[float] = []
    metric_hist: dict[str, list[float]] = {}

    for step in range(cfg.steps):
        with torch.no_grad():
            probs = torch.softmax(z, dim=-1)
            actions = torch.multinomial(probs, n, replacement=True, generator=gen)  # [P, n]
            rewards = reward_table.gather(1, actions)
            adv = grpo_advantages(rewards)
            lam = float(schedule.value) if schedule is not None else 1.0
            step_config = loss_config
            if schedule is not None:
                if hasattr(loss_config, "pos_adv_weight"):
                    step_config = dataclasses.replace(loss_config, pos_adv_weight=lam)
                else:  # a loss without the modifier: scale the positive advantages instead
                    adv = torch.where(adv > 0, lam * adv, adv)
            if cfg.entropy_control is not None:
                step_config = controlled(step_config, cfg.entropy_control)
            old_logprob = torch.log_softmax(z, dim=-1).gather(1, actions).reshape(N, 1)
        cols = actions.reshape(N)
        z_start = z.clone()
        step_metrics: dict[str, list[float]] = {}

        adv_flat = adv.reshape(N, 1)
        for _ in range(cfg.epochs):
            order = (torch.randperm(N, generator=gen) if cfg.minibatches > 1 else torch.arange(N))
            for idx in order.chunk(cfg.minibatches):
                z, metrics = _update(z, idx, rows, cols, old_logprob, adv_flat, cfg, step_config, loss_fn, sel_gen)
                for key, value in _scalar_metrics(metrics).items():
                    step_metrics.setdefault(key, []).append(value)

        with torch.no_grad():
            h_before = policy_entropy(z_start)
            h_after = policy_entropy(z)
            pred_dh.append(float(predicted_entropy_change(z_start, z - z_start).mean()))
            act_dh.append(float((h_after - h_before).mean()))
            ent.append(float(h_after.mean()))
            acc.append(float(problem.accuracy(z).mean()))
        lams.append(lam)
        for key, values in step_metrics.items():
            metric_hist.setdefault(key, [math.nan] * step).append(float(np.mean(values)))
        for key in metric_hist:
            if len(metric_hist[key]) < step + 1:
                metric_hist[key].append(math.nan)
        if schedule is not None:
            schedule.step(entropy=ent[-1])
        if cfg.entropy_control is not None:
            cfg.entropy_control.update(ent[-1])

    return DynamicsRun(
        label=label or cfg.mode,
        entropy=np.asarray(ent),
        accuracy=np.asarray(acc),
        predicted_dH=np.asarray(pred_dh),
        actual_dH=np.asarray(act_dh),
        positive_weight=np.asarray(lams),
        metrics={k: np.asarray(v) for k, v in metric_hist.items()},
        final_logits=z,
        seconds=time.perf_counter() - t0,
    )

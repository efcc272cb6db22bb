"""Run configuration: YAML files onto typed dataclasses, dotlist overrides, validation.

    cfg = load_config("configs/demo.yaml", ["algo.mode=kl_cov", "trainer.max_steps=50"])

Every key is checked: an unknown key (with the nearest known one suggested), a value of the wrong type,
a non-finite float (``.inf``, ``.nan``) or a value outside its allowed range raises ``ConfigError`` naming
the dotted key (``algo.mdoe``, ``optim.lr``); a YAML syntax error names the file, line and column. The
resolved config is written to the run directory as ``config.yaml`` by the trainer.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from fastcov.errors import ConfigError, UserError  # noqa: F401 - ConfigError re-exported
from fastcov.losses import LossConfig

if TYPE_CHECKING:
    from fastcov.schedules import PositiveWeightSchedule

# The attention and MLP projections of Qwen2/Llama-style decoders: model.lora_targets' default.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class ModelConfig:
    # Hugging Face path or directory (from_pretrained); None builds a fresh model from `arch`.
    path: str | None = None
    # Inline architecture for a fresh model: transformers config kwargs plus `model_type` (e.g. qwen2).
    arch: dict[str, Any] | None = None
    # Tokenizer path; "builtin:arith" builds the offline word-level tokenizer of the synthetic task.
    # None means: the tokenizer saved next to `path`.
    tokenizer: str | None = None
    gradient_checkpointing: bool = False
    # auto: flash_attention_2 when flash-attn is installed and a GPU is used, else sdpa.
    attn_implementation: Literal["auto", "sdpa", "flash_attention_2", "eager"] = "auto"
    # auto: bf16 on GPU, fp32 on CPU.
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    # Liger-Kernel's fused RMSNorm, SwiGLU and RoPE on the policy (the LM head is fastcov's own).
    # auto: on a GPU when liger-kernel is installed (extra `fastcov[liger]`); true: required; false: never.
    liger: bool | Literal["auto"] = "auto"
    # LoRA through peft (docs/trainer.md, "LoRA and QLoRA"): adapters of this rank on the lora_targets
    # modules; only they train, are checkpointed and are synced to the rollout engine, the base stays
    # frozen. 0 = off (every parameter trains).
    lora_rank: int = 0
    lora_alpha: float = 16.0  # adapter scale alpha / rank
    lora_dropout: float = 0.0
    # Linear modules that get adapters; "lm_head" listed: the LM head trains in full (not low-rank),
    # otherwise it stays frozen and the fused kernel skips its dW GEMM.
    lora_targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    # 4bit: QLoRA, the frozen base's Linear layers in NF4 (bitsandbytes, extra `fastcov[lora]`); needs lora_rank > 0.
    quantization: Literal["none", "4bit"] = "none"

    def validate(self) -> None:
        """Range checks of this section's own fields; raises ConfigError naming the key."""
        m = self
        _check((m.path is None) != (m.arch is None), "model.path",
               "set exactly one of model.path (pretrained) and model.arch (fresh model)")
        if m.arch is not None:
            _check("model_type" in m.arch, "model.arch.model_type", "required (e.g. qwen2)")
        _check(m.path is not None or m.tokenizer is not None, "model.tokenizer",
               "required when the model is built from model.arch")
        _check(m.lora_rank >= 0, "model.lora_rank", f"must be >= 0 (0 = off), got {m.lora_rank}")
        _check(m.lora_alpha > 0, "model.lora_alpha", f"must be > 0, got {m.lora_alpha}")
        _check(0 <= m.lora_dropout < 1, "model.lora_dropout", f"must be in [0, 1), got {m.lora_dropout}")
        _check(bool(m.lora_targets) and all(bool(t) for t in m.lora_targets), "model.lora_targets",
               "give at least one module name (e.g. q_proj)")
        _check(m.quantization == "none" or m.lora_rank > 0, "model.quantization",
               "a 4-bit base cannot train: set model.lora_rank > 0 (QLoRA)")


@dataclass
class SyntheticConfig:
    """Arithmetic word problems answered in \\boxed{}; written as verl-style parquet into the run dir."""

    enabled: bool = False
    n_train: int = 2000
    n_val: int = 200
    min_ops: int = 1
    max_ops: int = 2
    max_value: int = 9
    seed: int = 0


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    # When no val_files are given, this fraction of the training prompts is held out.
    val_fraction: float = 0.05
    max_prompt_len: int = 512
    # None uses the tokenizer's chat template; a string is a Jinja chat template to use instead.
    chat_template: str | None = None
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    # At most this many validation prompts are evaluated (0 = all).
    max_val_prompts: int = 0

    def validate(self) -> None:
        """Range checks of this section's own fields; raises ConfigError naming the key."""
        d = self
        _check(bool(d.train_files) or d.synthetic.enabled, "data.train_files",
               "give parquet files or enable data.synthetic")
        _check(0.0 <= d.val_fraction < 1.0, "data.val_fraction", f"must be in [0, 1), got {d.val_fraction}")
        _check(d.max_prompt_len > 0, "data.max_prompt_len", "must be > 0")
        _check(d.max_val_prompts >= 0, "data.max_val_prompts", "must be >= 0")
        s = d.synthetic
        _check(s.n_train > 0, "data.synthetic.n_train", "must be > 0")
        _check(s.n_val >= 0, "data.synthetic.n_val", "must be >= 0")
        _check(1 <= s.min_ops <= s.max_ops, "data.synthetic.min_ops", "need 1 <= min_ops <= max_ops")
        _check(s.max_value >= 2, "data.synthetic.max_value", "must be >= 2")


@dataclass
class RolloutConfig:
    # hf: the built-in Hugging Face engine; vllm: vLLM (extra `fastcov[vllm]`, see docs/vllm.md); or a name
    # registered in fastcov.trainer.rollout.ROLLOUT_ENGINES by a module under trainer.imports.
    engine: str = "hf"
    n: int = 8  # rollouts per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    # HF engine: at most this many sequences per generation batch (0 = no limit), and at most
    # token_budget KV-cache tokens per batch, rows × (longest prompt + max_new_tokens) (0 = no limit).
    batch_size: int = 0
    token_budget: int = 0
    # HF engine under ZeRO-3 (partitioned policy): node = one bf16 copy per node, on its first rank, which
    # samples for the whole node; rank = one copy on every rank (each samples its own prompts, in parallel).
    hf_copies: Literal["node", "rank"] = "node"
    # How sampling is seeded. batch: one generator per rank (or per node copy) draws for its whole batch,
    # so the samples depend on which rank samples which prompt; per_sample: each response from its own
    # generator, seeded by (trainer.seed, step, global prompt index, sample index) (vLLM: the request's
    # seed), the same samples on any number of hosts and ranks (docs/trainer.md, "Seeding").
    seeding: Literal["batch", "per_sample"] = "per_sample"
    # Weight sync policy -> rollout engine in buckets of this many MiB (any engine; 0 = per tensor).
    sync_bucket_mb: float = 64.0
    # vLLM only. colocated: a vLLM engine inside the training job sharing its GPUs (sleep/wake_up);
    # server: separate vLLM servers at vllm_server_urls (python -m fastcov.trainer.rollout_vllm serve --model ...).
    vllm_mode: Literal["colocated", "server"] = "colocated"
    vllm_tensor_parallel_size: int = 1  # colocated: consecutive training ranks per engine; server: per server
    vllm_gpu_memory_utilization: float = 0.5  # colocated: fraction of each GPU vLLM may take
    vllm_server_urls: list[str] = field(default_factory=list)  # e.g. [http://host:8000]
    # Asynchronous rollouts (docs/async.md); the YAML key is `async` (a Python keyword, hence the attribute's name).
    # off: generate, then train, in turn; one_step: batch t+1 is generated by the weights after step t-1 while step
    # t trains (a fixed schedule: reproducible bit for bit, also across a resume); stream: the engine keeps
    # generating into a bounded queue, every sample tagged with the policy version that drew it.
    async_mode: Literal["off", "one_step", "stream"] = field(default="off", metadata={"key": "async"})
    # stream: a batch drawn by weights more than this many versions older than the policy it would train is
    # dropped (stale: drop) or trained on with the rollout correction's weights (stale: correct). one_step: how many
    # batches ahead the fixed schedule runs (batch t+k drawn by the weights after step t-1: every batch k stale).
    max_staleness: int = 1
    stale: Literal["drop", "correct"] = "drop"
    sync_every: int = 1  # push the weights to the engine after every this many steps (one_step: 1)
    queue_size: int = 0  # stream: finished batches waiting at most (0: max_staleness)
    # An engine process (the HF engine of an asynchronous run) that dies is started again, filled with the
    # policy's current weights, up to this many times per run; 0: the run stops with one line naming it.
    engine_restarts: int = 0

    def validate(self) -> None:
        """Range checks of this section's own fields; raises ConfigError naming the key."""
        r = self
        _check(r.n >= 1, "rollout.n", f"must be >= 1, got {r.n}")
        _check(r.temperature > 0, "rollout.temperature", f"must be > 0, got {r.temperature}")
        _check(0 < r.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {r.top_p}")
        _check(r.max_new_tokens > 0, "rollout.max_new_tokens", "must be > 0")
        _check(r.batch_size >= 0, "rollout.batch_size", "must be >= 0")
        _check(0 <= r.sync_bucket_mb < float("inf"), "rollout.sync_bucket_mb",
               f"must be >= 0 (0 = per tensor), got {r.sync_bucket_mb}")
        _check(r.vllm_tensor_parallel_size >= 1, "rollout.vllm_tensor_parallel_size",
               f"must be >= 1, got {r.vllm_tensor_parallel_size}")
        _check(0 < r.vllm_gpu_memory_utilization <= 1, "rollout.vllm_gpu_memory_utilization",
               f"must be in (0, 1], got {r.vllm_gpu_memory_utilization}")
        for i, url in enumerate(r.vllm_server_urls):
            _check(url.startswith(("http://", "https://")), f"rollout.vllm_server_urls[{i}]",
                   f"must start with http:// or https://, got {url!r}")
        if r.engine == "vllm" and r.vllm_mode == "server":
            _check(bool(r.vllm_server_urls), "rollout.vllm_server_urls",
                   "give at least one server URL when rollout.vllm_mode=server")
        _check(not (r.vllm_server_urls and (r.engine != "vllm" or r.vllm_mode != "server")),
               "rollout.vllm_server_urls", "only used with rollout.engine=vllm and rollout.vllm_mode=server")
        _check(r.max_staleness >= 0, "rollout.max_staleness", f"must be >= 0, got {r.max_staleness}")
        _check(r.sync_every >= 1, "rollout.sync_every", f"must be >= 1, got {r.sync_every}")
        _check(r.queue_size >= 0, "rollout.queue_size", f"must be >= 0 (0 = max_staleness), got {r.queue_size}")
        _check(r.engine_restarts >= 0, "rollout.engine_restarts", f"must be >= 0, got {r.engine_restarts}")
        if r.async_mode == "off":
            return
        _check(r.seeding == "per_sample", "rollout.seeding",
               f"rollout.async={r.async_mode} draws in another process than the trainer's generator: needs per_sample")
        _check(r.engine != "vllm" or r.vllm_mode == "server", "rollout.vllm_mode",
               "colocated vLLM shares the trainer's devices and sleeps while the policy trains; asynchronous "
               "rollouts need an engine that runs beside the trainer: set rollout.vllm_mode=server")
        _check(r.async_mode != "one_step" or r.sync_every == 1, "rollout.sync_every",
               "rollout.async=one_step pushes the weights after every step (its fixed schedule): set 1, or use stream")
        _check(r.max_staleness >= 1, "rollout.max_staleness",
               f"rollout.async={r.async_mode} trains while the engine generates, so every batch is at least one "
               "version old: set >= 1")


@dataclass
class CodeRewardConfig:
    """Limits of the code sandbox (trainer/rewards/sandbox.py) for ``reward.task: code``."""

    cpu_s: float = 2.0  # CPU seconds per test run
    wall_s: float = 6.0  # wall clock per test run, then SIGKILL
    memory_mb: int = 512  # all the program's processes (a cgroup where one can be made), else address space each
    nproc: int = 8  # processes (RLIMIT_NPROC)
    max_output_kb: float = 1024.0  # stdout cap per run
    disk_mb: float = 32.0  # all the program may write, forks included (its work dir is a tmpfs this size)
    # A SandboxFusion /run_code endpoint (e.g. http://host:8080/run_code): programs run there instead.
    sandbox_fusion_url: str | None = None


@dataclass
class RewardConfig:
    # math: the last \boxed{} answer checked with math-verify; code: the response's last code block runs
    # against the prompt's tests (ground_truth = JSON {"inputs", "outputs"}) in a sandbox
    # (trainer/rewards/code_task.py).
    task: str = "math"  # a name in fastcov.trainer.rewards.REWARD_TASKS
    code: CodeRewardConfig = field(default_factory=CodeRewardConfig)
    kind: Literal["binary", "pm1"] = "binary"  # 1/0 or +1/-1
    timeout_s: float = 5.0
    # process: math-verify runs in a worker process that is killed after timeout_s (a hard limit);
    # inline: math-verify's own signal-based limit in the calling thread (faster, softer).
    sandbox: Literal["process", "inline"] = "process"
    # Size of the math-verify worker pool (process sandbox); 0: min(4, CPU count).
    workers: int = 0

    def validate(self) -> None:
        """Range checks of this section's own fields; raises ConfigError naming the key."""
        _check(self.timeout_s > 0, "reward.timeout_s", "must be > 0")
        _check(self.workers >= 0, "reward.workers", f"must be >= 0 (0 = automatic), got {self.workers}")
        c = self.code
        _check(c.cpu_s > 0 and c.wall_s > 0, "reward.code.cpu_s", "cpu_s and wall_s must be > 0")
        _check(c.memory_mb >= 32, "reward.code.memory_mb", f"must be >= 32, got {c.memory_mb}")
        _check(c.nproc >= 1, "reward.code.nproc", f"must be >= 1, got {c.nproc}")
        _check(c.max_output_kb > 0, "reward.code.max_output_kb", "must be > 0")
        _check(c.disk_mb > 0, "reward.code.disk_mb", f"must be > 0, got {c.disk_mb}")
        _check(c.sandbox_fusion_url is None or c.sandbox_fusion_url.startswith(("http://", "https://")),
               "reward.code.sandbox_fusion_url", "must start with http:// or https://")


@dataclass
class PrimeConfig:
    """PRIME (Cui et al. 2025, "Process Reinforcement through Implicit Rewards"): an implicit PRM trained
    online with the cross-entropy loss on outcome labels; token rewards beta * log(pi_rm / pi_ref).
    Used when ``algo.adv_estimator: prime`` (trainer/token_level/prime.py; docs/papers.md)."""

    beta: float = 0.05  # implicit reward scale
    lr: float = 1.0e-6  # reward-model learning rate (AdamW)
    outcome_coef: float = 1.0  # weight of the outcome reward's RLOO return
    process_coef: float = 1.0  # weight of the implicit process rewards' RLOO return
    # The reward model is updated on each batch's rollouts before (true: the paper's order) or after
    # (false) the process rewards are computed from it.
    update_before_reward: bool = True
    # Keep prompts whose rollout accuracy is in [acc_low, acc_high] (PRIME's online filter).
    acc_filter: bool = True
    acc_low: float = 0.2
    acc_high: float = 0.8


@dataclass
class RolloutCorrectionConfig:
    """algo.rollout_correction: importance weights π_old/π_rollout on the loss of every mode, rejection and the
    off-policy sequence mask (fastcov/correction.py; verl's algorithm.rollout_correction, TRL's
    vllm_importance_sampling_*; docs/trainer.md, "Rollout correction")."""

    # null: on with a vLLM rollout (another sampler than the policy), off with the built-in HF engine (it samples
    # from the policy itself: the weights would be 1 up to rounding)
    enabled: bool | None = None
    level: Literal["token", "sequence"] = "token"  # verl's rollout_is; TRL's token_* / sequence_*
    mode: Literal["truncate", "mask"] = "truncate"  # clamp (TIS) or zero (IcePop) outside [clip_min, clip_max]
    clip_max: float = 2.0
    clip_min: float | None = None
    # verl's rollout_rs / rollout_rs_threshold: "token_k1,seq_mean_k3" with "0.5_2.0,0.01" (null: no rejection)
    rejection: str | None = None
    rejection_threshold: str | float | None = None
    # TRL's off_policy_mask_threshold (DeepSeek-V3.2): drop the A < 0 tokens of sequences whose mean KL > this
    off_policy_mask_threshold: float | None = None
    # verl's bypass mode: the PPO ratio is taken against the rollout's own log-probs (pi / pi_rollout, two policies)
    # and the importance weights are left out (the ratio holds them); rejection and the off-policy mask still act.
    # false: verl's decoupled mode, AReaL's decoupled PPO (pi / pi_old clipped, times the weight pi_old / pi_rollout).
    bypass: bool = False


@dataclass
class EntropyControlConfig:
    """A target-entropy controller (fastcov.entropy_control.EntropyController; docs/trainer.md, "Entropy held
    at a target"): after every step it moves one knob so the rollout entropy goes to ``target``."""

    # nats per response token of the rollout batch, measured over all ranks, or a fraction of the mean entropy of
    # the first `window` steps written "0.75x" (the knob stays at init during them); null = off
    target: float | str | None = None
    # the value it moves: entropy_coef, kl_cov_coef / kl_cov_ratio (algo.mode kl_cov), clip_cov_ratio (clip_cov),
    # pos_weight (Jin et al.'s lambda on tokens with A > 0; EntroPIC's knob)
    knob: Literal["entropy_coef", "kl_cov_coef", "kl_cov_ratio", "clip_cov_ratio", "pos_weight"] = "entropy_coef"
    # step: +-delta per step, clipped (Skywork-OR1, TRL); proportional: value * exp(gain * (target - H) / target);
    # pi: init + s * (kp * e + ki * sum e), e = (target - H) / target, |sum e| <= integral_max (EntroPIC)
    rule: Literal["step", "proportional", "pi"] = "step"
    # the knob's value at step 1 (the pi rule's operating point); null: the algo value it replaces (pos_weight:
    # algo.pos_adv_weight)
    init: float | None = None
    delta: float | None = None  # step rule: change per step (required)
    gain: float = 0.5  # proportional rule
    kp: float | None = None  # pi rule: proportional gain, knob units per unit of relative error (required, >= 0)
    ki: float | None = None  # pi rule: integral gain (required, >= 0; 0: the proportional term alone)
    integral_max: float | None = None  # pi rule: anti-windup bound on |sum e|; null: (max - min) / ki
    # bounds; null: the knob's range (entropy_coef [0, 1], kl_cov_coef [0, 100], ratios [1e-5, 1], pos_weight [0, 1])
    min: float | None = None
    max: float | None = None
    # apply the knob only while the last step's entropy is low (TRL's "bonus only while H <= target"), else its
    # off value (0; pos_weight 1)
    gate: bool = False
    inclusive: bool = False  # H == target counts as low (TRL: true; Skywork-OR1, Jin et al.: false)
    window: int | None = None  # steps whose mean entropy a relative target ("0.75x") multiplies; null: 5
    # a schedule: the target moves linearly from `target` at step target_steps[0] to `target_end` (nats or "0.5x")
    # at step target_steps[1], and stays there
    target_end: float | str | None = None
    target_steps: tuple[int, int] | None = None


@dataclass
class EntropyAdvantageConfig:
    """Cheng et al. 2025 (arXiv 2506.14758): A_t <- A_t + min(alpha * H_t, |A_t| / kappa), H_t the rollout policy's
    token entropy (fastcov.advantages.entropy_advantage). alpha 0 = off."""

    alpha: float = 0.0
    kappa: float = 2.0


@dataclass
class PosWeightConfig:
    """Jin et al. 2025 ("Revisiting Entropy in RL for Large Reasoning Models"): the loss of tokens with A > 0 is
    multiplied by lambda. Off: lambda = algo.pos_adv_weight. On: lambda follows
    fastcov.schedules.PositiveWeightSchedule, stepped once per training step (docs/papers.md):
      entropy (the paper's): lambda starts at init (0) and after each step moves by -delta when the rollout entropy
        H < target_entropy (delta 0.2), +delta otherwise (Delta 0.05), clipped to [0, 1];
      stage: stages [[step, lambda], ...] (first at step 0); epoch: values, one per steps_per_epoch steps;
      constant: init forever."""

    enabled: bool = False
    kind: Literal["entropy", "stage", "epoch", "constant"] = "entropy"
    init: float = 0.0
    target_entropy: float = 0.2
    delta: float = 0.05
    stages: list[tuple[int, float]] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    steps_per_epoch: int = 0

    def schedule_args(self) -> dict[str, tuple[str, Any, Any]]:
        """PositiveWeightSchedule's keyword arguments for this kind: argument -> (this section's key, the value,
        a value the schedule always accepts)."""
        if self.kind == "entropy":
            return {"init": ("init", self.init, 0.0), "threshold": ("target_entropy", self.target_entropy, 0.2),
                    "step_size": ("delta", self.delta, 0.05)}
        if self.kind == "constant":
            return {"init": ("init", self.init, 1.0)}
        if self.kind == "stage":
            return {"stages": ("stages", self.stages, [(0, 1.0)])}
        return {"values": ("values", self.values, [1.0]),
                "steps_per_epoch": ("steps_per_epoch", self.steps_per_epoch or None, 1)}

    def schedule(self) -> PositiveWeightSchedule:
        """The lambda schedule this section describes (fastcov.schedules.PositiveWeightSchedule)."""
        from fastcov.schedules import PositiveWeightSchedule

        return PositiveWeightSchedule(self.kind, **{arg: v[1] for arg, v in self.schedule_args().items()})

    def validate(self, prefix: str = "algo.pos_weight") -> None:
        """When enabled, the schedule must build; a refusal names the key whose value alone the schedule
        refuses (the others set to values it accepts) with the schedule's reason, else the first key of the kind."""
        if not self.enabled:
            return
        try:
            self.schedule()
        except ValueError as exc:
            from fastcov.schedules import PositiveWeightSchedule

            args = self.schedule_args()
            key, why = next(iter(args.values()))[0], str(exc)
            for arg, (name, _, _) in args.items():
                try:
                    PositiveWeightSchedule(self.kind, **{a: (v[1] if a == arg else v[2]) for a, v in args.items()})
                except ValueError as alone:
                    key, why = name, _without_name(alone, arg)
                    break
            raise ConfigError(f"{prefix}.{key}: {why}") from None


# algo.pos_weight_<key> (0.4.0 and earlier) -> algo.pos_weight.<key>
RENAMED_POS_WEIGHT_KEYS = {"pos_weight_schedule": "enabled", "pos_weight_kind": "kind", "pos_weight_init": "init",
                           "pos_weight_target_entropy": "target_entropy", "pos_weight_delta": "delta",
                           "pos_weight_stages": "stages", "pos_weight_values": "values",
                           "pos_weight_steps_per_epoch": "steps_per_epoch"}


# LossConfig's fields the algo section carries (fastcov.losses.LossConfig is their one source: names, defaults,
# ranges); loss_scale_factor and check_finite are the trainer's to set.
LOSS_FIELDS = tuple(f.name for f in dataclasses.fields(LossConfig)
                    if f.name not in ("loss_scale_factor", "check_finite"))


def loss_config(a: AlgoConfig, pos_adv_weight: float) -> LossConfig:
    """The LossConfig of one update from the run's ``algo`` section (λ from its schedule)."""
    return LossConfig(**{**{k: getattr(a, k) for k in LOSS_FIELDS}, "pos_adv_weight": pos_adv_weight},
                      check_finite=False)  # a non-finite loss skips the step instead of raising


def _check_loss_fields(a: AlgoConfig) -> None:
    """LossConfig checks the ranges of its fields; a refusal names the algo key whose value alone LossConfig
    refuses (the others at their defaults, a bound's partner at a value that never refuses it), else the
    first of the pair it refuses together."""
    try:
        loss_config(a, a.pos_adv_weight)
    except ValueError as exc:
        partner = {"clip_cov_lb": {"clip_cov_ub": math.inf}, "clip_cov_ub": {"clip_cov_lb": -math.inf},
                   "cispo_clip_min": {"cispo_clip_max": max(a.cispo_clip_min or 0.0, LossConfig.cispo_clip_max)}}
        tries = [{k: getattr(a, k), **partner.get(k, {})} for k in LOSS_FIELDS]
        tries += [{k: getattr(a, k) for k in pair} for pair in (("clip_cov_lb", "clip_cov_ub"),
                                                                 ("cispo_clip_min", "cispo_clip_max"))]
        for kwargs in tries:
            try:
                LossConfig(**kwargs)
            except ValueError as alone:
                key = next(iter(kwargs))
                raise ConfigError(f"algo.{key}: {_without_name(alone, key)}") from None
        raise ConfigError(f"algo.clip_cov_lb: {exc}") from None  # not reached: a pair above refuses


def _without_name(exc: Exception, name: str) -> str:
    """The library's message without its leading argument name: the config key that replaces it says which."""
    msg = str(exc)
    return msg[len(name) + 1:] if msg.startswith(name + " ") else msg


@dataclass
class AlgoConfig:
    # prime: outcome + implicit process rewards, token-level (algo.prime); reinforce_pp with algo.kl_coef > 0:
    # REINFORCE++ with its token-level KL penalty (trainer/token_level/advantages.py); optimal_token_baseline:
    # verl's OTB, per-token baselines from the old log-probs and Σπ² of the fused pass.
    # a name in fastcov.advantages.ESTIMATORS, or prime / optimal_token_baseline (token-level)
    adv_estimator: str = "grpo"
    # REINFORCE++'s KL penalty in the reward: r_t = -kl_coef * (log pi_old - log pi_ref)(t), the outcome reward
    # added at the last token, returns summed to the end and normalised over the batch's tokens. 0 = off.
    kl_coef: float = 0.0
    prime: PrimeConfig = field(default_factory=PrimeConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    mode: str = "vanilla"  # a name in fastcov.losses.MODES: vanilla, clip_cov, kl_cov, or one registered
    loss_agg: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    # global: Clip-Cov/KL-Cov statistics and selection over the whole mini-batch on all data-parallel
    # ranks (independent of the micro-batch split and the rank count); microbatch: per micro-batch and
    # rank, like verl 0.9.1 (for comparison).
    scope: Literal["global", "microbatch"] = "global"
    # The loss hyperparameters below take fastcov.losses.LossConfig's defaults (one source of truth).
    clip_low: float = LossConfig.clip_low
    clip_high: float = LossConfig.clip_high  # > clip_low gives DAPO's clip-higher
    dual_clip_c: float | None = LossConfig.dual_clip_c
    clip_cov_ratio: float = LossConfig.clip_cov_ratio
    clip_cov_lb: float = LossConfig.clip_cov_lb
    clip_cov_ub: float = LossConfig.clip_cov_ub
    kl_cov_ratio: float = LossConfig.kl_cov_ratio
    kl_cov_coef: float = LossConfig.kl_cov_coef
    # CISPO's bounds on its stop-gradient weight (ε_max 5.0 as ScaleRL/TRL) and SAPO's temperatures (A > 0 / A ≤ 0)
    cispo_clip_max: float = LossConfig.cispo_clip_max
    cispo_clip_min: float | None = LossConfig.cispo_clip_min
    sapo_tau_pos: float = LossConfig.sapo_tau_pos
    sapo_tau_neg: float = LossConfig.sapo_tau_neg
    # VESPO's gamma weight of the sequence ratio (TRL's vespo_* defaults)
    vespo_k_pos: float = LossConfig.vespo_k_pos
    vespo_lambda_pos: float = LossConfig.vespo_lambda_pos
    vespo_k_neg: float = LossConfig.vespo_k_neg
    vespo_lambda_neg: float = LossConfig.vespo_lambda_neg
    entropy_coef: float = LossConfig.entropy_coef
    pos_adv_weight: float = LossConfig.pos_adv_weight
    neg_adv_weight: float = LossConfig.neg_adv_weight
    # Jin et al.'s lambda on the loss of tokens with A > 0, on a schedule (PosWeightConfig; off: pos_adv_weight)
    pos_weight: PosWeightConfig = field(default_factory=PosWeightConfig)
    high_entropy_fraction: float | None = LossConfig.high_entropy_fraction
    # random: KL-Cov's control (as many tokens, at random); random_matched: Clip-Cov's (as many as it picks with
    # c_t, uniformly among all valid tokens). Both log sel/jaccard_vs_cov (docs/design.md §4).
    cov_score: Literal["batch", "vocab", "random", "random_matched"] = LossConfig.cov_score
    # DAPO dynamic sampling (verl's algorithm.filter_groups): drop prompt groups whose rewards are all equal
    # and, while fewer than trainer.prompts_per_step groups are kept, generate another batch of prompts, up
    # to max_gen_batches batches per step (0 = until full, as verl's max_num_gen_batches <= 0); a full batch
    # is cut to prompts_per_step groups, a batch still short after max_gen_batches trains on what it has.
    dapo_filter: bool = False
    max_gen_batches: int = 1
    ppo_epochs: int = 1
    mini_batches: int = 1  # optimizer steps per rollout batch
    entropy_control: EntropyControlConfig = field(default_factory=EntropyControlConfig)
    entropy_advantage: EntropyAdvantageConfig = field(default_factory=EntropyAdvantageConfig)

    def validate(self) -> None:
        """Range checks of this section's own fields; raises ConfigError naming the key (the loss keys' ranges
        are fastcov.losses.LossConfig's, the schedule's PosWeightConfig's)."""
        a = self
        _check_loss_fields(a)  # LossConfig's ranges; below, the trainer's narrower ones
        # clip_low = 1 opens the lower clip (ratio >= 0 always), as the paper's Clip-Cov runs do
        _check(0 <= a.clip_low <= 1, "algo.clip_low", f"must be in [0, 1], got {a.clip_low}")
        for name in ("pos_adv_weight", "neg_adv_weight"):
            v = getattr(a, name)
            _check(0 <= v <= 1, f"algo.{name}", f"must be in [0, 1], got {v}")
        a.pos_weight.validate()
        _check(a.ppo_epochs >= 1, "algo.ppo_epochs", "must be >= 1")
        _check(a.mini_batches >= 1, "algo.mini_batches", "must be >= 1")
        _check(a.kl_coef >= 0, "algo.kl_coef", f"must be >= 0, got {a.kl_coef}")
        _check(a.kl_coef == 0 or a.adv_estimator == "reinforce_pp", "algo.kl_coef",
               "the token-level KL penalty is REINFORCE++'s: set algo.adv_estimator=reinforce_pp (or kl_coef 0)")
        pr = a.prime
        _check(pr.beta > 0, "algo.prime.beta", f"must be > 0, got {pr.beta}")
        _check(pr.lr > 0, "algo.prime.lr", f"must be > 0, got {pr.lr}")
        _check(pr.outcome_coef >= 0 and pr.process_coef >= 0, "algo.prime.outcome_coef", "coefficients must be >= 0")
        _check(0 <= pr.acc_low <= pr.acc_high <= 1, "algo.prime.acc_low", "need 0 <= acc_low <= acc_high <= 1")
        _check(a.max_gen_batches >= 0, "algo.max_gen_batches",
               f"must be >= 0 (0 = until full), got {a.max_gen_batches}")
        _check(a.max_gen_batches == 1 or a.dapo_filter, "algo.max_gen_batches",
               "refilling only applies to DAPO's filter: set algo.dapo_filter=true (or max_gen_batches 1)")


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    schedule: Literal["constant", "warmup", "cosine"] = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # cosine floor, as a fraction of lr
    grad_clip: float = 1.0

    def validate(self) -> None:
        """Range checks of this section's own fields; raises ConfigError naming the key."""
        o = self
        _check(o.lr > 0, "optim.lr", f"must be > 0, got {o.lr}")
        _check(o.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        _check(all(0 <= b < 1 for b in o.betas), "optim.betas", "must be in [0, 1)")
        _check(o.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
        _check(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]")
        _check(o.grad_clip >= 0, "optim.grad_clip", "must be >= 0 (0 disables)")


@dataclass
class TrainerConfig:
    run_dir: str = "runs/default"
    seed: int = 0
    max_steps: int = 100
    prompts_per_step: int = 16  # global, over all data-parallel ranks
    micro_token_budget: int = 8192  # tokens per micro-batch and rank (prompt + response)
    # The same for step 4's no-grad pass over the whole rollout batch (the old log-probs; verl's
    # log_prob_max_token_len_per_gpu); None: micro_token_budget. On CPU smaller is faster, the activations
    # staying in cache (python -m bench.logprob_profile, hidden 256: 1024-2048 took 0.74-0.76x of 8192's
    # time with both cores busy, 1024 0.91x on a quieter machine).
    logprob_token_budget: int | None = None
    # Concatenate several sequences per row (attention confined to each: a block-diagonal causal mask,
    # or flash-attn's position-id packing) instead of one padded sequence per row. Same log-probs; less
    # padding (CPU, hidden 256 x 4 layers, mixed lengths: 1.7x the tokens/s of padding; equal when lengths are uniform).
    packing: bool = True
    zero_stage: int = 0
    # ZeRO-Offload: keep the fp32 master weights and Adam moments (12 bytes/parameter / world) in host
    # memory and step them there (DeepSpeed's CPU Adam); needs zero_stage >= 1. What fits Qwen2.5-32B on
    # 8 x 80 GB (fastcov plan --config configs/qwen2.5-32b-kl-cov.yaml).
    offload_optimizer: bool = False
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # CPU runs: torch intra-op threads, pinned so that a seed gives the same numbers on machines with
    # different core counts (0: torch's default, which follows the machine and OMP_NUM_THREADS).
    threads: int = 1
    # Multi-rank runs: seconds a collective waits for a peer before the run stops with one line naming the
    # lost rank and the last intact checkpoint (0: DeepSpeed's default, 30 min). Longer than any step phase
    # where ranks wait on each other (a node's first rank sampling for the node, a checkpoint write).
    collective_timeout_s: float = 0.0
    # Modules imported before the config is checked: where a user registers a loss mode
    # (fastcov.losses.register), an advantage estimator or a reward task, then names it in YAML.
    imports: list[str] = field(default_factory=list)
    eval_every: int = 10  # 0 = never; evaluation also runs at step 0 and at the end
    eval_k: int = 1
    eval_temperature: float = 0.6  # for data sources aime/aime25/amc; others are greedy
    # Sample eval_k responses at eval_temperature for every data source (pass@k, diversity for all).
    eval_sample_all: bool = False
    eval_max_new_tokens: int | None = None  # None: rollout.max_new_tokens
    save_every: int = 0  # 0 = only at the end and on Ctrl-C (and by save_every_minutes)
    # A checkpoint at the first step end this many minutes after the last one (0 = off): a crash loses at
    # most this much work whatever save_every is.
    save_every_minutes: float = 30.0
    # Gradient checkpointing's saved layer inputs go to pinned host memory during the forward and come
    # back for the backward (needs model.gradient_checkpointing; on CPU there is nowhere to offload to: a no-op).
    offload_activations: bool = False
    keep_last: int = 2
    progress: bool = True
    # Write <run>/timeline.jsonl: every phase's start and end, and an asynchronous engine's busy spans (docs/async.md).
    timeline: bool = False
    # Where the metrics go besides metrics.jsonl (TRL's report_to, verl's trainer.logger), through accelerate's
    # trackers: tensorboard (pip install 'fastcov[tensorboard]'; <run_dir>/tensorboard), wandb, mlflow, comet_ml,
    # aim, clearml, dvclive, swanlab, trackio, or one a trainer.imports module registers
    # (accelerate.tracking.register_tracker_class); "all": every installed one; [] or "none": none.
    report_to: str | list[str] = field(default_factory=list)
    project: str = "fastcov"  # the trackers' project (W&B project, MLflow experiment); runs are named by run_dir
    # A Hub repo id (user/name): at the end of a run that reaches max_steps rank 0 uploads final/ there
    # (huggingface_hub; token from HF_TOKEN or `hf auth login`), as `fastcov push RUN_DIR --repo ID` does.
    push_to_hub: str | None = None

    def validate(self) -> None:
        """Range checks of this section's own fields; raises ConfigError naming the key."""
        t = self
        _check(t.max_steps >= 0, "trainer.max_steps", "must be >= 0")
        _check(t.prompts_per_step >= 1, "trainer.prompts_per_step", "must be >= 1")
        _check(t.micro_token_budget >= 1, "trainer.micro_token_budget", "must be >= 1")
        _check(t.logprob_token_budget is None or t.logprob_token_budget >= 1, "trainer.logprob_token_budget",
               f"must be >= 1 or null (= trainer.micro_token_budget), got {t.logprob_token_budget}")
        _check(t.threads >= 0, "trainer.threads", f"must be >= 0 (0 = torch's default), got {t.threads}")
        _check(t.collective_timeout_s >= 0, "trainer.collective_timeout_s",
               f"must be >= 0 (0 = DeepSpeed's default), got {t.collective_timeout_s}")
        _check(t.zero_stage in (0, 1, 2, 3), "trainer.zero_stage", f"must be 0, 1, 2 or 3, got {t.zero_stage}")
        _check(not t.offload_optimizer or t.zero_stage >= 1, "trainer.offload_optimizer",
               "offloading the optimizer states needs trainer.zero_stage >= 1")
        _check(t.eval_every >= 0, "trainer.eval_every", "must be >= 0")
        _check(t.eval_k >= 1, "trainer.eval_k", "must be >= 1")
        _check(t.save_every >= 0, "trainer.save_every", "must be >= 0")
        _check(t.save_every_minutes >= 0, "trainer.save_every_minutes", "must be >= 0 (0 = off)")
        _check(t.keep_last >= 1, "trainer.keep_last", "must be >= 1")
        _check(t.push_to_hub is None or re.fullmatch(r"[\w.-]+(/[\w.-]+)?", t.push_to_hub) is not None,
               "trainer.push_to_hub", f"must be a Hub repo id (namespace/name) or null, got {t.push_to_hub!r}")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(self)


def config_key(f: dataclasses.Field) -> str:
    """A field's key in YAML and overrides: its name, or ``metadata["key"]`` where the key is a Python keyword
    (``rollout.async`` is the attribute ``async_mode``)."""
    return f.metadata.get("key", f.name)


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {config_key(f): _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_plain(v) for v in obj]
    return obj


# ----------------------------------------------------------------------------------------------- typing

def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and return it converted (int -> float, list -> tuple)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as exc:
                errors.append(exc)
        if len(errors) == 1:  # Optional[X]: X's own message says more
            raise errors[0]
        raise ConfigError(f"{key}: {value!r} does not match {_type_name(tp)}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return _build(tp, value, key)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        if origin is tuple:
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
            if len(value) != len(args):
                raise ConfigError(f"{key}: expected {len(args)} items, got {len(value)}")
            return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True)))
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)] if args else list(value)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            # PyYAML reads "1e-4" (no dot) as a string.
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{key}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            value = float(value)
        except OverflowError:  # an int too large for a float
            raise ConfigError(f"{key}: {value!r} is too large") from None
        if not math.isfinite(value):
            raise ConfigError(f"{key}: must be a finite number, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported annotation {tp!r}")  # pragma: no cover


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    attr = {config_key(f): f.name for f in dataclasses.fields(cls)}  # YAML key -> attribute
    names = set(attr)
    for k in data:
        if k not in names:
            full = f"{prefix}.{k}" if prefix else str(k)
            near = difflib.get_close_matches(str(k), sorted(names), n=1, cutoff=0.6)
            hint = (f"did you mean {(f'{prefix}.' if prefix else '') + near[0]!r}?" if near
                    else f"known keys{(' of ' + prefix) if prefix else ''}: {', '.join(sorted(names))}")
            raise ConfigError(f"unknown config key {full!r}; {hint}")
    kwargs = {}
    for k, v in data.items():
        full = f"{prefix}.{k}" if prefix else k
        kwargs[attr[k]] = _coerce(v, hints[attr[k]], full)
    return cls(**kwargs)


# ----------------------------------------------------------------------------------------------- values

def positive_weight_schedule(a: AlgoConfig) -> PositiveWeightSchedule:
    """The lambda schedule an ``algo`` section with ``pos_weight.enabled: true`` describes."""
    return a.pos_weight.schedule()


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


# advantage estimators the trainer implements itself (token-level)
TRAINER_ESTIMATORS = ("prime", "optimal_token_baseline")


def _check_registered(cfg: Config) -> None:
    """Import ``trainer.imports`` (where users register their own modes, estimators and reward tasks),
    then check every name against its registry."""
    import importlib

    from fastcov.advantages import ESTIMATORS
    from fastcov.losses import MODES
    from fastcov.trainer.rewards import REWARD_TASKS
    from fastcov.trainer.rollout import ROLLOUT_ENGINES

    for i, module in enumerate(cfg.trainer.imports):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"trainer.imports[{i}]: cannot import {module!r} ({exc})") from None
    a = cfg.algo
    for registry, value, key, extra in ((MODES, a.mode, "algo.mode", ()),
                                        (ESTIMATORS, a.adv_estimator, "algo.adv_estimator", TRAINER_ESTIMATORS),
                                        (REWARD_TASKS, cfg.reward.task, "reward.task", ()),
                                        (ROLLOUT_ENGINES, cfg.rollout.engine, "rollout.engine", ())):
        if value not in registry and value not in extra:
            names = ", ".join(sorted(registry.names() + tuple(extra)))
            near = difflib.get_close_matches(str(value), list(registry.names()) + list(extra), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"{key}: unknown {registry.kind} {value!r}{hint}; registered: {names}")
    _check(a.cov_score != "random_matched" or MODES.get(a.mode).selector is not None, "algo.cov_score",
           f"random_matched is a control of a token selection, and algo.mode={a.mode} selects none (clip_cov, kl_cov)")
    _check_trackers(cfg.trainer.report_to)


# trainer.report_to: accelerate's built-in trackers -> what installs each
TRACKER_INSTALL = {"tensorboard": "pip install 'fastcov[tensorboard]'", "wandb": "pip install wandb",
                   "mlflow": "pip install mlflow", "comet_ml": "pip install comet-ml", "aim": "pip install aim",
                   "clearml": "pip install clearml", "dvclive": "pip install dvclive", "swanlab": "pip install swanlab",
                   "trackio": "pip install trackio"}


def _check_trackers(report_to: str | list[str]) -> None:
    """Every trainer.report_to name a tracker accelerate knows (its own, or registered by trainer.imports), and
    installed; after trainer.imports ran."""
    names = [n for n in ([report_to] if isinstance(report_to, str) else report_to) if n not in ("none", "all")]
    if not names:
        return
    try:
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers
    except ImportError:
        raise ConfigError("trainer.report_to: the trackers need accelerate: pip install 'fastcov[train]'") from None
    installed = {str(t) for t in get_available_trackers()}
    for name in names:
        _check(name in LOGGER_TYPE_TO_CLASS, "trainer.report_to",
               f"unknown tracker {name!r}; accelerate's: {', '.join(TRACKER_INSTALL)}, or one a trainer.imports "
               "module registers (accelerate.tracking.register_tracker_class)")
        _check(name not in TRACKER_INSTALL or name in installed, "trainer.report_to",
               f"{name} is not installed: {TRACKER_INSTALL.get(name)}")


# knob -> (the algo field whose value it replaces, the modes it acts in; None: any)
ENTROPY_KNOBS = {"entropy_coef": ("entropy_coef", None), "kl_cov_coef": ("kl_cov_coef", ("kl_cov",)),
                 "kl_cov_ratio": ("kl_cov_ratio", ("kl_cov",)), "clip_cov_ratio": ("clip_cov_ratio", ("clip_cov",)),
                 "pos_weight": ("pos_adv_weight", None)}


def entropy_controller(a: AlgoConfig):
    """The EntropyController ``algo.entropy_control`` describes, or None when its target is null."""
    from fastcov.entropy_control import EntropyController

    c = a.entropy_control
    if c.target is None:
        return None
    init = c.init if c.init is not None else getattr(a, ENTROPY_KNOBS[c.knob][0])
    return EntropyController(c.target, c.knob, init, rule=c.rule, delta=c.delta, gain=c.gain, kp=c.kp, ki=c.ki,
                             integral_max=c.integral_max, min=c.min, max=c.max, gate=c.gate, inclusive=c.inclusive,
                             window=c.window, target_end=c.target_end, target_steps=c.target_steps)


def _validate_entropy_control(a: AlgoConfig) -> None:
    c, e = a.entropy_control, a.entropy_advantage
    _check(e.alpha >= 0, "algo.entropy_advantage.alpha", f"must be >= 0 (0 = off), got {e.alpha}")
    _check(e.kappa > 0, "algo.entropy_advantage.kappa", f"must be > 0, got {e.kappa}")
    _check(e.alpha == 0 or a.adv_estimator != "prime", "algo.entropy_advantage.alpha",
           "shapes sequence-level advantages; PRIME's token-level ones are not supported (set alpha 0)")
    if c.target is None:
        return
    modes = ENTROPY_KNOBS[c.knob][1]
    _check(modes is None or a.mode in modes, "algo.entropy_control.knob",
           f"{c.knob} acts only in algo.mode {' / '.join(modes or ())}, not {a.mode}: "
           "it would move a value nothing reads")
    _check(not (c.knob == "pos_weight" and a.pos_weight.enabled), "algo.entropy_control.knob",
           "pos_weight is already scheduled by algo.pos_weight.enabled; use one of the two")
    from fastcov.entropy_control import ArgumentError

    try:
        entropy_controller(a)
    except ArgumentError as exc:
        key = exc.argument if exc.argument in {f.name for f in dataclasses.fields(c)} else "knob"
        raise ConfigError(f"algo.entropy_control.{key}: {exc}") from None


def _validate_across(cfg: Config) -> None:
    """The checks that read more than one section."""
    m, a, r, t = cfg.model, cfg.algo, cfg.rollout, cfg.trainer
    _check(m.quantization == "none" or t.zero_stage < 3, "model.quantization",
           "ZeRO-3 cannot partition 4-bit weights; use trainer.zero_stage 0-2")
    _check(m.lora_rank == 0 or r.engine != "vllm" or r.vllm_mode == "colocated",
           "model.lora_rank", "LoRA syncs its adapters to a colocated vLLM or the HF engine; vLLM servers take full "
           "weights (set rollout.vllm_mode=colocated or rollout.engine=hf)")
    _check(not t.offload_activations or m.gradient_checkpointing, "trainer.offload_activations",
           "offloads gradient checkpointing's saved activations: set model.gradient_checkpointing=true")
    _check(a.mini_batches <= t.prompts_per_step, "algo.mini_batches", "must be <= trainer.prompts_per_step")
    _check(t.prompts_per_step % a.mini_batches == 0, "algo.mini_batches",
           f"{a.mini_batches} does not divide trainer.prompts_per_step={t.prompts_per_step}; pick a divisor "
           "so every mini-batch holds the same number of prompts")
    if a.adv_estimator in ("grpo", "dr_grpo", "rloo", "prime"):
        _check(r.n >= 2, "rollout.n", f"{a.adv_estimator} needs >= 2 rollouts per prompt")
    if r.async_mode != "off":
        _check(m.quantization == "none", "model.quantization",
               "an asynchronous run's engine holds its own copy of the policy, which has no 4-bit form; use "
               "model.quantization=none or rollout.async=off")
        _check(r.stale != "correct" or rollout_correction_enabled(cfg), "rollout.stale",
               "correct trains stale batches with the rollout correction's weights: set "
               "algo.rollout_correction.enabled=true (or null), or rollout.stale=drop")
        _check(r.engine_restarts == 0 or t.zero_stage < 3, "rollout.engine_restarts",
               "a restarted engine is filled from this rank's full weights, which ZeRO-3 partitions: "
               "set 0 or trainer.zero_stage <= 2")


def validate(cfg: Config) -> Config:
    """Range checks that types cannot express: each section's own (its ``validate()``, next to its fields),
    then those across sections; raises ConfigError naming the key."""
    _check_registered(cfg)
    for section in (cfg.model, cfg.data, cfg.rollout, cfg.reward, cfg.algo, cfg.optim, cfg.trainer):
        section.validate()
    _validate_across(cfg)
    _validate_entropy_control(cfg.algo)
    _validate_rollout_correction(cfg)
    return cfg


def rollout_correction_enabled(cfg: Config) -> bool:
    """Whether the run corrects for its rollout engine: algo.rollout_correction.enabled, or by default with vLLM
    and with asynchronous rollouts (whose samples come from older weights)."""
    on = cfg.algo.rollout_correction.enabled
    return (cfg.rollout.engine != "hf" or cfg.rollout.async_mode != "off") if on is None else on


# modes outside the PPO-clip family (fastcov/policy_modes.py): what does not apply to them
SELECTION_FREE_MODES = ("cispo", "gspo", "sapo", "cispo_seq", "sapo_seq", "vespo")


def _validate_rollout_correction(cfg: Config) -> None:
    rc, a = cfg.algo.rollout_correction, cfg.algo
    _check(rc.clip_max > 0, "algo.rollout_correction.clip_max", f"must be a ratio > 0, got {rc.clip_max}")
    _check(rc.clip_min is None or 0 < rc.clip_min <= rc.clip_max, "algo.rollout_correction.clip_min",
           f"must be in (0, clip_max], got {rc.clip_min}")
    _check((rc.rejection is None) == (rc.rejection_threshold is None), "algo.rollout_correction.rejection_threshold",
           "set both rejection and rejection_threshold, or neither")
    if rc.rejection is not None:
        import torch

        from fastcov.correction import rollout_rejection

        try:  # the library's own parser, on a one-token batch
            rollout_rejection(torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), rc.rejection,
                              rc.rejection_threshold)
        except (ValueError, TypeError) as exc:
            key = "rejection" if "criteria" in str(exc) else "rejection_threshold"
            raise ConfigError(f"algo.rollout_correction.{key}: {exc}") from None
    _check(rc.off_policy_mask_threshold is None or rc.off_policy_mask_threshold >= 0,
           "algo.rollout_correction.off_policy_mask_threshold", "must be >= 0")
    _check(not rc.bypass or rollout_correction_enabled(cfg), "algo.rollout_correction.bypass",
           "takes the PPO ratio against the rollout's log-probs, part of the rollout correction: set "
           "algo.rollout_correction.enabled=true")
    if a.mode in SELECTION_FREE_MODES and a.mode != "gspo":  # GSPO's loss is PPO's clip (of the sequence ratio)
        _check(a.dual_clip_c is None, "algo.dual_clip_c",
               f"the dual clip bounds PPO's clipped loss for A < 0; algo.mode={a.mode} has no such loss (set null)")


# ----------------------------------------------------------------------------------------------- loading

def _parse_scalar(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (value parsed as YAML) to a nested dict, in place."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value")
        key, text = item.split("=", 1)
        key = key.strip()
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r}: bad key {key!r}")
        node = data
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(parts[: i + 1])} is not a section")
            node = child
        node[parts[-1]] = _parse_scalar(text)
    return data


def _model_source_from_overrides(data: dict[str, Any], overrides: list[str]) -> None:
    """An override ``model.path=...`` replaces the file's model source, in place: its ``model.arch`` goes, and so
    does its ``model.tokenizer`` (the fresh model's, e.g. builtin:arith) unless an override sets one. Overrides
    that set both ``model.path`` and ``model.arch`` stay an error."""
    pairs = [item.split("=", 1) for item in overrides if "=" in item]
    keys = {k.strip() for k, _ in pairs}
    model = data.get("model")
    if not isinstance(model, dict) or model.get("arch") is None or any(
            k == "model.arch" or k.startswith("model.arch.") for k in keys):
        return
    if any(k.strip() == "model.path" and _parse_scalar(v) is not None for k, v in pairs):
        del model["arch"]
        if "model.tokenizer" not in keys:
            model.pop("tokenizer", None)


def _map_renamed_keys(data: dict[str, Any]) -> None:
    """algo.pos_weight_<key> -> algo.pos_weight.<key>, in place, with a one-line warning naming the new key;
    the old and the new key both set is an error."""
    import warnings

    algo = data.get("algo")
    if not isinstance(algo, dict):
        return
    for old, new in RENAMED_POS_WEIGHT_KEYS.items():
        if old not in algo:
            continue
        section = algo.setdefault("pos_weight", {})
        if not isinstance(section, dict):
            return  # _build says what is wrong with algo.pos_weight
        if new in section:
            raise ConfigError(f"algo.{old}: renamed algo.pos_weight.{new}, which is set too; keep only the new key")
        warnings.warn(f"algo.{old} is deprecated: use algo.pos_weight.{new}", FutureWarning, stacklevel=3)
        section[new] = algo.pop(old)


def _map_tracker_keys(data: dict[str, Any]) -> None:
    """trainer.tensorboard / trainer.wandb (booleans) -> names in trainer.report_to, trainer.wandb_project ->
    trainer.project, in place, each with a one-line warning naming the new key."""
    import warnings

    t = data.get("trainer")
    if not isinstance(t, dict):
        return
    for old in ("tensorboard", "wandb"):
        if old in t:
            value = t.pop(old)
            _check(isinstance(value, bool), f"trainer.{old}", f"expected true/false, got {value!r}")
            warnings.warn(f"trainer.{old} is deprecated: use trainer.report_to: [{old}]", FutureWarning, stacklevel=3)
            if value:
                names = t.get("report_to") or []
                names = [names] if isinstance(names, str) else list(names)
                t["report_to"] = names if old in names else names + [old]
    if "wandb_project" in t:
        if "project" in t:
            raise ConfigError("trainer.wandb_project: renamed trainer.project, which is set too; keep only the new key")
        warnings.warn("trainer.wandb_project is deprecated: use trainer.project", FutureWarning, stacklevel=3)
        t["project"] = t.pop("wandb_project")


def config_from_dict(data: dict[str, Any]) -> Config:
    if not isinstance(data, dict):
        raise ConfigError(f"config: expected a mapping at the top level, got {type(data).__name__}")
    _map_renamed_keys(data)
    _map_tracker_keys(data)
    return validate(_build(Config, data, ""))


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read a YAML file (or start from defaults when ``path`` is None), apply overrides, validate."""
    import yaml

    from fastcov.configs import resolve_config, shipped_names

    data: dict[str, Any] = {}
    if path is not None:
        p = resolve_config(path)  # a file on disk, else the shipped config of that name
        if p.is_dir():
            raise ConfigError(f"config file {str(p)!r} is a directory; give a YAML file (see configs/)")
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist; give a YAML file (see configs/) or a shipped "
                              f"config's name: {', '.join(shipped_names())}")
        try:
            with open(p, encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except OSError as exc:
            raise ConfigError(f"config file {str(p)!r}: cannot read it ({exc.strerror or exc})") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config file {str(p)!r}: not a UTF-8 text file; give a YAML file") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            what = getattr(exc, "problem", None) or "invalid YAML"
            raise ConfigError(f"config file {str(p)!r}:{where}: YAML syntax error ({what}); fix the file") from None
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(p)!r}: expected a mapping (key: value) at the top level, "
                              f"got {type(data).__name__}")
        _check_file_sections(data, Config, "", str(p))
    _model_source_from_overrides(data, list(overrides or []))
    apply_overrides(data, list(overrides or []))
    return config_from_dict(data)


def _check_file_sections(data: dict[str, Any], cls: type, prefix: str, path: str) -> None:
    """A section of the config file that holds a value instead of keys (``trainer: 5``), named against the file:
    an override into it (``trainer.run_dir=...``) would otherwise report the file's mistake as its own."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        value, tp = data.get(f.name), hints[f.name]
        if value is None or not (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
            continue
        if not isinstance(value, dict):
            raise ConfigError(f"config file {path!r}: {prefix}{f.name}: expected a section (key: value lines), "
                              f"got {value!r}")
        _check_file_sections(value, tp, f"{prefix}{f.name}.", path)


def save_config(cfg: Config, path: str | Path) -> None:
    import yaml

    with open(path, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)

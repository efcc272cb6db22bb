"""The trained policy: DeepSpeed (ZeRO 0-3) around a PolicyModel, AdamW, lr schedule, gradient clipping.

One process on CPU works without a launcher (DS_ACCELERATOR=cpu, gloo); several processes come from
the ``deepspeed`` or ``torchrun`` launchers, which set RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR.
bf16 on GPU, fp32 on CPU. The lr is a pure function of the optimizer step (``lr_at``), so resuming the
step count restores the schedule.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from fastcov.trainer.runtime.distributed import all_reduce_
from fastcov.trainer.runtime.lora import has_adapters


def lr_at(step: int, ocfg, max_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based) under OptimConfig ``ocfg``."""
    base = ocfg.lr
    w = ocfg.warmup_steps
    if ocfg.schedule in ("warmup", "cosine") and w > 0 and step < w:
        return base * (step + 1) / w
    if ocfg.schedule == "cosine":
        span = max(1, max_steps - w)
        t = min(1.0, max(0, step - w) / span)
        floor = ocfg.min_lr_ratio
        return base * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))
    return base


def ds_config(cfg, device: torch.device, world: int) -> dict:
    zero = {"stage": cfg.trainer.zero_stage}
    if cfg.trainer.zero_stage == 3:
        # no parameter stays whole on every rank: each is gathered only while its layer runs
        zero.update({"stage3_param_persistence_threshold": 0})
    if cfg.trainer.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world,
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": device.type == "cuda" and cfg.model.dtype != "fp32"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


class DeepSpeedPolicy:
    """DeepSpeed engine plus the bits of state the loop needs (optimizer steps, skipped steps)."""

    def __init__(self, policy, cfg, device: torch.device, world: int):
        import deepspeed

        self.cfg = cfg
        self.device = device
        self.zero_stage = cfg.trainer.zero_stage
        self.world = world
        if self.zero_stage == 3:
            policy.register_external_head()
        o = cfg.optim
        params = [p for p in policy.parameters() if p.requires_grad]
        if cfg.trainer.offload_optimizer:  # the host-side step: DeepSpeed's vectorised CPU AdamW
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            from fastcov.trainer.runtime.extensions import take_over_stale_locks

            take_over_stale_locks()  # its JIT build waits for ever on a lock a killed run left

            optimizer = DeepSpeedCPUAdam(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                         weight_decay=o.weight_decay, adamw_mode=True)
        else:
            optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                          weight_decay=o.weight_decay)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=policy, optimizer=optimizer, config=ds_config(cfg, device, world)
        )
        self.policy = self.engine.module
        self.steps = 0  # optimizer steps attempted (applied or skipped)
        # LoRA: the base is frozen and rebuilt identically on resume; checkpoints hold what trains
        self.frozen_base = has_adapters(policy.lm)

    # ---------------------------------------------------------------- forward / backward / step
    def __call__(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def train(self) -> None:
        self.engine.train()

    def eval(self) -> None:
        self.engine.eval()

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(boundary)
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self, lr: float, poisoned: bool) -> tuple[bool, float | None]:
        """Apply the optimizer step with learning rate ``lr`` unless the gradients are non-finite.

        ``poisoned``: a non-finite loss was seen on some rank (already agreed across ranks).
        Returns (applied, grad_norm).
        """
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.steps += 1
        norm = None
        if self.zero_stage == 0:
            grads = [p.grad for p in self.policy.parameters() if p.grad is not None]
            local = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
            bad = torch.tensor([0.0 if (not poisoned and bool(torch.isfinite(local))) else 1.0],
                               device=local.device)
            all_reduce_(bad)
            if bad.item() > 0:
                self.engine.zero_grad()
                return False, None
            norm = float(local)  # this rank's norm: with stage 0 the gradients are already averaged
        self.engine.step()
        applied = self.engine.was_step_applied() and not poisoned
        if norm is None:
            norm = self.engine.get_global_grad_norm()
            norm = None if norm is None else float(norm)
        if norm is not None and not math.isfinite(norm):
            applied = False
        return applied, norm

    # ---------------------------------------------------------------- weights
    def weight_buckets(self, bucket_mb: float = 64.0, trainable_only: bool = False):
        """The HF model's parameters then buffers as ``weight_sync.Bucket``s of <= ``bucket_mb`` MiB
        (a larger tensor alone; ``bucket_mb`` <= 0: one tensor per bucket), named as its
        ``named_parameters()``/``named_buffers()``; full tensors in the training dtype and device.

        Under ZeRO-3 each bucket's parameters are gathered together (one ``GatheredParameters`` over
        them) only while the consumer holds the bucket: every rank must iterate to the end, and a
        consumer is done with a bucket before asking for the next one. ``trainable_only``: the
        parameters that train and nothing else (LoRA: the adapters, once the engine holds the base).
        """
        from fastcov.trainer.runtime.weight_buckets import bucket_bytes_from_mb, iter_buckets

        lm = self.policy.lm
        gather = None
        if self.zero_stage == 3:
            import deepspeed

            def gather(params):
                return deepspeed.zero.GatheredParameters(params, modifier_rank=None)

        if trainable_only:
            named = [(n, p) for n, p in lm.named_parameters() if p.requires_grad]
        else:
            named = list(lm.named_parameters()) + list(lm.named_buffers())
        return iter_buckets(named, bucket_bytes_from_mb(bucket_mb), gather)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) pairs of the HF model, named as its ``named_parameters()``.

        Per tensor (``weight_buckets(0)``): under ZeRO-3 each tensor is gathered only while the consumer
        holds it: every rank must iterate to the end, and a consumer copies the tensor before asking for
        the next one.
        """
        for bucket in self.weight_buckets(0):
            yield from bucket

    @contextmanager
    def gathered_model(self) -> Iterator[torch.nn.Module]:
        """The HF model with all parameters gathered (ZeRO-3) for saving or evaluation."""
        lm = self.policy.lm
        if self.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(lm.parameters()), modifier_rank=None):
                yield lm
        else:
            yield lm

    # ---------------------------------------------------------------- checkpoints
    def save(self, directory: str) -> None:
        if self.frozen_base:
            self.engine.save_checkpoint(directory, tag="ds", client_state={"steps": self.steps},
                                        exclude_frozen_parameters=True)
        else:
            self.engine.save_checkpoint(directory, tag="ds", client_state={"steps": self.steps})

    def load(self, directory: str) -> None:
        path, client = self.engine.load_checkpoint(directory, tag="ds", load_optimizer_states=True,
                                                   load_lr_scheduler_states=False,
                                                   load_module_strict=not self.frozen_base)
        if path is None:
            raise FileNotFoundError(f"resume: no DeepSpeed checkpoint under {directory!r}")
        self.steps = int(client.get("steps", 0))


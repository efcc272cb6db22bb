"""PRIME's implicit process reward model, trained online (Cui et al. 2025, arXiv 2502.01456).

The PRM is a causal LM π_rm, initialised from the policy's starting weights, read against a frozen
reference π_ref (the same starting weights). A response's token rewards are ``β·(log π_rm(y_t) − log π_ref(y_t))``
and its score is their sum; the PRM learns from each batch's rollouts with the cross-entropy loss between
σ(score) and the outcome label (correct = 1), so no step labels are ever needed
(``fastcov.token_advantages.prime_ce_loss``). Advantages: ``fastcov.token_advantages.prime_returns``
(leave-one-out baselines for both reward kinds, returns summed to the end, whitened over the batch).

Scale: the PRM and the reference are plain (unsharded) copies of the model on every rank, fp32,
gradients averaged over ranks by all-reduce; fine for the small models this trainer runs on CPU and
for single-GPU studies, not a ZeRO-3 setup for 7B+ (see docs/papers.md). With a LoRA policy the
reference is the policy with its adapters off (``AdaptersOffReference``, no copy) and the PRM's copy
trains its own adapters only, on a frozen base.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch

from fastcov.token_advantages import prime_ce_loss
from fastcov.trainer.runtime.distributed import all_reduce_


def response_logprobs(model, seqs, pad_id: int, device: torch.device, batch_kw: dict, temperature: float
                      ) -> list[list[float]]:
    """log π(y_t) of every response token of ``seqs`` under ``model`` (a PolicyModel or the DeepSpeed engine
    around one), no grad, in ``model``'s current mode, each sequence at the temperature it was sampled with
    (``temperature`` where it recorded none). Every rank must call: micro-batch counts agree."""
    from fastcov.trainer.runtime.batch import micro_batches

    out: list[list[float]] = [[] for _ in seqs]
    with torch.no_grad():
        for mb in micro_batches(seqs, pad_id=pad_id, device=device, **batch_kw):
            res = model(**mb.model_inputs(), temperature=mb.temperature_or(temperature), entropy=False)
            if mb.weight == 0:
                continue
            for si, (row, start, n) in zip(mb.seq_index, mb.spans, strict=True):
                out[si] = res.logprob[row, start : start + n].float().tolist()
    return out


class FrozenModel:
    """A no-grad copy of a causal LM that returns per-response-token log-probs of sequences.

    ``trainable``: the copy trains (PRIME's reward model): every parameter, or only the LoRA adapters when
    ``lm`` carries them (a frozen base, possibly 4-bit, cannot train in full)."""

    def __init__(self, lm: torch.nn.Module, trainable: bool = False, dtype: torch.dtype | None = None):
        from fastcov.trainer.runtime.lora import has_adapters, is_adapter_param
        from fastcov.trainer.runtime.model import PolicyModel

        adapters = has_adapters(lm)
        lm = copy.deepcopy(lm)
        if dtype is not None:
            lm = lm.to(dtype)
        lm.config.use_cache = False  # type: ignore[union-attr]  # nn.Module's __getattr__ types it as Tensor
        for name, p in lm.named_parameters():
            p.requires_grad_(trainable and (not adapters or is_adapter_param(name)))
        self.model = PolicyModel(lm)
        self.model.train(trainable)

    def logprobs(self, seqs, pad_id: int, device: torch.device, batch_kw: dict, temperature: float
                 ) -> list[list[float]]:
        """log π(y_t) of every response token of ``seqs`` (every rank must call: micro-batch counts agree)."""
        was = self.model.training
        self.model.eval()
        out = response_logprobs(self.model, seqs, pad_id, device, batch_kw, temperature)
        self.model.train(was)
        return out


class AdaptersOffReference:
    """π_ref of a LoRA policy: the policy being trained, called through its own engine with every adapter
    switched off: the frozen base, never a second copy (under ZeRO-3 the same partitioned weights are
    gathered as for the policy's own forward)."""

    def __init__(self, engine):
        self.engine = engine  # DeepSpeedPolicy

    def logprobs(self, seqs, pad_id: int, device: torch.device, batch_kw: dict, temperature: float
                 ) -> list[list[float]]:
        """log π_base(y_t) of every response token of ``seqs`` (every rank must call)."""
        from fastcov.trainer.runtime.lora import adapters_disabled

        self.engine.eval()
        with adapters_disabled(self.engine.policy.lm):
            return response_logprobs(self.engine, seqs, pad_id, device, batch_kw, temperature)


class ImplicitPRM(FrozenModel):
    """The trainable implicit PRM (AdamW at ``lr``, gradient clipping ``grad_clip``)."""

    def __init__(self, lm: torch.nn.Module, beta: float, lr: float, grad_clip: float = 1.0):
        super().__init__(lm, trainable=True)
        self.beta = beta
        self.grad_clip = grad_clip
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.0)

    def update(self, seqs, labels: list[float], ref_logprobs: list[list[float]], pad_id: int,
               device: torch.device, batch_kw: dict, temperature: float) -> dict[str, float]:
        """One optimizer step of the cross-entropy loss on these rollouts (this rank's part of the batch;
        every rank must call). Returns {"prm_loss", "prm_acc"} over all ranks (before the step)."""
        from fastcov.trainer.runtime.batch import micro_batches

        self.model.train()
        self.optimizer.zero_grad(set_to_none=False)
        total = float(all_reduce_(torch.tensor([float(len(seqs))], dtype=torch.float64))[0])
        if total == 0:  # every group filtered out on every rank: nothing to learn from (same on all ranks)
            return {"prm_loss": 0.0, "prm_acc": 0.0}
        loss_sum = correct = 0.0
        for mb in micro_batches(seqs, pad_id=pad_id, device=device, **batch_kw):
            res = self.model(**mb.model_inputs(), temperature=mb.temperature_or(temperature), entropy=False)
            if mb.weight == 0 or not mb.seq_index:
                continue
            width = max(n for _, _, n in mb.spans)
            rm = torch.zeros((len(mb.spans), width), device=device)
            ref = torch.zeros((len(mb.spans), width), device=device)
            mask = torch.zeros((len(mb.spans), width), dtype=torch.bool, device=device)
            for k, (si, (row, start, n)) in enumerate(zip(mb.seq_index, mb.spans, strict=True)):
                rm[k, :n] = res.logprob[row, start : start + n]
                ref[k, :n] = torch.tensor(ref_logprobs[si], device=device)
                mask[k, :n] = True
            y = torch.tensor([labels[si] for si in mb.seq_index], device=device)
            loss, score = prime_ce_loss(rm, ref, mask, y, self.beta)
            (loss * (len(mb.seq_index) / max(total, 1.0))).backward()
            loss_sum += float(loss.detach()) * len(mb.seq_index)
            correct += float(((score > 0).float() == y).sum())
        for p in self.params:  # every rank reduces every tensor, also one whose rollouts were all filtered out
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            all_reduce_(p.grad)
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.optimizer.step()
        stats = all_reduce_(torch.tensor([loss_sum, correct], dtype=torch.float64))
        return {"prm_loss": float(stats[0]) / max(total, 1.0), "prm_acc": float(stats[1]) / max(total, 1.0)}

    # ------------------------------------------------------------------ checkpoint
    def _trained_state(self) -> dict[str, torch.Tensor]:
        """What the checkpoint keeps of the PRM: the whole model, or with LoRA its adapters only (the
        frozen base, NF4 or not, is rebuilt identically)."""
        from fastcov.trainer.runtime.lora import has_adapters

        if not has_adapters(self.model.lm):
            return self.model.lm.state_dict()
        return {n: p.detach() for n, p in self.model.lm.named_parameters() if p.requires_grad}

    def save(self, directory: Path) -> None:
        path = Path(directory) / "prm.pt"
        torch.save({"model": self._trained_state(), "optimizer": self.optimizer.state_dict()}, path)
        with open(path, "rb") as f:
            os.fsync(f.fileno())

    def load(self, directory: Path) -> None:
        path = Path(directory) / "prm.pt"
        if not path.is_file():
            raise FileNotFoundError(f"{str(path)!r}: this checkpoint has no PRIME reward model")
        from fastcov.trainer.runtime.lora import has_adapters

        state = torch.load(path, map_location="cpu", weights_only=True)
        want = self._trained_state()
        if set(state["model"]) != set(want):
            raise ValueError(f"{str(path)!r} holds other tensors than this run's reward model "
                             f"({len(state['model'])} against {len(want)}): a LoRA and a full run do not mix")
        self.model.lm.load_state_dict(state["model"], strict=not has_adapters(self.model.lm))
        self.optimizer.load_state_dict(state["optimizer"])

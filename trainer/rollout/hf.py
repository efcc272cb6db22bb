"""The built-in Hugging Face rollout engine: batched KV-cache sampling with the policy's own causal LM
(or a copy of it), one token per row per step, rows leaving the batch at eos.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from fastcov.trainer.rollout.base import RolloutBatch, RolloutEngine, SamplingParams, finish_rollouts
from fastcov.trainer.runtime.weight_buckets import drain, iter_named


def kv_cache_argument(model: nn.Module) -> str:
    """The name a Hugging Face causal LM's forward takes its KV cache by: ``cache`` in recent
    transformers (5.24 warns that ``past_key_values`` goes in 5.40), ``past_key_values`` before."""
    forward = getattr(model, "_fastcov_original_forward", model.forward)
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def sample_next(logits: torch.Tensor, temperature: float, top_p: float,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits fp32 [B, V] -> (token int64 [B], logprob fp32 [B])."""
    if temperature <= 0:
        tok = logits.argmax(-1)
        return tok, torch.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0]
    scaled = logits / temperature
    logp = torch.log_softmax(scaled, -1)
    probs = logp.exp()
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p  # the first token is always kept
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    tok = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return tok, logp.gather(-1, tok[:, None])[:, 0]


def sample_rows(logits: torch.Tensor, temperature: float, top_p: float,
                generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample_next`` with one generator per row: row i's token depends on its logits and ``generators[i]``
    only, not on the other rows of the batch (``rollout.seeding: per_sample``)."""
    picked = [sample_next(logits[i : i + 1], temperature, top_p, g) for i, g in enumerate(generators)]
    return torch.cat([t for t, _ in picked]), torch.cat([lp for _, lp in picked])


def token_budget_batches(lengths: Sequence[int], max_new_tokens: int, token_budget: int,
                         max_rows: int = 0) -> list[list[int]]:
    """Group prompt indices into generation batches, longest prompts first.

    A batch of rows whose longest prompt is P costs rows·(P + max_new_tokens) KV-cache tokens; each
    batch stays within ``token_budget`` (0: no limit) and ``max_rows`` rows (0: no limit), and holds at
    least one row. Returns lists of indices into ``lengths`` (together, each index exactly once)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches:
            cur = batches[-1]
            longest = lengths[cur[0]]  # the first row of a batch is its longest
            fits_tokens = token_budget <= 0 or (len(cur) + 1) * (longest + max_new_tokens) <= token_budget
            fits_rows = max_rows <= 0 or len(cur) < max_rows
            if fits_tokens and fits_rows:
                cur.append(i)
                continue
        batches.append([i])
    return batches


class HFRolloutEngine(RolloutEngine):
    """Batched KV-cache sampling with a Hugging Face causal LM.

    ``shares_policy``: ``model`` is the policy's own module (ZeRO 0-2, where every rank holds the whole
    model): no second copy, and ``update_weights`` has nothing to do. Otherwise (ZeRO-3, where the
    policy's parameters are partitioned) ``model`` is the engine's own copy, filled by
    ``update_weights``.

    Prompts are grouped into batches by a KV-cache token budget (``token_budget``, longest first) and
    left-padded; each step feeds one token per row and keeps only the last position's logits
    (``logits_to_keep=1``), so memory is the KV cache, not the vocabulary. A row that has produced eos
    leaves the batch (its KV cache is dropped), so one long answer costs one row's decode steps, not
    the whole batch's. ``last_stats`` holds the last call's generated tokens, seconds and tokens/s.
    """

    def __init__(self, model: nn.Module, eos_token_ids: list[int], pad_token_id: int,
                 batch_size: int = 0, token_budget: int = 0, shares_policy: bool = False):
        self.model = model
        self.shares_policy = shares_policy
        if not shares_policy:
            self.model.eval()
            for p in self.model.parameters():
                p.requires_grad_(False)
        self.eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long)
        self.pad = int(pad_token_id)
        self.batch_size = int(batch_size)
        self.token_budget = int(token_budget)
        self.last_stats: dict[str, float] = {}
        self._cache_arg = kv_cache_argument(model)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable) -> None:
        """Copy each tensor into the model's parameter/buffer of the same name (Buckets or pairs).
        Sharing the policy's module, there is nothing to copy; the iterable is still consumed, since a
        ZeRO-3 producer expects every rank to walk it to the end."""
        if self.shares_policy:
            drain(named_tensors)
            return
        own: dict[str, torch.Tensor] = dict(self.model.named_parameters())
        own.update(dict(self.model.named_buffers()))
        for name, tensor in iter_named(named_tensors):
            if name not in own:
                raise KeyError(f"update_weights: the rollout model has no tensor named {name!r}")
            dst = own[name]
            if dst.shape != tensor.shape:
                raise ValueError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dst.shape)}")
            dst.copy_(tensor.to(device=dst.device, dtype=dst.dtype))

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 generator: torch.Generator | None = None) -> RolloutBatch:
        if not prompts:
            return RolloutBatch([], [])
        t0 = time.perf_counter()
        out_ids: list[list[int]] = [[] for _ in prompts]
        out_lp: list[list[float]] = [[] for _ in prompts]
        was_training = self.model.training
        self.model.eval()  # no dropout; a shared policy module goes back to its mode afterwards
        try:
            batches = token_budget_batches([len(p) for p in prompts], sampling.max_new_tokens,
                                           self.token_budget, self.batch_size)
            for idx in batches:
                seeds = None if sampling.seeds is None else [sampling.seeds[i] for i in idx]
                part = self._generate_batch([prompts[i] for i in idx], sampling, generator, seeds)
                for j, i in enumerate(idx):
                    out_ids[i], out_lp[i] = part.token_ids[j], part.logprobs[j]
        finally:
            self.model.train(was_training)
        seconds = time.perf_counter() - t0
        tokens = sum(len(x) for x in out_ids)
        self.last_stats = {"tokens": float(tokens), "seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-9)}
        return RolloutBatch(out_ids, out_lp)

    def _generate_batch(self, prompts, sampling: SamplingParams, generator, seeds: list[int] | None = None):
        from transformers import DynamicCache

        dev = self.device
        B = len(prompts)
        L = max(len(p) for p in prompts)
        input_ids = torch.full((B, L), self.pad, dtype=torch.long, device=dev)
        mask = torch.zeros((B, L), dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):
            input_ids[i, L - len(p):] = torch.tensor(p, dtype=torch.long, device=dev)
            mask[i, L - len(p):] = 1
        eos = self.eos.to(dev)
        cache = DynamicCache()
        rows = torch.arange(B, device=dev)  # the batch rows still generating
        steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        # per_sample seeding: one generator per row, following its row out of the batch
        gens = None if seeds is None else [torch.Generator(device=dev).manual_seed(int(s)) for s in seeds]
        step_ids, pos = input_ids, (mask.cumsum(-1) - 1).clamp_min(0)
        for _ in range(sampling.max_new_tokens):
            out = self.model(input_ids=step_ids, attention_mask=mask, position_ids=pos,
                             use_cache=True, logits_to_keep=1, **{self._cache_arg: cache})
            if gens is None:
                tok, lp = sample_next(out.logits[:, -1, :].float(), sampling.temperature, sampling.top_p, generator)
            else:
                tok, lp = sample_rows(out.logits[:, -1, :].float(), sampling.temperature, sampling.top_p, gens)
            steps.append((rows, tok, lp))
            finished = torch.isin(tok, eos)
            n_finished = int(finished.sum())
            if n_finished == rows.numel():
                break
            if n_finished:
                keep = (~finished).nonzero()[:, 0]
                cache.batch_select_indices(keep)
                rows, tok, mask, pos = rows[keep], tok[keep], mask[keep], pos[keep]
                gens = None if gens is None else [gens[k] for k in keep.tolist()]
            step_ids = tok[:, None]
            pos = pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones((rows.numel(), 1), dtype=mask.dtype, device=dev)], dim=1)
        token_ids: list[list[int]] = [[] for _ in range(B)]
        logprobs: list[list[float]] = [[] for _ in range(B)]
        for r, t, lp in steps:
            for i, tk, lv in zip(r.tolist(), t.tolist(), lp.tolist(), strict=True):
                token_ids[i].append(tk)
                logprobs[i].append(lv)
        return finish_rollouts(token_ids, logprobs, self.eos.tolist())

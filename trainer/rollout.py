"""Rollout engines: the interface the loop talks to, and the built-in Hugging Face engine.

    engine.generate(prompts, SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=256), generator)
        -> RolloutBatch(token_ids=[[...], ...], logprobs=[[...], ...])
    engine.update_weights(iter_of_(name, tensor))

A weight update is any iterable of ``(name, tensor)`` pairs named like the Hugging Face model's
``named_parameters()``; a producer may gather each tensor just before yielding it and release it just
after (ZeRO-3), so an engine copies every tensor before asking for the next. Bucketed transfers (the vLLM
engine, a later module) fit the same signature.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 256


@dataclass
class RolloutBatch:
    """Per prompt: the response token ids (ending with eos unless cut at max_new_tokens) and the
    sampling log-probability of each (fp32 values under the temperature-scaled distribution, before
    top-p truncation; under temperature 1 when sampling greedily)."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]


class RolloutEngine(abc.ABC):
    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 generator: torch.Generator | None = None) -> RolloutBatch:
        """One response per prompt (repeat a prompt n times for n rollouts)."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new policy weights."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


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


class HFRolloutEngine(RolloutEngine):
    """Batched KV-cache sampling with a plain Hugging Face causal LM (its own copy of the weights).

    Prompts are left-padded; each step feeds one token per row and keeps only the last position's
    logits (``logits_to_keep=1``), so memory is the KV cache, not the vocabulary.
    """

    def __init__(self, model: nn.Module, eos_token_ids: list[int], pad_token_id: int,
                 batch_size: int = 0):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long)
        self.pad = int(pad_token_id)
        self.batch_size = int(batch_size)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        own = dict(self.model.named_parameters())
        own.update(dict(self.model.named_buffers()))
        for name, tensor in named_tensors:
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
        bs = self.batch_size or len(prompts)
        out_ids: list[list[int]] = []
        out_lp: list[list[float]] = []
        for start in range(0, len(prompts), bs):
            ids, lps = self._generate_batch(prompts[start : start + bs], sampling, generator)
            out_ids += ids
            out_lp += lps
        return RolloutBatch(out_ids, out_lp)

    def _generate_batch(self, prompts, sampling: SamplingParams, generator):
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
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        tokens, logps = [], []
        step_ids, pos = input_ids, (mask.cumsum(-1) - 1).clamp_min(0)
        for _ in range(sampling.max_new_tokens):
            out = self.model(input_ids=step_ids, attention_mask=mask, position_ids=pos,
                             past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            logits = out.logits[:, -1, :].float()
            tok, lp = sample_next(logits, sampling.temperature, sampling.top_p, generator)
            tok = torch.where(done, torch.full_like(tok, self.pad), tok)
            tokens.append(tok)
            logps.append(lp)
            done = done | torch.isin(tok, eos)
            if bool(done.all()):
                break
            step_ids = tok[:, None]
            pos = pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=dev)], dim=1)
        toks = torch.stack(tokens, 1).tolist()
        lps = torch.stack(logps, 1).tolist()
        eos_set = set(self.eos.tolist())
        ids_out, lp_out = [], []
        for row, lrow in zip(toks, lps):
            n = len(row)
            for j, t in enumerate(row):
                if t in eos_set:
                    n = j + 1
                    break
            ids_out.append(row[:n])
            lp_out.append(lrow[:n])
        return ids_out, lp_out

"""Rollout engines: the interface the loop talks to, and the built-in Hugging Face engine.

    engine.generate(prompts, SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=256), generator)
        -> RolloutBatch(token_ids=[[...], ...], logprobs=[[...], ...])
    engine.update_weights(iter_of_(name, tensor) or iter_of_Bucket)
    engine = make_rollout_engine(cfg, lm, tokenizer, device=device, rank=rank, world=world)

A weight update is an iterable of ``weight_sync.Bucket``s (``PolicyEngine.weight_buckets``: a bounded
group of gathered tensors at a time) or of plain ``(name, tensor)`` pairs, named like the Hugging Face
model's ``named_parameters()``/``named_buffers()``. A producer may gather a bucket (or a tensor) just
before yielding it and release it just after (ZeRO-3), so an engine consumes each item before asking
for the next. ``rollout.engine: vllm`` lives in ``rollout_vllm`` (imported only when asked for); the
helpers here (request slicing, eos truncation) are shared by both engines.
"""

from __future__ import annotations

import abc
import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fastcov.trainer.weight_sync import iter_named


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
    def update_weights(self, named_tensors: Iterable) -> None:
        """Load new policy weights: an iterable of ``Bucket``s or of ``(name, tensor)`` pairs."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


def batch_slices(n: int, size: int) -> list[slice]:
    """Consecutive slices of at most ``size`` items covering ``range(n)`` (``size`` <= 0: one slice)."""
    if n <= 0:
        return []
    size = size if size > 0 else n
    return [slice(a, min(a + size, n)) for a in range(0, n, size)]


def split_evenly(n: int, parts: int) -> list[slice]:
    """``parts`` consecutive slices covering ``range(n)`` whose lengths differ by at most one (the first
    ``n % parts`` get one more; some are empty when ``n < parts``)."""
    if parts < 1:
        raise ValueError(f"split_evenly: parts must be >= 1, got {parts}")
    q, r = divmod(n, parts)
    out, a = [], 0
    for i in range(parts):
        b = a + q + (1 if i < r else 0)
        out.append(slice(a, b))
        a = b
    return out


def finish_rollouts(token_ids: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]],
                    eos_token_ids: Iterable[int]) -> RolloutBatch:
    """Per response: keep the tokens up to and including the first eos (all of them if none) and their
    log-probs, as Python ints / floats. ``token_ids[i]`` and ``logprobs[i]`` must have equal lengths."""
    if len(token_ids) != len(logprobs):
        raise ValueError(f"finish_rollouts: {len(token_ids)} token rows but {len(logprobs)} log-prob rows")
    eos = {int(t) for t in eos_token_ids}
    ids_out, lp_out = [], []
    for i, (row, lrow) in enumerate(zip(token_ids, logprobs)):
        if len(row) != len(lrow):
            raise ValueError(f"finish_rollouts: response {i} has {len(row)} tokens but {len(lrow)} log-probs")
        n = len(row)
        for j, t in enumerate(row):
            if int(t) in eos:
                n = j + 1
                break
        ids_out.append([int(t) for t in row[:n]])
        lp_out.append([float(x) for x in lrow[:n]])
    return RolloutBatch(ids_out, lp_out)


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
    def update_weights(self, named_tensors: Iterable) -> None:
        """Copy each tensor into the model's parameter/buffer of the same name (Buckets or pairs)."""
        own = dict(self.model.named_parameters())
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
        out_ids: list[list[int]] = []
        out_lp: list[list[float]] = []
        for sl in batch_slices(len(prompts), self.batch_size):
            part = self._generate_batch(prompts[sl], sampling, generator)
            out_ids += part.token_ids
            out_lp += part.logprobs
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
        return finish_rollouts(toks, lps, self.eos.tolist())


def make_rollout_engine(cfg, model: nn.Module, tokenizer, *, device: torch.device | None = None,
                        rank: int = 0, world: int = 1) -> RolloutEngine:
    """The rollout engine ``cfg.rollout.engine`` names.

    ``model``: the policy's Hugging Face causal LM as built, before DeepSpeed wraps it (not modified):
    the HF engine samples from a deep copy of it (bf16 on a GPU unless ``model.dtype: fp32``, else fp32);
    the vLLM engines take its config (the weights arrive with the first ``update_weights``).
    ``tokenizer``: its eos/pad ids. ``rank``/``world``: this process in the data-parallel training group.
    """
    r = cfg.rollout
    device = device if device is not None else torch.device("cpu")
    eos_ids = [tokenizer.eos_token_id]
    if r.engine == "hf":
        use_bf16 = device.type == "cuda" and cfg.model.dtype != "fp32"
        lm = copy.deepcopy(model).to(device=device, dtype=torch.bfloat16 if use_bf16 else torch.float32)
        lm.config.use_cache = True
        return HFRolloutEngine(lm, eos_ids, tokenizer.pad_token_id, r.batch_size)
    if r.engine == "vllm":
        from fastcov.trainer.rollout_vllm import make_vllm_engine

        return make_vllm_engine(cfg, model, tokenizer, device=device, rank=rank, world=world)
    raise ValueError(f"rollout.engine: unknown engine {r.engine!r} (expected 'hf' or 'vllm')")

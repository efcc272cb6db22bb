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
helpers here (splitting requests over ranks, eos truncation) are shared by both engines.
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

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
        import time

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
                part = self._generate_batch([prompts[i] for i in idx], sampling, generator)
                for j, i in enumerate(idx):
                    out_ids[i], out_lp[i] = part.token_ids[j], part.logprobs[j]
        finally:
            self.model.train(was_training)
        seconds = time.perf_counter() - t0
        tokens = sum(len(x) for x in out_ids)
        self.last_stats = {"tokens": float(tokens), "seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-9)}
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
        rows = torch.arange(B, device=dev)  # the batch rows still generating
        steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        step_ids, pos = input_ids, (mask.cumsum(-1) - 1).clamp_min(0)
        for _ in range(sampling.max_new_tokens):
            out = self.model(input_ids=step_ids, attention_mask=mask, position_ids=pos,
                             use_cache=True, logits_to_keep=1, **{self._cache_arg: cache})
            tok, lp = sample_next(out.logits[:, -1, :].float(), sampling.temperature, sampling.top_p, generator)
            steps.append((rows, tok, lp))
            finished = torch.isin(tok, eos)
            n_finished = int(finished.sum())
            if n_finished == rows.numel():
                break
            if n_finished:
                keep = (~finished).nonzero()[:, 0]
                cache.batch_select_indices(keep)
                rows, tok, mask, pos = rows[keep], tok[keep], mask[keep], pos[keep]
            step_ids = tok[:, None]
            pos = pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones((rows.numel(), 1), dtype=mask.dtype, device=dev)], dim=1)
        token_ids: list[list[int]] = [[] for _ in range(B)]
        logprobs: list[list[float]] = [[] for _ in range(B)]
        for r, t, lp in steps:
            for i, tk, lv in zip(r.tolist(), t.tolist(), lp.tolist()):
                token_ids[i].append(tk)
                logprobs[i].append(lv)
        return finish_rollouts(token_ids, logprobs, self.eos.tolist())


def node_group(rank: int, world: int):
    """(process group, ranks) of the ranks on this node, from every rank's host name (or the
    ``FASTCOV_NODE`` environment variable where set). Every rank must call it: it creates one
    group per node, in the same order everywhere."""
    import os
    import socket

    import torch.distributed as dist

    hosts: list = [None] * world
    dist.all_gather_object(hosts, os.environ.get("FASTCOV_NODE") or socket.gethostname())
    mine = None
    for host in dict.fromkeys(hosts):
        ranks = [r for r, h in enumerate(hosts) if h == host]
        group = dist.new_group(ranks)
        if hosts[rank] == host:
            mine = (group, ranks)
    return mine


class NodeRolloutEngine(RolloutEngine):
    """One HF rollout copy per node: the node's first rank holds ``engine`` and samples for every rank
    of the node; the others hold nothing (``engine`` None).

    ``generate`` is a collective over the node's ranks: each rank passes its own prompts (possibly
    none), they are gathered to the node's first rank, sampled there in one call (one generator: the
    first rank's) and each rank gets back the responses to its own prompts, with that call's
    ``last_stats``. Every rank of a node must call ``generate`` the same number of times.
    ``update_weights``: every rank walks the iterable to its end (a ZeRO-3 producer gathers on all
    ranks), only the holder copies.
    """

    def __init__(self, engine: HFRolloutEngine | None, group, ranks: list[int], device: torch.device):
        self.engine = engine
        self.group = group
        self.ranks = list(ranks)
        self.device = device
        self.shares_policy = False
        self.last_stats: dict[str, float] = {}

    @property
    def holds_copy(self) -> bool:
        return self.engine is not None

    def update_weights(self, named_tensors: Iterable) -> None:
        if self.engine is not None:
            self.engine.update_weights(named_tensors)
        else:
            drain(named_tensors)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 generator: torch.Generator | None = None) -> RolloutBatch:
        import torch.distributed as dist

        leader = self.ranks[0]
        gathered: list | None = [None] * len(self.ranks) if self.engine is not None else None
        dist.gather_object([list(map(int, p)) for p in prompts], gathered, dst=leader, group=self.group)
        pieces: list | None = None
        if self.engine is not None:
            flat = [p for part in gathered for p in part]
            out = self.engine.generate(flat, sampling, generator)
            pieces, start = [], 0
            for part in gathered:
                end = start + len(part)
                pieces.append((out.token_ids[start:end], out.logprobs[start:end], dict(self.engine.last_stats)))
                start = end
        mine: list = [None]
        dist.scatter_object_list(mine, pieces, src=leader, group=self.group)
        token_ids, logprobs, self.last_stats = mine[0]
        return RolloutBatch(token_ids, logprobs)


def rollout_copy(config, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """An empty causal LM of ``config`` (no random init, no copy of anyone's weights) on ``device`` in
    ``dtype``; its parameters and buffers are filled by the first ``update_weights``."""
    import copy as _copy

    from transformers import AutoModelForCausalLM

    config = _copy.deepcopy(config)
    config.use_cache = True
    with torch.device("meta"):  # build_model unsets transformers' ZeRO-3 switch, so this is a plain module
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to_empty(device=device)
    model.tie_weights()
    return model


def make_rollout_engine(cfg, model: nn.Module, tokenizer, *, device: torch.device | None = None,
                        rank: int = 0, world: int = 1, zero_stage: int = 0) -> RolloutEngine:
    """The rollout engine ``cfg.rollout.engine`` names.

    ``model``: the policy's Hugging Face causal LM as DeepSpeed holds it (``PolicyEngine.policy.lm``).
    With ZeRO 0-2 the HF engine samples from that very module (no copy); with ZeRO-3, whose
    parameters are partitioned, from an empty copy built from its config (bf16 on a GPU unless
    ``model.dtype: fp32``, else fp32) and filled by the weight sync: one per node, held by the node's
    first rank, which samples for all of the node's ranks (``rollout.hf_copies: node``,
    ``NodeRolloutEngine``), or one per rank (``rank``: faster, every GPU pays for it). The vLLM engines take its
    config (the weights arrive with the first ``update_weights``).
    ``tokenizer``: its eos/pad ids. ``rank``/``world``: this process in the data-parallel training group.
    """
    r = cfg.rollout
    device = device if device is not None else torch.device("cpu")
    eos_ids = [tokenizer.eos_token_id]
    if r.engine == "hf":
        if zero_stage < 3:
            return HFRolloutEngine(model, eos_ids, tokenizer.pad_token_id, r.batch_size, r.token_budget,
                                   shares_policy=True)
        use_bf16 = device.type == "cuda" and cfg.model.dtype != "fp32"

        def own_copy() -> HFRolloutEngine:
            lm = rollout_copy(model.config, device, torch.bfloat16 if use_bf16 else torch.float32)
            return HFRolloutEngine(lm, eos_ids, tokenizer.pad_token_id, r.batch_size, r.token_budget)

        if r.hf_copies == "rank" or world == 1:
            return own_copy()
        group, ranks = node_group(rank, world)
        return NodeRolloutEngine(own_copy() if rank == ranks[0] else None, group, ranks, device)
    if r.engine == "vllm":
        from fastcov.trainer.rollout_vllm import make_vllm_engine

        return make_vllm_engine(cfg, model, tokenizer, device=device, rank=rank, world=world)
    raise ValueError(f"rollout.engine: unknown engine {r.engine!r} (expected 'hf' or 'vllm')")

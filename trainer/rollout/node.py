"""The HF engine as the trainer builds it (registered as "hf"): the policy's own module (ZeRO 0-2), or an
empty copy filled by the weight sync (ZeRO-3) — one per rank, or one per node held by the node's first rank,
which samples for every rank of the node (``NodeRolloutEngine``).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from fastcov.log import EVERY_RANK
from fastcov.trainer.rollout.base import ROLLOUT_ENGINES, RolloutBatch, RolloutEngine, SamplingParams
from fastcov.trainer.rollout.hf import HFRolloutEngine
from fastcov.trainer.runtime.distributed import host_name
from fastcov.trainer.runtime.lora import copy_adapter_layout, has_adapters
from fastcov.trainer.runtime.precision import param_dtype
from fastcov.trainer.runtime.weight_buckets import drain

logger = logging.getLogger(__name__)


def node_group(rank: int, world: int):
    """(process group, ranks) of the ranks on this node, from every rank's host name (or the
    ``FASTCOV_NODE`` environment variable where set). Every rank must call it: it creates one
    group per node, in the same order everywhere."""
    hosts: list = [None] * world
    dist.all_gather_object(hosts, host_name())
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
    first rank's; with ``per_member``, one call per rank, each with its own per-sample seeds) and each
    rank gets back the responses to its own prompts, with that call's ``last_stats``. Every rank of a
    node must call ``generate`` the same number of times.
    ``update_weights``: every rank walks the iterable to its end (a ZeRO-3 producer gathers on all
    ranks), only the holder copies.
    """

    def __init__(self, engine: HFRolloutEngine | None, group, ranks: list[int], device: torch.device,
                 per_member: bool = False):
        self.engine = engine
        self.per_member = per_member  # rollout.seeding per_sample: each rank's prompts in their own call
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
        leader = self.ranks[0]
        gathered: list | None = [None] * len(self.ranks) if self.engine is not None else None
        dist.gather_object(([list(map(int, p)) for p in prompts], sampling.seeds), gathered, dst=leader,
                           group=self.group)
        pieces: list | None = None
        if self.engine is not None:
            assert gathered is not None  # gathered on the engine's ranks
            parts = [(ps, dataclasses.replace(sampling, seeds=seeds)) for ps, seeds in gathered]
            pieces = self._each(parts, generator) if self.per_member else self._joined(parts, sampling, generator)
        mine: list = [None]
        dist.scatter_object_list(mine, pieces, src=leader, group=self.group)
        token_ids, logprobs, self.last_stats = mine[0]
        return RolloutBatch(token_ids, logprobs)

    def _each(self, parts: list, generator) -> list:
        """Each rank's prompts in their own call (``rollout.seeding: per_sample``): the batches that rank
        alone would have made, so its samples do not depend on how many ranks share the node."""
        engine, pieces = self.engine, []
        assert engine is not None
        for prompts, sampling in parts:
            out = engine.generate(prompts, sampling, generator)
            pieces.append((out.token_ids, out.logprobs, dict(engine.last_stats)))
        return pieces

    def _joined(self, parts: list, sampling: SamplingParams, generator) -> list:
        """The node's prompts in one call; each rank's slice of it back."""
        engine = self.engine
        assert engine is not None
        flat = [p for prompts, _ in parts for p in prompts]
        seeds = None if sampling.seeds is None else [x for _, sp in parts for x in sp.seeds]
        out = engine.generate(flat, dataclasses.replace(sampling, seeds=seeds), generator)
        pieces, start = [], 0
        for prompts, _ in parts:
            end = start + len(prompts)
            pieces.append((out.token_ids[start:end], out.logprobs[start:end], dict(engine.last_stats)))
            start = end
        return pieces


def rollout_copy(config, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """An empty causal LM of ``config`` (no random init, no copy of anyone's weights) on ``device`` in
    ``dtype``; its parameters and buffers are filled by the first ``update_weights``."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    config.use_cache = True
    with torch.device("meta"):  # build_model unsets transformers' ZeRO-3 switch, so this is a plain module
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to_empty(device=device)
    model.tie_weights()
    return model


@ROLLOUT_ENGINES.register("hf")
def make_hf_engine(cfg, model: nn.Module, tokenizer, *, device: torch.device, rank: int = 0, world: int = 1,
                   zero_stage: int = 0) -> RolloutEngine:
    """With ZeRO 0-2 the HF engine samples from the policy's module itself (no copy); with ZeRO-3, whose
    parameters are partitioned, from an empty copy built from its config (``param_dtype``: bf16 on a GPU
    unless ``model.dtype: fp32``) and filled by the weight sync: one per node, held by the node's first
    rank (``rollout.hf_copies: node``, ``NodeRolloutEngine``), or one per rank (``rank``)."""
    r = cfg.rollout
    eos_ids = [tokenizer.eos_token_id]
    if zero_stage < 3:
        return HFRolloutEngine(model, eos_ids, tokenizer.pad_token_id, r.batch_size, r.token_budget,
                               shares_policy=True)

    def own_copy() -> HFRolloutEngine:
        lm = rollout_copy(model.config, device, param_dtype(cfg.model, device))
        if has_adapters(model):  # LoRA: the same adapter modules, so the sync fills them by name
            lm = copy_adapter_layout(model, lm)
        return HFRolloutEngine(lm, eos_ids, tokenizer.pad_token_id, r.batch_size, r.token_budget)

    if r.hf_copies == "rank" or world == 1:
        return own_copy()
    group, ranks = node_group(rank, world)
    if rank == ranks[0]:  # one line per node: which rank holds its copy, for which ranks
        logger.info(f"rollout: the HF copy of host {host_name()} is on rank {rank}, sampling for ranks {ranks}",
                    extra=EVERY_RANK)
    return NodeRolloutEngine(own_copy() if rank == ranks[0] else None, group, ranks, device,
                             per_member=r.seeding == "per_sample")

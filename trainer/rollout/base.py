"""What every rollout engine shares: the interface the loop talks to, the batch it returns, and the registry
``make_rollout_engine`` dispatches through.

    engine.generate(prompts, SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=256), generator)
        -> RolloutBatch(token_ids=[[...], ...], logprobs=[[...], ...])
    engine.update_weights(iter_of_(name, tensor) or iter_of_Bucket)
    engine = make_rollout_engine(cfg, lm, tokenizer, device=device, rank=rank, world=world)

A weight update is an iterable of ``weight_buckets.Bucket``s (``DeepSpeedPolicy.weight_buckets``: a bounded
group of gathered tensors at a time) or of plain ``(name, tensor)`` pairs, named like the Hugging Face
model's ``named_parameters()``/``named_buffers()``. A producer may gather a bucket (or a tensor) just
before yielding it and release it just after (ZeRO-3), so an engine consumes each item before asking
for the next. The engines register themselves in ``ROLLOUT_ENGINES`` ("hf": node.py, "vllm":
vllm_factory.py); a builder takes ``(cfg, model, tokenizer, *, device, rank, world, zero_stage)``.
"""

from __future__ import annotations

import abc
import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fastcov.registry import Registry


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 256
    # rollout.seeding per_sample: one seed per prompt of the call (``sample_seed``), each response drawn
    # from its own generator (vLLM: the request's seed); None: the call's generator draws for all of them
    seeds: list[int] | None = None


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


def sample_seed(seed: int, step: int, prompt: int, sample: int) -> int:
    """The seed of one response under ``rollout.seeding: per_sample``: a hash of (run seed, step, global
    prompt index, sample index) to 63 bits, so the same response gets the same draws wherever it is sampled."""
    digest = hashlib.blake2b(f"fastcov/{seed}/{step}/{prompt}/{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


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
    for i, (row, lrow) in enumerate(zip(token_ids, logprobs, strict=True)):
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


EngineBuilder = Callable[..., RolloutEngine]
ROLLOUT_ENGINES: Registry[EngineBuilder] = Registry("rollout engine")


def make_rollout_engine(cfg, model: nn.Module, tokenizer, *, device: torch.device | None = None,
                        rank: int = 0, world: int = 1, zero_stage: int = 0) -> RolloutEngine:
    """The rollout engine ``cfg.rollout.engine`` names, built by its ``ROLLOUT_ENGINES`` entry.

    ``model``: the policy's Hugging Face causal LM as DeepSpeed holds it (``DeepSpeedPolicy.policy.lm``).
    ``tokenizer``: its eos/pad ids. ``rank``/``world``: this process in the data-parallel training group;
    ``zero_stage``: whether the policy's parameters are partitioned (3). The HF engine's choices (the
    policy's own module, an own copy, one copy per node) are in node.py; vLLM's in vllm_factory.py.
    """
    ROLLOUT_ENGINES.check(cfg.rollout.engine, "rollout.engine")
    build = ROLLOUT_ENGINES.get(cfg.rollout.engine)
    return build(cfg, model, tokenizer, device=device if device is not None else torch.device("cpu"),
                 rank=rank, world=world, zero_stage=zero_stage)

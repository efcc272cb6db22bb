"""Token selection for KL-Cov and Clip-Cov without host synchronisation.

Both selectors return a bool mask shaped like ``scores``. Nothing on their path calls ``.item()``,
``nonzero``, ``.cpu()`` or branches in Python on tensor values: counts, k and thresholds stay on the
device, and top-k uses a host-known upper bound on k.

Order and ties. A token's rank is decided by an int64 "order key" (a monotone bit-map of the float
score for KL-Cov, a random hash for Clip-Cov); equal keys are broken by global position, earlier
first. The global position of a token is its flat (row-major) index in the concatenation, in group
rank order, of every rank's flattened tensor.

Process groups. With ``group`` the result on each rank equals that rank's slice of what one process
would select on the concatenated batch:

* counts (valid tokens, candidates) are all-reduced;
* the k-th largest key is found by an 8-round radix select (8 bits per round) whose 256-bin
  histograms are all-reduced, so no rank ever needs another rank's shape on the host;
* ties at the threshold are ranked by global position (exclusive prefix of per-rank tie counts);
* Clip-Cov's random keys are hash(seed, global position), with the seed drawn on group rank 0 and
  broadcast, so every rank computes exactly the keys one process would compute for the
  concatenated batch (no keys or scores are gathered).

Random controls. ``select_random_matched`` picks as many tokens as a reference selection holds,
uniformly among all valid tokens; its keys re-hash the selection's keys (``decorrelated_keys``), so
the control is a function of the same seed but its order is unrelated to the reference's.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from fastcov.kernels.covariance_torch import random_keys_torch

INT64_MIN = -(2**63)
CONTROL_SALT = 0x2545F4914F6CDD1D  # < 2**62: the fixed seed that re-hashes keys for a random control
INT64_MAX = 2**63 - 1
SEED_RANGE = 2**62
RADIX_BITS = 8


# ---------------------------------------------------------------- argument checks


def check_ratio(ratio: float, name: str = "ratio") -> float:
    """Raise ValueError naming ``name`` unless 0 < ratio ≤ 1."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        raise TypeError(f"{name} must be a float in (0, 1], got {type(ratio).__name__}")
    if not (0.0 < ratio <= 1.0):
        raise ValueError(f"{name} must be in (0, 1], got {ratio}")
    return float(ratio)


def check_band(lb: float, ub: float, lb_name: str = "lb", ub_name: str = "ub") -> None:
    """Raise ValueError naming both bounds unless lb < ub (both real numbers, not NaN)."""
    for name, value in ((lb_name, lb), (ub_name, ub)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a float, got {type(value).__name__}")
        if math.isnan(value):
            raise ValueError(f"{name} must not be NaN")
    if not lb < ub:
        raise ValueError(f"{lb_name} must be < {ub_name}, got {lb_name}={lb}, {ub_name}={ub}")


def check_like(name: str, tensor: torch.Tensor | None, reference: torch.Tensor, reference_name: str) -> None:
    """Raise TypeError/ValueError naming ``name`` unless ``tensor`` matches ``reference`` in shape and device."""
    if tensor is None:
        return
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.shape != reference.shape:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)} but {reference_name} has shape {tuple(reference.shape)}"
        )
    if tensor.device != reference.device:
        raise ValueError(f"{name} is on {tensor.device} but {reference_name} is on {reference.device}")


def _check_scores_mask(scores: torch.Tensor, mask: torch.Tensor) -> None:
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"scores must be a torch.Tensor, got {type(scores).__name__}")
    if not scores.is_floating_point():
        raise TypeError(f"scores must be a floating tensor, got {scores.dtype}")
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    check_like("mask", mask, scores, "scores")


# ---------------------------------------------------------------- group helpers (all on device)


def _group_size(group) -> int:
    return dist.get_world_size(group)


def all_reduce_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def _exclusive_prefix_over_ranks(local_count: torch.Tensor, group) -> torch.Tensor:
    """Sum of ``local_count`` (int64 [1]) over the group ranks before this one; 0 without a group."""
    if group is None:
        return torch.zeros((), dtype=torch.int64, device=local_count.device)
    gathered = [torch.empty_like(local_count) for _ in range(_group_size(group))]
    dist.all_gather(gathered, local_count, group=group)
    before = gathered[: dist.get_rank(group)]
    if not before:
        return torch.zeros((), dtype=torch.int64, device=local_count.device)
    return torch.cat(before).sum()


def global_offset(numel: int, device: torch.device, group=None) -> torch.Tensor:
    """Global position of this rank's first token: Σ numel of the group ranks before it.

    Returns:
        int64 0-dim tensor on ``device`` (0 without a group). One all_gather, no host sync.
    """
    local = torch.full((1,), numel, dtype=torch.int64, device=device)
    return _exclusive_prefix_over_ranks(local, group)


def draw_seed(generator: torch.Generator | None, device: torch.device, group=None) -> torch.Tensor:
    """A random seed in [0, 2**62) as an int64 [1] tensor on ``device``, equal on all ranks of ``group``.

    Drawn from ``generator`` (or torch's default generator of ``device``) and, with a group,
    broadcast from group rank 0, so only rank 0's generator matters.
    """
    if generator is not None:
        seed = torch.randint(0, SEED_RANGE, (1,), generator=generator, device=generator.device, dtype=torch.int64)
        seed = seed.to(device)
    else:
        seed = torch.randint(0, SEED_RANGE, (1,), device=device, dtype=torch.int64)
    if group is not None:
        dist.broadcast(seed, src=dist.get_global_rank(group, 0), group=group)
    return seed


def random_keys(
    shape: torch.Size, device: torch.device, seed: torch.Tensor, index_offset: torch.Tensor | None = None
) -> torch.Tensor:
    """int64 keys in [0, 2**32) = hash(seed, global position) for a tensor of ``shape`` (see kernels)."""
    position = torch.arange(math.prod(shape), dtype=torch.int64, device=device).reshape(shape)
    if index_offset is not None:
        position = position + index_offset
    return random_keys_torch(seed, position)


# ---------------------------------------------------------------- order keys and k


def float_order_key(x: torch.Tensor) -> torch.Tensor:
    """Map floats to int64 so that integer order equals float order (−0.0 == +0.0; NaN unsupported)."""
    # + 0.0 turns -0.0 into +0.0, so the two zeros get one key.
    bits = (x.to(torch.float64) + 0.0).contiguous().view(torch.int64)
    return torch.where(bits < 0, bits ^ INT64_MAX, bits)


def count_from_ratio(ratio: float, n: torch.Tensor) -> torch.Tensor:
    """max(1, ⌊ratio·n⌋) on device, evaluated in float64 exactly like the host expression."""
    return torch.floor(n.to(torch.float64) * ratio).clamp(min=1).to(torch.int64)


def k_upper_bound(ratio: float, numel: int) -> int:
    """Host bound on k = max(1, ⌊ratio·n_valid⌋) for a local tensor of ``numel`` elements."""
    return max(1, math.floor(ratio * numel))


# ---------------------------------------------------------------- selecting the `need` largest keys


def _select_largest_topk(order: torch.Tensor, eligible: torch.Tensor, need: torch.Tensor, bound: int) -> torch.Tensor:
    """Local selection: the ``need`` eligible elements with the largest key, ties by flat index.

    ``need`` (int64 0-dim, on device) must be ≤ ``bound`` (host int) and ≤ the eligible count.
    """
    flat = torch.where(eligible, order, INT64_MIN).reshape(-1)
    top = torch.topk(flat, min(bound, flat.numel()), sorted=True).values
    threshold = top.gather(0, (need - 1).clamp(min=0).reshape(1)).reshape(())
    above = eligible & (order > threshold)
    tie = eligible & (order == threshold)
    still_needed = need - above.sum()
    tie_rank = torch.cumsum(tie.reshape(-1), 0).reshape(tie.shape)  # 1-based rank among ties
    return (above | (tie & (tie_rank <= still_needed))) & (need > 0)


def _select_largest_radix(order: torch.Tensor, eligible: torch.Tensor, need: torch.Tensor, group) -> torch.Tensor:
    """Group-wide selection of the ``need`` eligible elements with the largest key, ties by global position.

    Radix select over the unsigned image of the key, 8 bits per round, all-reducing one 256-bin
    histogram per round: afterwards ``matched`` holds exactly the tokens whose key equals the
    need-th largest key (over all ranks), ``above`` those strictly larger, and ``still_needed`` how
    many of the ties to take.
    """
    device = order.device
    unsigned_image = order ^ INT64_MIN  # flip the sign bit: bit-pattern order == unsigned order
    matched = eligible.clone()
    above = torch.zeros_like(eligible)
    still_needed = need.clone().reshape(())
    overflow_bin = 1 << RADIX_BITS
    for shift in range(64 - RADIX_BITS, -1, -RADIX_BITS):
        digit = (unsigned_image >> shift) & (overflow_bin - 1)  # arithmetic shift, then the low 8 bits
        bins = torch.where(matched, digit, overflow_bin).reshape(-1)
        histogram = torch.zeros(overflow_bin + 1, dtype=torch.int64, device=device)
        histogram.scatter_add_(0, bins, torch.ones_like(bins))
        all_reduce_sum(histogram, group)
        at_least = histogram[:overflow_bin].flip(0).cumsum(0).flip(0)  # at_least[d] = #matched with digit ≥ d
        chosen = ((at_least >= still_needed).sum() - 1).clamp(min=0)
        at_least_padded = torch.cat([at_least, at_least.new_zeros(1)])
        still_needed = still_needed - at_least_padded.gather(0, (chosen + 1).reshape(1)).reshape(())
        above = above | (matched & (digit > chosen))
        matched = matched & (digit == chosen)
    local_ties = matched.sum().reshape(1)
    ties_before = _exclusive_prefix_over_ranks(local_ties, group)
    tie_rank = ties_before + torch.cumsum(matched.reshape(-1), 0).reshape(matched.shape)
    return (above | (matched & (tie_rank <= still_needed))) & (need > 0)


def select_largest(
    order: torch.Tensor,
    eligible: torch.Tensor,
    need: torch.Tensor,
    *,
    bound: int,
    group=None,
    force_radix: bool = False,
) -> torch.Tensor:
    """The ``need`` eligible elements (over the group) with the largest int64 ``order``; ties by global position.

    Args:
        order: int64 tensor, any shape; larger is preferred. Values must be > INT64_MIN.
        eligible: bool tensor, same shape.
        need: int64 0-dim tensor on device, 0 ≤ need ≤ #eligible over the group and need ≤ bound.
        bound: host int upper bound on ``need`` (used only without a group).
        group: torch.distributed process group or None.
        force_radix: use the group algorithm even without a group (tests cross-check the two).
    Returns:
        bool tensor shaped like ``order``.
    """
    if order.numel() == 0:
        if group is None:
            return torch.zeros_like(eligible)
        force_radix = True  # this rank must still take part in the collectives
    if group is None and not force_radix:
        return _select_largest_topk(order, eligible, need, bound)
    return _select_largest_radix(order, eligible, need, group)


# ---------------------------------------------------------------- public selectors


def select_top_covariance(scores: torch.Tensor, mask: torch.Tensor, ratio: float, *, group=None) -> torch.Tensor:
    """KL-Cov selection: the k = max(1, ⌊ratio·n_valid⌋) valid tokens with the largest score.

    Args:
        scores: floating tensor, any shape (typically [B, T] covariances c_t). Must not contain NaN.
        mask: same shape; nonzero/True marks valid tokens.
        ratio: fraction in (0, 1].
        group: optional process group; n_valid, k and the selection are then over all its ranks.
    Returns:
        bool tensor shaped like ``scores``. Exactly min(k, n_valid) tokens over the group (none when
        no token is valid); ties broken by global position, earlier first.
    """
    _check_scores_mask(scores, mask)
    ratio = check_ratio(ratio)
    valid = mask.bool()
    n_valid = all_reduce_sum(valid.sum().reshape(1), group).reshape(())
    need = torch.minimum(count_from_ratio(ratio, n_valid), n_valid)
    return select_largest(
        float_order_key(scores), valid, need, bound=k_upper_bound(ratio, scores.numel()), group=group
    )


def select_random_in_band(
    scores: torch.Tensor,
    mask: torch.Tensor,
    ratio: float,
    lb: float,
    ub: float,
    *,
    exclude: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    group=None,
    keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """Clip-Cov selection: min(k, #candidates) candidates uniformly at random, k = max(1, ⌊ratio·n_valid⌋).

    Candidates are valid tokens with lb < score < ub that are not in ``exclude``.

    Args:
        scores: floating tensor, any shape. Must not contain NaN.
        mask: same shape; nonzero/True marks valid tokens (n_valid counts these, not the candidates).
        ratio: fraction in (0, 1].
        lb: the open band's lower end, lb < ub.
        ub: the open band's upper end.
        exclude: optional bool tensor, same shape (Clip-Cov passes the tokens PPO already clipped).
        generator: source of the seed of the random keys (default: torch's default generator).
            With a group only group rank 0's draw is used (broadcast).
        group: optional process group; counts and the selection are then over all its ranks.
        keys: optional precomputed int64 random keys, same shape (e.g. from the fused covariance
            kernel); larger keys are picked first. When given, ``generator`` is not used.
    Returns:
        bool tensor shaped like ``scores``. The selection is a function of (seed, global positions,
        scores, masks), so with a group it equals the single-process selection on the
        concatenated batch for the same seed.
    """
    _check_scores_mask(scores, mask)
    ratio = check_ratio(ratio)
    check_band(lb, ub)
    check_like("exclude", exclude, scores, "scores")
    check_like("keys", keys, scores, "scores")
    if keys is not None and keys.dtype != torch.int64:
        raise TypeError(f"keys must be int64, got {keys.dtype}")
    valid = mask.bool()
    candidates = valid & (scores > lb) & (scores < ub)
    if exclude is not None:
        candidates = candidates & ~exclude.bool()
    counts = all_reduce_sum(torch.stack([valid.sum(), candidates.sum()]), group)
    need = torch.minimum(count_from_ratio(ratio, counts[0]), counts[1])
    if keys is None:
        seed = draw_seed(generator, scores.device, group)
        keys = random_keys(scores.shape, scores.device, seed, global_offset(scores.numel(), scores.device, group))
    return select_largest(keys, candidates, need, bound=k_upper_bound(ratio, scores.numel()), group=group)


def decorrelated_keys(keys: torch.Tensor) -> torch.Tensor:
    """int64 keys in [0, 2**32) re-hashed by a fixed salt: a bijection of ``keys`` (no new collisions) whose
    order is unrelated to theirs, so a control drawn from them is independent of a pick made with ``keys``."""
    return random_keys_torch(torch.tensor([CONTROL_SALT], dtype=torch.int64, device=keys.device), keys)


def select_random_matched(
    reference: torch.Tensor, mask: torch.Tensor, keys: torch.Tensor, *, group=None
) -> torch.Tensor:
    """A random control of a selection: as many tokens as ``reference`` holds (over the group), chosen
    uniformly among all valid tokens (the ``keys`` order; larger first, ties by global position).

    Args:
        reference: bool tensor, any shape (e.g. Clip-Cov's selection); only its count is used.
        mask: same shape; nonzero/True marks valid tokens.
        keys: int64 random keys, same shape (hash of seed and global position; see ``decorrelated_keys``).
        group: optional process group; the count and the selection are then over all its ranks.
    Returns:
        bool tensor shaped like ``reference``: exactly #(reference & valid) valid tokens over the group.
    """
    check_like("mask", mask, reference, "reference")
    check_like("keys", keys, reference, "reference")
    if keys.dtype != torch.int64:
        raise TypeError(f"keys must be int64, got {keys.dtype}")
    valid = mask.bool()
    need = all_reduce_sum((reference.bool() & valid).sum().reshape(1), group).reshape(())
    return select_largest(keys, valid, need, bound=max(1, reference.numel()), group=group)

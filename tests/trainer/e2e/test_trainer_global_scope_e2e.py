"""Global-scope Clip-Cov/KL-Cov in the trainer's policy update (``train.update_policy``).

The same fixed rollouts (4 prompt groups × 4 responses, old log-probs from the initial policy) are
trained by 1 process holding the whole batch in one micro-batch per mini-batch, and by 2 gloo
processes (DS_ACCELERATOR=cpu, ZeRO stage 0) holding 2 groups each, split into 1 or 3 micro-batches
per mini-batch, padded or packed. With ``algo.scope: global`` every mini-batch of every PPO epoch
must select exactly the same tokens and the parameters must move the same way; ``microbatch`` scope
runs but selects per micro-batch, which changes the update (so the comparison can fail).
"""

import copy
import random
from pathlib import Path

import pytest
import torch
from _dist import free_port as _free_port
from _dist import set_rank_environment, shutdown_process_group, spawn_ranks

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[3]
GROUPS, N = 4, 4
SEED = 11
ALL = list(range(GROUPS))
# (name, mode, scope, micro_token_budget, packing, micro-batches per mini-batch and rank on 2 ranks,
#  kept prompt groups). Mini-batches take kept groups [0::2] and [1::2]; rank 0 holds groups 0-1.
RUNS = [
    ("kl_cov-1mb", "kl_cov", "global", 10_000, False, 1, ALL),
    ("kl_cov-3mb", "kl_cov", "global", 30, False, 3, ALL),
    ("clip_cov-1mb", "clip_cov", "global", 10_000, False, 1, ALL),
    ("clip_cov-3mb-packed", "clip_cov", "global", 30, True, 3, ALL),
    # group 2 dropped (as by the DAPO filter): rank 1 holds nothing of mini-batch [1] and runs fillers
    ("clip_cov-dapo", "clip_cov", "global", 30, True, None, [0, 1, 3]),
    ("kl_cov-microbatch", "kl_cov", "microbatch", 30, False, 3, ALL),
    # rollout correction on (sequence-level IcePop, token_k1 rejection): weights per sequence, the same split
    ("rc-clip_cov-3mb-packed", "clip_cov", "global", 30, True, 3, ALL),
]
REFERENCE = [  # 1 rank, whole batch, one micro-batch per mini-batch
    ("kl_cov-ref", "kl_cov", "global", 10_000, False, 1, ALL),
    ("clip_cov-ref", "clip_cov", "global", 10_000, False, 1, ALL),
    ("clip_cov-dapo-ref", "clip_cov", "global", 10_000, False, 1, [0, 1, 3]),
    ("rc-clip_cov-ref", "clip_cov", "global", 10_000, False, 1, ALL),
]
CORRECTION = ["algo.rollout_correction.enabled=true", "algo.rollout_correction.level=sequence",
              "algo.rollout_correction.mode=mask", "algo.rollout_correction.clip_max=1.3",
              "algo.rollout_correction.clip_min=0.75", "algo.rollout_correction.rejection=token_k1",
              "algo.rollout_correction.rejection_threshold=1.15"]


def _config(mode, scope, budget, packing, extra=()):
    from fastcov.trainer.config import load_config

    return load_config(ROOT / "configs" / "tiny.yaml", [
        f"algo.mode={mode}", f"algo.scope={scope}", f"trainer.micro_token_budget={budget}",
        f"trainer.packing={str(packing).lower()}", "trainer.zero_stage=0", "trainer.device=cpu",
        f"trainer.prompts_per_step={GROUPS}", f"rollout.n={N}", "algo.mini_batches=2", "algo.ppo_epochs=2",
        # the tiny model's covariances are small: a wide band, and 10% of the tokens
        "algo.loss.clip_cov_ratio=0.1", "algo.loss.clip_cov_lb=-5.0", "algo.loss.clip_cov_ub=5.0",
        "algo.loss.kl_cov_ratio=0.1",
        # Adam's eps well above rounding noise keeps the update a smooth function of the gradient
        "optim.lr=1e-2", "optim.eps=1e-3", *extra,
    ])


def _loss_config(cfg):
    return cfg.algo.loss  # fastcov.losses.LossConfig itself, check_finite off as the trainer's


def _fresh_lm(cfg, tokenizer):
    from fastcov.trainer.runtime.model import build_model
    from fastcov.trainer.start import seed_everything

    seed_everything(SEED)
    return build_model(cfg.model, torch.device("cpu"), torch.float32, tokenizer)


def _rollouts(path: Path):
    """Fixed rollouts in global order (group-major); old log-probs of the initial policy, one sequence per
    forward, computed once here and shared by every run."""
    from fastcov.trainer.runtime.batch import Sequence, micro_batches
    from fastcov.trainer.runtime.model import PolicyModel, load_tokenizer

    cfg = _config("kl_cov", "global", 10_000, False)
    tok = load_tokenizer(cfg.model)
    policy = PolicyModel(_fresh_lm(cfg, tok))
    rng = random.Random(0)
    seqs = []
    for g in range(GROUPS):
        rewards = [rng.random() for _ in range(N)]
        mean = sum(rewards) / N
        for i in range(N):
            prompt = [rng.randrange(3, len(tok)) for _ in range(rng.randint(4, 8))]
            response = [rng.randrange(3, len(tok)) for _ in range(rng.randint(3, 12))]
            seqs.append(Sequence(prompt, response, [0.0] * len(response), g, advantage=rewards[i] - mean))
    with torch.no_grad():
        for s in seqs:
            (mb,) = micro_batches([s], 10_000, tok.pad_token_id, torch.device("cpu"))
            row, start, n = mb.spans[0]
            s.old_logprob = policy(**mb.model_inputs()).logprob[row, start : start + n].tolist()
            # a rollout engine that is not the policy (used by the rc- runs only)
            s.sample_logprob = [x + rng.gauss(0.0, 0.08) for x in s.old_logprob]
    torch.save(seqs, path)


def _run_all(rank: int, world: int, out_dir: Path, runs) -> None:
    """Every run of ``runs`` on this rank: fresh engine, one update_policy; saves selections and the update."""
    from fastcov.trainer import mini_batch as mini_batch_mod
    from fastcov.trainer import train as train_mod
    from fastcov.trainer.runtime.distributed import init_distributed
    from fastcov.trainer.runtime.model import PolicyModel, load_tokenizer
    from fastcov.trainer.runtime.policy import DeepSpeedPolicy

    device = torch.device("cpu")
    init_distributed(device)
    seqs_all = torch.load(out_dir / "rollouts.pt", weights_only=False)
    per_rank = GROUPS // world
    mine = [s for s in seqs_all if rank * per_rank <= s.group < (rank + 1) * per_rank]

    selections, n_micro = [], []
    real_select, real_micro = mini_batch_mod.compute_global_selection, train_mod.micro_batches

    def spy_select(*args, **kwargs):
        sel = real_select(*args, **kwargs)
        selections.append(sel.cov.clone())
        return sel

    def spy_micro(*args, **kwargs):
        mbs = real_micro(*args, **kwargs)
        n_micro.append(len(mbs))
        return mbs

    mini_batch_mod.compute_global_selection, train_mod.micro_batches = spy_select, spy_micro
    try:
        for name, mode, scope, budget, packing, _, kept in runs:
            cfg = _config(mode, scope, budget, packing, CORRECTION if name.startswith("rc-") else ())
            tok = load_tokenizer(cfg.model)
            engine = DeepSpeedPolicy(PolicyModel(_fresh_lm(cfg, tok)), cfg, device, world)
            before = {n: p.detach().clone() for n, p in engine.policy.lm.named_parameters()}
            selections.clear()
            n_micro.clear()
            gen = torch.Generator().manual_seed(123 + 1000 * rank)  # only rank 0's draw may matter
            seqs = [copy.deepcopy(s) for s in mine if s.group in kept]
            if name.startswith("rc-"):
                train_mod.correct_rollouts(seqs, cfg, device)
                assert any(w == 0 for s in seqs for w in s.rollout_weight)  # something is masked or rejected
            stats = train_mod.update_policy(engine, seqs, list(kept), cfg,
                                            _loss_config(cfg), cfg.optim.lr, tok.pad_token_id, device, gen)
            delta = {n: (p.detach() - before[n]) for n, p in engine.policy.lm.named_parameters()}
            torch.save({"selections": list(selections), "delta": delta, "n_micro": list(n_micro),
                        "applied": stats.applied_steps}, out_dir / f"{name}-w{world}-r{rank}.pt")
    finally:
        mini_batch_mod.compute_global_selection, train_mod.micro_batches = real_select, real_micro


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    set_rank_environment(rank, world, port)
    torch.set_num_threads(1)
    _run_all(rank, world, Path(out_dir), RUNS)
    shutdown_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("global_scope")
    _rollouts(out / "rollouts.pt")
    # 1 rank, whole batch, one micro-batch per mini-batch: in its own process too (same thread count)
    spawn_ranks(_worker_single, (_free_port(), str(out)), 1)
    spawn_ranks(_worker, (2, _free_port(), str(out)), 2)
    return out


def _worker_single(rank: int, port: int, out_dir: str) -> None:
    set_rank_environment(0, 1, port)
    torch.set_num_threads(1)
    _run_all(0, 1, Path(out_dir), REFERENCE)
    shutdown_process_group()


def _load(out: Path, name: str, world: int):
    return [torch.load(out / f"{name}-w{world}-r{r}.pt", weights_only=False) for r in range(world)]


def _max_delta_diff(a, b) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


@pytest.mark.slow
@pytest.mark.parametrize("run", [r for r in RUNS if r[2] == "global"], ids=lambda r: r[0])
def test_two_ranks_select_and_update_like_one(results, run):
    name, mode, _, _, _, split, kept = run
    prefix = "rc-" if name.startswith("rc-") else ""
    (ref,) = _load(results, f"{prefix}{mode}-dapo-ref" if kept != ALL else f"{prefix}{mode}-ref", 1)
    ranks = _load(results, name, 2)
    assert ref["applied"] == 4 and all(r["applied"] == 4 for r in ranks)  # 2 epochs x 2 mini-batches
    assert ref["n_micro"] == [1] * 4
    if split is not None:
        assert all(r["n_micro"] == [split] * 4 for r in ranks)
    assert len(ref["selections"]) == 4  # once per mini-batch and epoch
    for k, whole in enumerate(ref["selections"]):
        # rank 0 holds the mini-batch's first sequences, rank 1 the rest: concatenated, the 1-rank rows
        split_sel = torch.cat([r["selections"][k] for r in ranks])
        assert split_sel.shape == whole.shape
        assert int(whole.sum()) > 0
        assert torch.equal(split_sel, whole), f"mini-batch {k}: selections differ"
    scale = max(float(d.abs().max()) for d in ref["delta"].values())
    assert scale > 1e-3  # the parameters moved
    for r in ranks:
        assert _max_delta_diff(r["delta"], ref["delta"]) < 1e-6


@pytest.mark.slow
def test_the_rollout_weights_leave_the_selection_and_change_the_update(results):
    (plain,) = _load(results, "clip_cov-ref", 1)
    (corrected,) = _load(results, "rc-clip_cov-ref", 1)
    # the first mini-batch selects before any update: the same tokens (later ones follow different policies)
    assert torch.equal(plain["selections"][0], corrected["selections"][0])
    assert _max_delta_diff(plain["delta"], corrected["delta"]) > 1e-4


@pytest.mark.slow
def test_microbatch_scope_runs_and_differs(results):
    (ref,) = _load(results, "kl_cov-ref", 1)
    ranks = _load(results, "kl_cov-microbatch", 2)
    assert all(r["applied"] == 4 and r["selections"] == [] for r in ranks)  # no global selection
    assert _max_delta_diff(ranks[0]["delta"], ranks[1]["delta"]) == 0.0  # ranks agree on the update
    assert _max_delta_diff(ranks[0]["delta"], ref["delta"]) > 1e-3  # but it is not the global one

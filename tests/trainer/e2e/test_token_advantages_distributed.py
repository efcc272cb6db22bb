"""PRIME and REINFORCE++ token advantages over 2 gloo ranks equal one process on the whole batch (batch
normalisation statistics and the PRM's gradients are summed over ranks)."""

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist import free_port, spawn_ranks

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[3]
KW = {"budget": 512, "packing": False, "row_capacity": None}


def _seqs():
    from fastcov.trainer.runtime.batch import Sequence

    g = torch.Generator().manual_seed(5)
    seqs = []
    for i in range(8):  # 2 prompts x 4 rollouts; responses of different lengths
        n = 2 + (i * 3) % 5
        resp = torch.randint(10, 40, (n,), generator=g).tolist()
        s = Sequence([1, 2, 3 + i // 4], resp, [0.0] * n, i // 4, reward=float(i % 3 == 0))
        s.old_logprob = (-torch.rand(n, generator=g)).tolist()
        seqs.append(s)
    return seqs


def _compute(seqs):
    from fastcov.trainer.config import load_config
    from fastcov.trainer.runtime.model import build_model, load_tokenizer
    from fastcov.trainer.token_level.advantages import TokenAdvantages

    out = {}
    for name, over in (("prime", ["algo.adv_estimator=prime", "algo.prime.lr=1e-2"]),
                       ("rpp", ["algo.adv_estimator=reinforce_pp", "algo.kl_coef=0.3"])):
        cfg = load_config(ROOT / "configs" / "tiny.yaml", over)
        torch.manual_seed(0)
        tok = load_tokenizer(cfg.model)
        lm = build_model(cfg.model, torch.device("cpu"), torch.float32, tok)
        if name == "rpp":  # a reference that differs from the policy that sampled
            with torch.no_grad():
                for p in lm.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        ta = TokenAdvantages(cfg, lm)
        metrics = ta.apply(seqs, tok.pad_token_id, torch.device("cpu"), KW)
        out[name] = {"adv": [list(s.token_advantages) for s in seqs], "metrics": metrics}
        if ta.prm is not None:
            out[name]["prm"] = [p.detach().clone() for p in ta.prm.params]
    return out


def _worker(rank, port, out_dir):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    try:
        torch.save(_compute(_seqs()[4 * rank : 4 * rank + 4]), Path(out_dir) / f"rank{rank}.pt")
        # lopsided: rank 1 holds no sequences at all (e.g. all its groups filtered out)
        torch.save(_compute(_seqs() if rank == 0 else []), Path(out_dir) / f"lopsided{rank}.pt")
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_two_ranks_equal_one_process(tmp_path):
    spawn_ranks(_worker, (free_port(), str(tmp_path)), 2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    single = _compute(_seqs())
    for name in ("prime", "rpp"):
        got = ranks[0][name]["adv"] + ranks[1][name]["adv"]
        for a, b in zip(got, single[name]["adv"], strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-4)
        for k, v in single[name]["metrics"].items():
            assert ranks[0][name]["metrics"][k] == pytest.approx(v, rel=1e-4, abs=1e-6), (name, k)
    for p0, p1, p in zip(ranks[0]["prime"]["prm"], ranks[1]["prime"]["prm"], single["prime"]["prm"], strict=True):
        torch.testing.assert_close(p0, p1)  # every rank holds the same PRM
        torch.testing.assert_close(p0, p, rtol=1e-4, atol=1e-5)
    lop = [torch.load(tmp_path / f"lopsided{r}.pt") for r in range(2)]
    for name in ("prime", "rpp"):
        assert lop[1][name]["adv"] == []
        for a, b in zip(lop[0][name]["adv"], single[name]["adv"], strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-4)
    for p0, p1, p in zip(lop[0]["prime"]["prm"], lop[1]["prime"]["prm"], single["prime"]["prm"], strict=True):
        torch.testing.assert_close(p0, p1)
        torch.testing.assert_close(p0, p, rtol=1e-4, atol=1e-5)
    flat = torch.tensor([a for s in single["rpp"]["adv"] for a in s])
    assert abs(float(flat.mean())) < 1e-5 and single["rpp"]["metrics"]["kl_ref"] != 0

"""Bucketed weight sync (trainer/runtime/weight_buckets.py, DeepSpeedPolicy.weight_buckets,
HFRolloutEngine.update_weights). Under ZeRO-3 on two processes: tests/trainer/e2e/test_weight_sync_e2e.py."""

import contextlib
import json
import os
import random

import pytest
import torch

from fastcov.trainer.runtime.weight_buckets import (
    ALIGN,
    Bucket,
    BucketMeta,
    aligned,
    as_buckets,
    bucket_bytes_from_mb,
    iter_buckets,
    iter_named,
    plan_buckets,
    unflatten,
)


def _check_plan(sizes, cap, runs):
    flat = [i for r in runs for i in r]
    assert flat == list(range(len(sizes))), "runs must cover every tensor once, in order"
    for r in runs:
        total = sum(aligned(sizes[i]) for i in r)
        if cap <= 0:
            assert len(r) == 1
        else:
            assert total <= cap or len(r) == 1, (r, total, cap)
    # greedy: a run is only closed when the next tensor would not fit
    for a, b in zip(runs, runs[1:], strict=False):
        if cap > 0:
            assert sum(aligned(sizes[i]) for i in a) + aligned(sizes[b[0]]) > cap


def test_plan_buckets_respects_the_bound():
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.choice([1, 7, 64, 100, 4096, 10_000, 1 << 20]) for _ in range(rng.randint(0, 30))]
        for cap in (0, 64, 1000, 1 << 16, 1 << 21):
            _check_plan(sizes, cap, plan_buckets(sizes, cap))
    assert plan_buckets([10, 10, 10], 0) == [range(0, 1), range(1, 2), range(2, 3)]
    assert plan_buckets([100, 5000, 10], 1024) == [range(0, 1), range(1, 2), range(2, 3)]  # big one alone
    assert plan_buckets([10, 10, 10], 10 * ALIGN) == [range(0, 3)]
    assert bucket_bytes_from_mb(1) == 1 << 20 and bucket_bytes_from_mb(0) == 0


def test_flatten_unflatten_roundtrip_mixed_dtypes():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, generator=g), torch.randn(7, generator=g).to(torch.bfloat16),
               torch.randint(0, 100, (2, 2), generator=g), torch.rand(5, generator=g) > 0.5,
               torch.randn(4, 6, generator=g).t()]  # non-contiguous
    b = Bucket([f"t{i}" for i in range(len(tensors))], tensors)
    meta = b.meta()
    assert all(o % ALIGN == 0 for o in meta.offsets) and meta.nbytes == b.nbytes
    assert meta.dtypes == ["float32", "bfloat16", "int64", "bool", "float32"]
    meta2 = BucketMeta.from_json(json.loads(json.dumps(meta.to_json())))
    assert meta2 == meta
    buf = torch.full((meta.nbytes + 100,), 255, dtype=torch.uint8)
    flat = b.flatten(out=buf)
    assert flat.data_ptr() == buf.data_ptr() and flat.numel() == meta.nbytes
    for (name, got), want in zip(unflatten(flat, meta2), tensors, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name
    with pytest.raises(ValueError, match="bytes"):
        b.flatten(out=torch.empty(meta.nbytes - 1, dtype=torch.uint8))
    bad = BucketMeta(meta.names, meta.shapes, meta.dtypes, [0, 0, 0, 0, meta.nbytes], meta.nbytes)
    with pytest.raises(ValueError, match="outside the bucket"):
        unflatten(flat, bad)


class FakeZero3:
    """Parameters whose data is empty until ``gather`` is entered (like ZeRO-3's ``ds_tensor`` shards);
    counts how many bytes are gathered at once."""

    def __init__(self, module: torch.nn.Module):
        self.full = {}
        for p in module.parameters():
            self.full[id(p)] = p.data.clone()
            p.ds_id, p.ds_shape = id(p), tuple(p.shape)
            p.data = torch.empty(0, dtype=p.dtype)
        self.live = 0
        self.peak = 0
        self.calls = []

    @contextlib.contextmanager
    def gather(self, params):
        self.calls.append(len(params))
        for p in params:
            p.data = self.full[p.ds_id].clone()
            self.live += p.data.numel() * p.element_size()
        self.peak = max(self.peak, self.live)
        try:
            yield
        finally:
            for p in params:
                self.live -= p.data.numel() * p.element_size()
                p.data = torch.empty(0, dtype=p.dtype)


def _tiny_lm(seed=0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model("qwen2", vocab_size=300, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=64, tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


@pytest.mark.parametrize("cap_kb", [0, 16, 64, 10_000])
def test_buckets_deliver_every_tensor_once_within_the_bound(cap_kb):
    pytest.importorskip("transformers")
    from fastcov.trainer.rollout import HFRolloutEngine

    policy = _tiny_lm(0)
    want = {n: t.detach().clone() for n, t in list(policy.named_parameters()) + list(policy.named_buffers())}
    zero = FakeZero3(policy)
    cap = cap_kb * 1024
    seen, n_buckets = [], 0
    target = _tiny_lm(1)
    engine = HFRolloutEngine(target, eos_token_ids=[0], pad_token_id=0)

    def spy():
        nonlocal n_buckets
        for b in iter_buckets(list(policy.named_parameters()) + list(policy.named_buffers()), cap, zero.gather):
            n_buckets += 1
            assert len(b) == 1 or cap == 0 or b.nbytes <= cap
            assert zero.live <= max(cap, b.nbytes), "more than the bucket is gathered"
            seen.extend(b.names)
            yield b

    engine.update_weights(spy())
    assert sorted(seen) == sorted(want) and len(seen) == len(set(seen)), "every tensor exactly once"
    got = dict(target.named_parameters())
    got.update(dict(target.named_buffers()))
    for n, t in want.items():
        assert torch.equal(got[n], t), n
    assert zero.live == 0
    biggest = max(t.numel() * t.element_size() for t in want.values())
    assert zero.peak <= max(cap, biggest)
    n_params = len(list(policy.parameters()))
    if cap_kb == 0:
        assert n_buckets == len(want) and max(zero.calls) == 1
    elif cap_kb == 10_000:
        assert n_buckets == 1 and zero.calls == [n_params]
    else:
        assert 1 < n_buckets < len(want)


def test_update_weights_accepts_plain_pairs_and_rename_hook():
    pytest.importorskip("transformers")
    from fastcov.trainer.rollout import HFRolloutEngine

    src, dst = _tiny_lm(0), _tiny_lm(1)
    engine = HFRolloutEngine(dst, eos_token_ids=[0], pad_token_id=0)
    engine.update_weights(src.named_parameters())  # a plain (name, tensor) iterable still works
    for (n, a), (_, b) in zip(src.named_parameters(), dst.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    with pytest.raises(KeyError, match="no tensor named 'x.weight'"):
        engine.update_weights([("x.weight", torch.zeros(1))])
    named = list(src.named_parameters())
    kept = list(iter_named(iter_buckets(named, 1 << 20, rename=lambda n: None if "mlp" in n else "m." + n)))
    assert kept and all(n.startswith("m.") and "mlp" not in n for n, _ in kept)
    assert [b.names for b in as_buckets(named[:2])] == [[named[0][0]], [named[1][0]]]


def test_peak_host_memory_is_one_bucket_not_a_state_dict():
    """Flattening a 64 MiB model in 4 MiB buckets into one reused buffer (the server-mode sender's
    path) raises peak RSS by about one bucket; a state-dict copy would take 64 MiB."""
    from bench._measure import PeakMemory

    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc/self/clear_refs")
    named = [(f"w{i}", torch.randn(1 << 20)) for i in range(16)]  # 16 x 4 MiB fp32
    cap = 4 << 20
    buf = torch.empty(0, dtype=torch.uint8)

    def sync():
        nonlocal buf
        total = 0
        for b in iter_buckets(named, cap):
            if buf.numel() < b.nbytes:
                buf = torch.empty(b.nbytes, dtype=torch.uint8)
            total += int(b.flatten(out=buf)[::4096].sum())
        return total

    with PeakMemory(torch.device("cpu")) as pm:
        sync()
    if pm.peak_bytes is None:
        pytest.skip("no RSS measurement here")
    assert pm.peak_bytes < 12 << 20, f"peak {pm.peak_bytes / 2**20:.1f} MiB for 4 MiB buckets"
    with PeakMemory(torch.device("cpu")) as pm_sd:
        sd = {n: t.clone() for n, t in named}  # the state-dict copy the bucketed sync avoids
    del sd
    assert pm_sd.peak_bytes > 48 << 20, "the RSS probe should see a 64 MiB copy"

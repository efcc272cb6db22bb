"""Weight-sync benchmark on CPU: policy (DeepSpeed ZeRO-0 / ZeRO-3) -> HF rollout engine, bucketed.

    python -m bench.weight_sync                                  # demo + qwen2-100m, ~5 min on 2 cores
    python -m bench.weight_sync --models demo --buckets 0 1 16 --procs 1

Per case (model x ZeRO stage x processes) one fresh job (``torch.multiprocessing.spawn``, gloo, one
intra-op thread per process) builds the policy engine and the HF rollout engine as the trainer does, then
for each bucket size (MiB; 0 = per parameter) records, on rank 0:

* ``sync_ms``: ``rollout.update_weights(engine.weight_buckets(mb))``, median of ``--repeats`` after one
  warm-up (ZeRO-3: gather each bucket's shards, copy into the rollout model, release);
* ``pack_ms``: the same bucket stream packed into one reused flat uint8 buffer (the extra work of vLLM
  server mode before each NCCL broadcast; the broadcast itself is not measured here);
* ``peak_sync_mib`` / ``peak_pack_mib``: peak RSS increment of one more sync / pack (bench._measure.PeakMemory)
  with ``malloc_trim`` after each bucket, so RSS tracks live tensors: without it glibc keeps the freed
  ZeRO-3 gather buffers of a 100M model (~130 MiB over a sync) that a trim returns;
* ``buckets``: buckets per sync; ``exact``: the rollout weights equal the gathered policy weights.

Results: <out>/weight-sync-cpu-<date>.json and .md. See docs/weight_sync.md.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench._common import fmt, rank_environment

MODELS = {
    # trainer/demo.py's tiny Qwen2 (vocabulary: the builtin arithmetic tokenizer's)
    "demo": dict(model_type="qwen2", hidden_size=96, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 tie_word_embeddings=False, rope_theta=10000.0),
    # a Qwen2-shaped ~100M-parameter model (fp32 on CPU: ~400 MB)
    "qwen2-100m": dict(model_type="qwen2", hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                       num_attention_heads=12, num_key_value_heads=4, vocab_size=16000,
                       max_position_embeddings=512, tie_word_embeddings=False),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(arch: dict, zero: int, run_dir: str):
    from fastcov.trainer.config import config_from_dict

    return config_from_dict({
        "model": {"arch": dict(arch), "tokenizer": "builtin:arith"},
        "data": {"synthetic": {"enabled": True}},
        "trainer": {"zero_stage": zero, "device": "cpu", "run_dir": run_dir, "prompts_per_step": 16},
    })


@dataclass
class _Job:
    """One benchmark process: the policy engine, the rollout engine it syncs into, and the state its
    ``sync`` / ``pack`` steps share."""

    engine: Any  # fastcov.trainer.runtime.policy.DeepSpeedPolicy
    rollout: Any  # the HF rollout engine with its own copy of the weights (per node with several processes)
    n_params: int
    trim: bool = False  # malloc_trim after each bucket (set for the peak-memory run)
    counted: list[int] = field(default_factory=list)  # bytes of each bucket of the last sync
    buf: Any = None  # pack's reused flat uint8 buffer

    def stream(self, mb):
        from bench._measure import malloc_trim

        for b in self.engine.weight_buckets(mb):
            yield b
            if self.trim:
                malloc_trim()

    def sync(self, mb) -> None:
        self.counted.clear()

        def count(bs):
            for b in bs:
                self.counted.append(b.nbytes)
                yield b

        self.rollout.update_weights(count(self.stream(mb)))

    def pack(self, mb) -> None:
        import torch

        for b in self.stream(mb):
            if self.buf.numel() < b.nbytes:
                self.buf = torch.empty(0, dtype=torch.uint8)
                self.buf = torch.empty(b.nbytes, dtype=torch.uint8)
            b.flatten(out=self.buf)


def _process_env(rank: int, world: int, port: int) -> None:
    """What the launcher would set, and one intra-op thread (set before torch is imported)."""
    os.environ.update(rank_environment(rank, world, port))
    import torch

    torch.set_num_threads(1)


def _build(spec: dict, rank: int, world: int) -> _Job:
    """The policy engine and the HF rollout engine, built as the trainer builds them."""
    import torch

    from fastcov.trainer.rollout import make_rollout_engine
    from fastcov.trainer.runtime.distributed import init_distributed
    from fastcov.trainer.runtime.model import PolicyModel, build_model, load_tokenizer
    from fastcov.trainer.runtime.policy import DeepSpeedPolicy

    cpu = torch.device("cpu")
    cfg = _config(MODELS[spec["model"]], spec["zero"], spec["run_dir"])
    init_distributed(cpu)
    torch.manual_seed(0)
    tok = load_tokenizer(cfg.model)
    lm = build_model(cfg.model, cpu, torch.float32, tok)
    engine = DeepSpeedPolicy(PolicyModel(lm), cfg, cpu, world)
    # the HF engine's own copy (what ZeRO-3 runs use; with several processes one per node, held by its first
    # rank) is the sync target at every stage measured here
    rollout = make_rollout_engine(cfg, engine.policy.lm, tok, device=cpu, rank=rank, world=world, zero_stage=3)
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.policy.lm.parameters())
    return _Job(engine, rollout, n_params)


def _measure(job: _Job, fn, repeats: int) -> tuple[list[float], int | None]:
    """fn's times (ms) over ``repeats`` runs after one warm-up, then the peak RSS increment (bytes) of one
    more run with malloc_trim after each bucket (None where PeakMemory cannot tell)."""
    import torch
    import torch.distributed as dist

    from bench._measure import PeakMemory

    with torch.no_grad():
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        dist.barrier()
        job.buf = torch.empty(0, dtype=torch.uint8)  # the measured pack allocates its buffer
        job.trim = True
        with PeakMemory(torch.device("cpu")) as pm:
            fn()
        job.trim = False
    return times, pm.peak_bytes


def _rollout_model(rollout):
    """The rollout copy this rank holds: the HF engine's, or a NodeRolloutEngine's on the node's first
    rank (None on the node's other ranks, which hold none)."""
    engine = getattr(rollout, "engine", rollout)
    return None if engine is None else engine.model


def _bucket_row(job: _Job, spec: dict, world: int, mb: float) -> dict:
    """One row of the results: sync and pack of bucket size ``mb``, then the exactness check."""
    import torch

    job.buf = torch.empty(0, dtype=torch.uint8)
    res = {}
    for name, fn in (("sync", lambda: job.sync(mb)), ("pack", lambda: job.pack(mb))):
        times, peak = _measure(job, fn, spec["repeats"])
        res[f"{name}_ms"] = statistics.median(times)
        res[f"{name}_ms_all"] = [round(t, 2) for t in times]
        res[f"peak_{name}_mib"] = None if peak is None else peak / 2**20
    job.sync(mb)
    lm = _rollout_model(job.rollout)
    own = {} if lm is None else dict(lm.named_parameters())
    # a list, not a short-circuiting generator: under ZeRO-3 every rank must walk named_weights to its end
    exact = all([torch.equal(own[n], t) for n, t in job.engine.named_weights() if n in own])
    return dict(model=spec["model"], params=job.n_params, zero=spec["zero"], procs=world,
                bucket_mb=mb, buckets=len(job.counted),
                largest_bucket_mib=max(job.counted) / 2**20, exact=exact, **res)


def _worker(rank: int, world: int, port: int, spec: dict, out: str) -> None:
    _process_env(rank, world, port)
    import torch.distributed as dist

    job = _build(spec, rank, world)
    rows = [_bucket_row(job, spec, world, mb) for mb in spec["buckets"]]
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()


def run_case(model: str, zero: int, procs: int, buckets: list[float], repeats: int) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        spec = dict(model=model, zero=zero, buckets=buckets, repeats=repeats, run_dir=os.path.join(tmp, "run"))
        t0 = time.perf_counter()
        mp.spawn(_worker, args=(procs, _free_port(), spec, out), nprocs=procs, join=True)
        rows = json.loads(Path(out).read_text())
    print(f"[weight_sync] {model} zero{zero} x{procs}: {time.perf_counter() - t0:.0f} s", flush=True)
    return rows


def _fmt(x, nd=1):
    return fmt(x, f".{nd}f")


def write_results(rows: list[dict], env: dict, out_dir: Path, date: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    jpath, mpath = out_dir / f"weight-sync-cpu-{date}.json", out_dir / f"weight-sync-cpu-{date}.md"
    jpath.write_text(json.dumps({"env": env, "rows": rows}, indent=1) + "\n")
    lines = [f"# Weight sync on CPU ({date})", "",
             f"{env['host_cpu']}, {env['host_cores']} cores, torch {env['torch']}, deepspeed {env['deepspeed']}; "
             "one intra-op thread per process; gloo. Policy (DeepSpeed, fp32) -> HF rollout engine. "
             "`sync`: `update_weights(engine.weight_buckets(mb))`; `pack`: the same buckets into one flat "
             "buffer (vLLM server mode's extra step). Median of the timed repeats; peak = RSS increment "
             "on rank 0 of a separate run with malloc_trim after each bucket (live memory). "
             "bucket 0 = per parameter.", "",
             "| model | params | ZeRO | procs | bucket MiB | buckets | largest MiB | sync ms | pack ms "
             "| peak sync MiB | peak pack MiB | exact |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.2f}M | {r['zero']} | {r['procs']} | "
                     f"{'per-param' if r['bucket_mb'] == 0 else _fmt(r['bucket_mb'], 0)} | {r['buckets']} | "
                     f"{_fmt(r['largest_bucket_mib'], 2)} | {_fmt(r['sync_ms'])} | {_fmt(r['pack_ms'])} | "
                     f"{_fmt(r['peak_sync_mib'])} | {_fmt(r['peak_pack_mib'])} | {r['exact']} |")
    mpath.write_text("\n".join(lines) + "\n")
    return jpath, mpath


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--zero", nargs="+", type=int, default=[0, 3], choices=[0, 1, 2, 3])
    ap.add_argument("--procs", nargs="+", type=int, default=[1, 2], help="2 processes run for ZeRO-3 only")
    ap.add_argument("--buckets", nargs="+", type=float, default=[0, 1, 16, 64], help="MiB; 0 = per parameter")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    import deepspeed
    import torch

    from bench._measure import cpu_count, cpu_model

    rows = []
    for model in args.models:
        for zero in args.zero:
            for procs in args.procs:
                if procs > 1 and zero != 3:
                    continue
                rows += run_case(model, zero, procs, args.buckets, args.repeats)
    env = {"host_cpu": cpu_model(), "host_cores": cpu_count(), "torch": torch.__version__,
           "deepspeed": deepspeed.__version__, "repeats": args.repeats}
    jpath, mpath = write_results(rows, env, Path(args.out), _dt.date.today().isoformat())
    print(mpath.read_text())
    print(f"[weight_sync] wrote {jpath} and {mpath}")


if __name__ == "__main__":
    main()

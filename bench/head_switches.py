"""What each switch of the fused head costs on CPU: the PyTorch twin with ``sum_p2``, κ, a per-token temperature,
a soft cap, and a vocabulary-parallel head on 2 gloo ranks, each against the same call without it (one run).

    python -m bench.head_switches                          # N 2048, D 256, V 32768, fp32, 2 threads
    python -m bench.head_switches --n 512 --v 8192 --repeats 2

Times: forward and forward+backward (of Σ g·log p + e·H) per case, the minimum of ``--repeats`` rounds in which
every case runs once in turn (interleaved, so a shared machine's load drifts into all of them alike), after one
warm-up round; the ratio is against ``base`` of the same run. Memory: the peak RSS increment of one
forward+backward in a fresh process per case (``bench._measure.PeakMemory``: inputs excluded, the gradients the
call returns included). The vocabulary-parallel row runs 2 ranks of one thread each, each holding V/2 rows of the
head (Megatron's layout), against ``base`` on the whole head with both threads in one process: the same 2 cores;
its time is rank 0's, its memory the larger rank's. Results: ``bench/results/cpu-2core/head-switches-<date>.jsonl``
and ``.md`` beside it (``--out``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench import _measure as M

REPO = Path(__file__).resolve().parent.parent
CASES = {  # name -> keyword arguments of linear_logprob_entropy beyond the base call
    "base": {},
    "sum_p2": {"sum_p2": True},
    "vocab_cov": {"vocab_cov": True},
    "sum_p2+vocab_cov": {"sum_p2": True, "vocab_cov": True},
    "per_token_temperature": {"temperature": "per_token"},
    "softcap": {"softcap": 30.0},
}
PARALLEL = "vocab_parallel_2_ranks"
TEMPERATURE = 0.7


def _inputs(n: int, d: int, v: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g)
    weight = torch.randn(v, d, generator=g) * (3.0 / d ** 0.5)
    labels = torch.randint(0, v, (n,), generator=g)
    temps = torch.rand(n, generator=g) + 0.5  # per token, in [0.5, 1.5)
    up = torch.randn(2, n, generator=g)
    return hidden, weight, labels, temps, up


def _call(case: str, hidden, weight, labels, temps, up, backward: bool, **extra):
    from fastcov import linear_logprob_entropy

    kw = dict(CASES.get(case, {}))
    kw["temperature"] = temps if kw.get("temperature") == "per_token" else TEMPERATURE
    h = hidden.detach().requires_grad_(backward)
    w = weight.detach().requires_grad_(backward)
    out = linear_logprob_entropy(h, w, labels, impl="torch", **kw, **extra)
    if not backward:
        return out
    return torch.autograd.grad((out.logprob * up[0] + out.entropy * up[1]).sum(), (h, w))


def time_cases(args) -> dict[str, dict]:
    torch.set_num_threads(args.threads)
    M.set_malloc_mode("time")
    inputs = _inputs(args.n, args.d, args.v)
    times: dict[str, dict[str, list[float]]] = {c: {"fwd": [], "fwd_bwd": []} for c in CASES}
    for rnd in range(args.repeats + 1):
        for case in CASES:
            for kind, backward in (("fwd", False), ("fwd_bwd", True)):
                t0 = time.perf_counter()
                _call(case, *inputs, backward=backward)
                if rnd:  # round 0 warms up
                    times[case][kind].append(time.perf_counter() - t0)
        print(f"[head_switches] round {rnd}/{args.repeats} done", file=sys.stderr, flush=True)
    return {c: {k: min(v) * 1e3 for k, v in t.items()} for c, t in times.items()}


def _memory_main(case: str, n: int, d: int, v: int, threads: int) -> None:
    """In a fresh process: the peak RSS increment of one forward+backward of ``case``."""
    torch.set_num_threads(threads)
    _call(case, *_inputs(64, d, v), backward=True)  # warm-up: lazy imports, the allocator
    inputs = _inputs(n, d, v)
    with M.PeakMemory(torch.device("cpu")) as pm:
        grads = _call(case, *inputs, backward=True)
        del grads
    print(json.dumps({"case": case, "peak_bytes": pm.peak_bytes, "method": pm.method}))


def _rank_main(rank: int, world: int, port: int, n: int, d: int, v: int, repeats: int, out: str) -> None:
    """One rank of the vocabulary-parallel case, one thread: its V/world rows; rank 0 also times the base call on
    the whole head (one thread, the other rank idle at a barrier), interleaved with the parallel calls. Times and
    peak memory to ``out``."""
    import torch.distributed as dist

    from bench._common import rank_environment

    os.environ.update(rank_environment(rank, world, port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    hidden, weight, labels, temps, up = _inputs(n, d, v)
    local = v // world
    shard = weight[rank * local:(rank + 1) * local]
    whole = weight[:local * world]
    labels = labels % (local * world)
    res: dict = {"fwd": [], "fwd_bwd": [], "base_fwd": [], "base_fwd_bwd": []}
    for rnd in range(repeats + 1):
        for kind, backward in (("fwd", False), ("fwd_bwd", True)):
            dist.barrier()
            t0 = time.perf_counter()
            _call("base", hidden, shard, labels, temps, up, backward=backward, vocab_parallel=dist.group.WORLD)
            if rnd:
                res[kind].append(time.perf_counter() - t0)
            dist.barrier()
            if rank == 0:
                t0 = time.perf_counter()
                _call("base", hidden, whole, labels, temps, up, backward=backward)
                if rnd:
                    res["base_" + kind].append(time.perf_counter() - t0)
    dist.barrier()
    with M.PeakMemory(torch.device("cpu")) as pm:
        grads = _call("base", hidden, shard, labels, temps, up, backward=True, vocab_parallel=dist.group.WORLD)
        del grads
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {**{k: min(x) * 1e3 for k, x in res.items() if x}, "peak_bytes": pm.peak_bytes}))
    dist.destroy_process_group()


def _subprocess_env() -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    return env


def memory_cases(args) -> dict[str, int | None]:
    out = {}
    for case in CASES:
        proc = subprocess.run([sys.executable, "-m", "bench.head_switches", "--memory-case", case, "--n", str(args.n),
                               "--d", str(args.d), "--v", str(args.v), "--threads", str(args.threads)],
                              capture_output=True, text=True, cwd=REPO, env=_subprocess_env(), timeout=1800)
        line = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        out[case] = json.loads(line[-1])["peak_bytes"] if line else None
        if not line:
            print(f"[head_switches] memory of {case} failed: {proc.stderr[-500:]}", file=sys.stderr)
    return out


def parallel_case(args) -> dict | None:
    import tempfile

    from fastcov.trainer.runtime.distributed import free_port

    world = 2
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [subprocess.Popen([sys.executable, "-m", "bench.head_switches", "--rank", str(r), "--port", str(port),
                                   "--n", str(args.n), "--d", str(args.d), "--v", str(args.v), "--repeats",
                                   str(args.repeats), "--rank-out", tmp], cwd=REPO, env=_subprocess_env())
                 for r in range(world)]
        if any(p.wait(timeout=3600) != 0 for p in procs):
            return None
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    return {"fwd": ranks[0]["fwd"], "fwd_bwd": ranks[0]["fwd_bwd"],
            "peak_bytes": max((r["peak_bytes"] or 0) for r in ranks),
            "base_1_thread": {"fwd": ranks[0]["base_fwd"], "fwd_bwd": ranks[0]["base_fwd_bwd"]}}


def render(rows: list[dict], meta: dict) -> str:
    base = next(r for r in rows if r["case"] == "base")
    lines = [f"# The fused head's switches on CPU (the PyTorch twin), {meta['date']}", "",
             f"`{meta['command']}` on {meta['cpu']} ({meta['cores']} cores), fp32, N {meta['n']}, D {meta['d']}, "
             f"V {meta['v']}, T {TEMPERATURE}, {meta['threads']} threads, min of {meta['repeats']} interleaved rounds; "
             f"load average at the start {meta['load']}.", "",
             "| case | fwd ms | × base | fwd+bwd ms | × base | peak extra fwd+bwd | × base |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ref = r.get("base_1_thread") or base  # the 2-rank row: against the whole head on one thread, same run

        def ratio(key, r=r, ref=ref):
            return f"{r[key] / ref[key]:.2f}" if r.get(key) and ref.get(key) else "—"
        lines.append(f"| {r['case']} | {r['fwd']:.0f} | {ratio('fwd')} | {r['fwd_bwd']:.0f} | {ratio('fwd_bwd')} "
                     f"| {M.fmt_bytes(r.get('peak_bytes'))} | {ratio('peak_bytes')} |")
    par = next((r for r in rows if r["case"] == PARALLEL), None)
    if par is not None:
        one = par["base_1_thread"]
        lines += ["", f"{PARALLEL}: rank 0's time, one thread per rank, against the whole head on one thread in the "
                  f"same processes ({one['fwd']:.0f} ms fwd, {one['fwd_bwd']:.0f} ms fwd+bwd); memory against base "
                  "(2 threads, whole head), the larger rank's."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.head_switches", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--v", type=int, default=32768)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "cpu-2core"))
    p.add_argument("--no-parallel", action="store_true", help="leave out the 2-rank vocabulary-parallel row")
    p.add_argument("--memory-case", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--rank-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.memory_case:
        _memory_main(args.memory_case, args.n, args.d, args.v, args.threads)
        return 0
    if args.rank is not None:
        _rank_main(args.rank, 2, args.port, args.n, args.d, args.v, args.repeats, args.rank_out)
        return 0
    meta = {"date": _dt.date.today().isoformat(), "cpu": M.cpu_model(), "cores": M.cpu_count(), "n": args.n,
            "d": args.d, "v": args.v, "threads": args.threads, "repeats": args.repeats,
            "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
            "command": "python -m bench.head_switches " + " ".join(argv if argv is not None else sys.argv[1:])}
    times = time_cases(args)
    memory = memory_cases(args)
    rows = [{"case": c, **times[c], "peak_bytes": memory.get(c)} for c in CASES]
    if not args.no_parallel:
        par = parallel_case(args)
        if par is not None:
            rows.append({"case": PARALLEL, **par})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"head-switches-{meta['date']}"
    with stem.with_suffix(".jsonl").open("w") as f:
        for r in rows:
            f.write(json.dumps({**meta, **r}) + "\n")
    stem.with_suffix(".md").write_text(render(rows, meta))
    print(render(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())

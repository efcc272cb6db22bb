"""bf16 correctness of fastcov.linear_logprob_entropy on a GPU, against float64, at Qwen2.5-7B shapes.

    python -m bench.correctness_gpu                       # N 4096, D 3584, V 152064; impls triton, torch
    python -m bench.correctness_gpu --impls triton naive --temperatures 1.0 --out /tmp/corr

For every case (temperature x {no bias, a bias that makes every logit negative}) and implementation:
forward + backward of  L = sum_i g_i*logprob_i + e_i*entropy_i  (g, e random) on bf16 inputs, then
the same quantities recomputed in float64 on the GPU from the very same bf16 values, token chunk by
token chunk (one chunk's [chunk, V] float64 logits at a time; nothing approximated):

    logprob, entropy           all N rows
    dL/dhidden                 a subset of rows (random, the ignored ones, the most peaked ones)
    dL/dweight                 a subset of vocabulary rows (random, some labels, the first and the
                               last rows so the partial last tile is covered)
    dL/dbias                   all V entries (bias cases)

Errors are max |a - ref| ("max_abs") and max |a - ref| / max |ref| ("max_rel", normwise), plus
invariants: logprob <= 0 on every valid row, exactly 0 logprob/entropy/gradient on ignore_index rows,
everything finite. "naive" (materialized fp32 logits of the bf16 matmul) is reported as the baseline
a plain PyTorch loop reaches; it is not held to the tolerances. Writes JSON to --out and exits 1
when a fastcov implementation misses a tolerance.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

IGNORE = -100
# bf16 inputs, fp32 statistics and accumulation: what the kernel must meet (gradients come back in
# bf16, one rounding of 2^-9 relative each, hence the normwise 1e-2)
TOLERANCES = {"logprob_max_abs": 1e-2, "entropy_max_abs": 1e-2, "dhidden_max_rel": 1e-2,
              "dweight_max_rel": 1e-2, "dbias_max_rel": 1e-2}


class Fatal(SystemExit):
    """Exit ``code`` with a one-line message: the CLI prints it; a caller that catches it (bench/gpu_suite/)
    records ``message`` rather than only the exit status."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(code)
        self.message = message


def die(msg: str, code: int = 2) -> None:
    print(f"bench/correctness_gpu.py: {msg}", file=sys.stderr)
    raise Fatal(msg, code)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_case(n, d, v, dtype, seed, with_bias, ignore_frac, peaked_rows, device):
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, device=device)
    hidden[:peaked_rows] *= 6.0  # near-one-hot distributions: entropy ~ 0, p_y ~ 1
    weight = torch.randn(v, d, generator=g, device=device) * (3.0 / d ** 0.5)  # logits ~ N(0, 9)
    labels = torch.randint(0, v, (n,), generator=g, device=device)
    n_ign = max(1, int(ignore_frac * n))
    ignored = torch.randperm(n, generator=g, device=device)[:n_ign]
    ignored = ignored[ignored >= peaked_rows]
    labels[ignored] = IGNORE
    bias = None
    if with_bias:  # every logit negative: |h.W| stays below ~100 even on the peaked (x6) rows
        bias = (-150.0 + 0.5 * torch.randn(v, generator=g, device=device)).to(dtype)
    up_g = torch.randn(n, generator=g, device=device)
    up_e = torch.randn(n, generator=g, device=device)
    return hidden.to(dtype), weight.to(dtype), labels, bias, up_g, up_e


def pick_subsets(labels, v, n_rows, n_vocab, peaked_rows, seed, device):
    n = labels.shape[0]
    g = torch.Generator(device=device).manual_seed(seed + 1)
    ignored = (labels == IGNORE).nonzero().flatten()
    rows = torch.cat([torch.arange(min(peaked_rows, n), device=device), ignored[:8],
                      torch.randperm(n, generator=g, device=device)[:n_rows]])
    valid_labels = labels[labels != IGNORE]
    cols = torch.cat([torch.arange(min(32, v), device=device), torch.arange(max(0, v - 64), v, device=device),
                      valid_labels[:n_vocab // 4],
                      torch.randperm(v, generator=g, device=device)[:n_vocab]])
    return torch.unique(rows), torch.unique(cols)


def reference(hidden, weight, bias, labels, temperature, up_g, up_e, rows, cols, chunk):
    """float64 logprob/entropy (all rows) and gradients (rows / cols subsets, bias in full)."""
    n, v = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    w64 = weight.double()
    b64 = None if bias is None else bias.double()
    valid = labels != IGNORE
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    lp = torch.zeros(n, dtype=torch.float64, device=dev)
    ent = torch.zeros(n, dtype=torch.float64, device=dev)
    dh = torch.zeros(rows.numel(), hidden.shape[1], dtype=torch.float64, device=dev)
    dw = torch.zeros(cols.numel(), hidden.shape[1], dtype=torch.float64, device=dev)
    db = torch.zeros(v, dtype=torch.float64, device=dev) if bias is not None else None
    row_pos = torch.full((n,), -1, dtype=torch.long, device=dev)
    row_pos[rows] = torch.arange(rows.numel(), device=dev)
    for r0 in range(0, n, chunk):
        sl = slice(r0, min(n, r0 + chunk))
        h64 = hidden[sl].double()
        z = h64 @ w64.T
        if b64 is not None:
            z += b64
        z /= temperature
        logp = z - torch.logsumexp(z, dim=1, keepdim=True)
        del z
        p = logp.exp()
        vmask = valid[sl].double()
        h_row = -(p * logp).sum(1)
        lp_row = logp.gather(1, safe[sl, None]).squeeze(1)
        lp[sl] = lp_row * vmask
        ent[sl] = h_row * vmask
        g, e = up_g[sl].double() * vmask, up_e[sl].double() * vmask
        # dz_v = g (1[v=y] - p_v) - e p_v (log p_v + H)
        dz = -(g[:, None] * p) - e[:, None] * p * (logp + h_row[:, None])
        del p, logp
        dz.scatter_add_(1, safe[sl, None], g[:, None])
        dz /= temperature
        pos = row_pos[sl]
        sel = (pos >= 0).nonzero().flatten()
        if sel.numel():
            dh[pos[sel]] = dz[sel] @ w64
        dw += dz[:, cols].T @ h64
        if db is not None:
            db += dz.sum(0)
        del dz
    return lp, ent, dh, dw, db


def naive_forward(hidden, weight, bias, labels, temperature):
    logits = (hidden @ weight.T).float()
    if bias is not None:
        logits = logits + bias.float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    valid = labels != IGNORE
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    lp = logp.gather(-1, safe[:, None]).squeeze(-1) * valid
    ent = -(logp.exp() * logp).sum(-1) * valid
    return lp, ent


def errors(a, ref):
    a, ref = a.double(), ref.double()
    diff = (a - ref).abs()
    scale = ref.abs().max().item()
    return {"max_abs": diff.max().item(), "mean_abs": diff.mean().item(),
            "max_rel": diff.max().item() / scale if scale > 0 else float("nan"), "ref_max_abs": scale}


def run_impl(impl, hidden, weight, bias, labels, temperature, up_g, up_e):
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    b = None if bias is None else bias.detach().clone().requires_grad_(True)
    _sync()
    t0 = time.perf_counter()
    if impl == "naive":
        lp, ent = naive_forward(h, w, b, labels, temperature)
    else:
        from fastcov import linear_logprob_entropy

        out = linear_logprob_entropy(h, w, labels, bias=b, temperature=temperature,
                                     ignore_index=IGNORE, entropy=True, impl=impl)
        lp, ent = out.logprob, out.entropy
    loss = (up_g * lp.float()).sum() + (up_e * ent.float()).sum()
    grads = torch.autograd.grad(loss, [x for x in (h, w, b) if x is not None])
    _sync()
    secs = time.perf_counter() - t0
    dh, dw = grads[0], grads[1]
    db = grads[2] if b is not None else None
    return lp.detach(), ent.detach(), dh, dw, db, secs


@dataclass
class Case:
    """One case: its bf16 inputs, the hidden / vocabulary rows whose gradients are compared, and the
    float64 reference (logprob, entropy, dL/dhidden[rows], dL/dweight[cols], dL/dbias)."""

    temperature: float
    with_bias: bool
    hidden: torch.Tensor
    weight: torch.Tensor
    labels: torch.Tensor
    bias: torch.Tensor | None
    up_g: torch.Tensor
    up_e: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    ref: tuple

    @property
    def bias_name(self) -> str | None:
        return "all-negative" if self.with_bias else None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.correctness_gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--d", type=int, default=3584)
    p.add_argument("--v", type=int, default=152064)
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--impls", nargs="+", default=["triton", "torch", "naive"],
                   help="fastcov impls (triton, torch, auto) and/or naive (baseline, no tolerance)")
    p.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.6])
    p.add_argument("--no-bias-case", action="store_true", help="skip the all-negative-logits bias case")
    p.add_argument("--rows", type=int, default=512, help="random hidden rows whose gradient is compared")
    p.add_argument("--vocab-rows", type=int, default=2048, help="random weight rows whose gradient is compared")
    p.add_argument("--peaked-rows", type=int, default=16)
    p.add_argument("--ignore-frac", type=float, default=0.01)
    p.add_argument("--chunk", type=int, default=512, help="tokens per float64 reference chunk")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results", help="folder for the JSON (default bench/results)")
    return p.parse_args(argv)


def check_environment(impls) -> None:
    """Exit 2 with a message unless there is a CUDA device and, for fastcov impls, fastcov imports."""
    if not torch.cuda.is_available():
        die("needs a CUDA device (bf16 Triton kernels at Qwen2.5-7B shapes) and torch.cuda.is_available() "
            f"is False here (torch {torch.__version__}). Run it on a GPU machine; on CPU, "
            "`python -m pytest tests/` covers the torch and interpreted Triton paths.")
    if any(i != "naive" for i in impls):
        try:
            import fastcov  # noqa: F401
            from fastcov import linear_logprob_entropy  # noqa: F401
        except ImportError as exc:
            die(f"cannot import fastcov.linear_logprob_entropy: {exc}")


def report_header(args, argv, name: str) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"device": name, "torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda,
            "shape": {"n": args.n, "d": args.d, "v": args.v, "dtype": args.dtype},
            "command": "python -m bench.correctness_gpu " + " ".join(sys.argv[1:] if argv is None else argv),
            "tolerances": TOLERANCES, "cases": []}


def build_case(args, ci: int, temperature: float, with_bias: bool, dtype, device) -> Case:
    """Case number ``ci``'s inputs and its float64 reference (timed and printed)."""
    hidden, weight, labels, bias, up_g, up_e = make_case(
        args.n, args.d, args.v, dtype, args.seed + ci, with_bias, args.ignore_frac, args.peaked_rows, device)
    rows, cols = pick_subsets(labels, args.v, args.rows, args.vocab_rows, args.peaked_rows, args.seed, device)
    t0 = time.perf_counter()
    ref = reference(hidden, weight, bias, labels, temperature, up_g, up_e, rows, cols, args.chunk)
    _sync()
    print(f"case T={temperature} bias={'all-negative' if with_bias else 'none'}: float64 reference "
          f"in {time.perf_counter() - t0:.1f} s ({rows.numel()} hidden rows, {cols.numel()} vocab rows)")
    return Case(temperature, with_bias, hidden, weight, labels, bias, up_g, up_e, rows, cols, ref)


def invariants(lp, ent, dh, dw, valid) -> dict:
    return {
        "logprob_max_valid": lp[valid].max().item(),
        "logprob_le_0": bool((lp[valid] <= 0).all()),
        "finite": bool(torch.isfinite(lp).all() and torch.isfinite(ent).all()
                       and torch.isfinite(dh).all() and torch.isfinite(dw).all()),
        "ignored_rows_zero": bool((lp[~valid] == 0).all() and (ent[~valid] == 0).all()
                                  and (dh[~valid] == 0).all()),
    }


def failures(m: dict, inv: dict) -> list[str]:
    """The tolerances and invariants a fastcov implementation misses."""
    fails = []
    for key, tol in TOLERANCES.items():
        q, stat = key.rsplit("_max_", 1)
        if q in m and not m[q][f"max_{stat}"] <= tol:
            fails.append(f"{key} {m[q][f'max_{stat}']:.2e} > {tol:.0e}")
    return fails + [k for k in ("logprob_le_0", "finite", "ignored_rows_zero") if not inv[k]]


def check_impl(impl: str, case: Case) -> dict:
    """Run ``impl`` on the case, compare it with the reference and print one line: the report's entry."""
    entry = {"impl": impl, "temperature": case.temperature, "bias": case.bias_name,
             "baseline_only": impl == "naive"}
    try:
        lp, ent, dh, dw, db, secs = run_impl(impl, case.hidden, case.weight, case.bias, case.labels,
                                             case.temperature, case.up_g, case.up_e)
    except torch.OutOfMemoryError as exc:
        entry.update(status="OOM", reason=str(exc).splitlines()[0])
        print(f"  {impl:<7} OOM")
        torch.cuda.empty_cache()
        return entry
    ref_lp, ref_ent, ref_dh, ref_dw, ref_db = case.ref
    m = {"logprob": errors(lp, ref_lp), "entropy": errors(ent, ref_ent),
         "dhidden": errors(dh[case.rows], ref_dh), "dweight": errors(dw[case.cols], ref_dw)}
    if db is not None:
        m["dbias"] = errors(db, ref_db)
    inv = invariants(lp, ent, dh, dw, case.labels != IGNORE)
    fails = failures(m, inv) if impl != "naive" else []
    entry.update(status="ok", seconds_fwd_bwd=secs, errors=m, invariants=inv,
                 passed=not fails if impl != "naive" else None, failures=fails)
    verdict = "baseline" if impl == "naive" else ("PASS" if not fails else "FAIL: " + "; ".join(fails))
    print(f"  {impl:<7} logp {m['logprob']['max_abs']:.2e}  H {m['entropy']['max_abs']:.2e}  "
          f"dh rel {m['dhidden']['max_rel']:.2e}  dW rel {m['dweight']['max_rel']:.2e}"
          + (f"  db rel {m['dbias']['max_rel']:.2e}" if "dbias" in m else "")
          + f"  max logp {inv['logprob_max_valid']:.2e}  ({secs:.2f} s)  {verdict}")
    return entry


def write_report(report: dict, out: Path, name: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    while "--" in slug:
        slug = slug.replace("--", "-")
    path = out / f"correctness-{slug}-{_dt.date.today().isoformat()}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    check_environment(args.impls)
    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name(device)
    report = report_header(args, argv, name)
    ok_all = True
    cases = [(t, False) for t in args.temperatures]
    if not args.no_bias_case:
        cases.append((args.temperatures[-1], True))
    print(f"{name}: N={args.n} D={args.d} V={args.v} {args.dtype}; impls {args.impls}")
    for ci, (temperature, with_bias) in enumerate(cases):
        case = build_case(args, ci, temperature, with_bias, dtype, device)
        for impl in args.impls:
            entry = check_impl(impl, case)
            report["cases"].append(entry)
            ok_all = ok_all and not entry.get("failures")
            torch.cuda.empty_cache()  # check_impl's outputs are gone with it
        del case
        torch.cuda.empty_cache()
    report["passed"] = ok_all
    path = write_report(report, Path(args.out), name)
    print(f"{'PASS' if ok_all else 'FAIL'}; wrote {path}")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())

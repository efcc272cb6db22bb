"""Smoke test of the kernel benchmark harness (bench/kernels/): a tiny CPU case end to end."""

from __future__ import annotations

import json

import pytest
import torch

from bench import kernels as K
from bench.kernels import case as KC
from bench.kernels import measure as KM
from bench.peers import IMPLS, naive

PEERS = ["liger", "liger-entropy", "cce", "verl"]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    rc = K.main(["--preset", "smoke", "--device", "cpu", "--n", "48", "--d", "32", "--v", "300",
                 "--repeats", "1", "--warmup", "0", "--threads", "1", "--out", str(out),
                 "--impls", "naive", "fastcov-torch", *PEERS])
    assert rc == 0
    jsons, mds = list(out.glob("*.json")), list(out.glob("*.md"))
    assert len(jsons) == 1 and len(mds) == 1
    assert jsons[0].stem == mds[0].stem and jsons[0].stem.startswith("cpu-")
    return json.loads(jsons[0].read_text()), mds[0].read_text()


def test_json_fields(smoke_run):
    doc, _ = smoke_run
    assert doc["schema"] == 1 and doc["device_slug"].startswith("cpu-")
    (run,) = doc["runs"]
    assert run["preset"] == "smoke" and "bench.kernels" in run["command"]
    assert {"torch", "triton", "device_name"} <= set(run["env"])
    assert run["matmul"]["smoke/48"]["tflops"] > 0
    cases = {c["impl"]: c for c in run["cases"]}
    assert set(cases) == {"naive", "fastcov-torch", *PEERS}
    for name in ("naive", "fastcov-torch"):
        c = cases[name]
        assert c["status"] == "ok", c
        assert (c["n"], c["d"], c["v"]) == (48, 32, 300)
        for key in ("fwd_ms", "fb_ms", "fwd_tflops", "fb_tflops", "fwd_pct_matmul", "fb_pct_matmul",
                    "speedup_fwd", "speedup_fb"):
            assert c[key] is not None and c[key] > 0, (name, key)
        assert c["fb_peak_bytes"] is not None and c["fb_peak_bytes"] > 0
        assert c["mem_ratio_fb"] is not None and c["mem_method"]
        assert c["check"]["logprob_max_abs"] < 1e-4 and c["check"]["entropy_max_abs"] < 1e-4
        assert c["check"]["logprob_max"] <= 0 and c["check"]["finite"]
    assert cases["naive"]["speedup_fb"] == pytest.approx(1.0)
    assert cases["naive"]["mem_ratio_fb"] == pytest.approx(1.0)


def test_peers_unavailable_without_cuda(smoke_run):
    if torch.cuda.is_available():
        pytest.skip("peers may run here")
    doc, md = smoke_run
    cases = {c["impl"]: c for c in doc["runs"][0]["cases"]}
    for name in PEERS:
        assert cases[name]["status"] == "unavailable" and cases[name]["reason"], cases[name]
        assert f"| {name} | unavailable: " in md


def test_markdown_table(smoke_run):
    doc, md = smoke_run
    assert doc["device_name"] in md and "torch " in md and "triton " in md
    assert "python -m bench.kernels" in md
    assert "| N | impl | fwd ms |" in md
    assert "| 48 | fastcov-torch | " in md


def test_rerun_keeps_other_presets(tmp_path):
    run_a = {"preset": "a", "cases": [], "groups": [], "matmul": {}, "env": {}, "dtype": "float32",
             "temperature": 1.0, "isolated": False, "command": "x", "started": "t", "wall_s": 0.0}
    env = {"device_slug": "cpu-test", "device_name": "CPU test"}
    K.write_results(run_a, tmp_path, env, "2000-01-01")
    K.write_results({**run_a, "preset": "b"}, tmp_path, env, "2000-01-01")
    K.write_results({**run_a, "preset": "a", "wall_s": 1.0}, tmp_path, env, "2000-01-01")
    doc = json.loads((tmp_path / "cpu-test-2000-01-01.json").read_text())
    assert sorted(r["preset"] for r in doc["runs"]) == ["a", "b"]
    assert [r["wall_s"] for r in doc["runs"] if r["preset"] == "a"] == [1.0]


def test_failing_impl_is_reported_not_raised(monkeypatch):
    def broken(device):
        def fn(hidden, weight, labels, temperature):
            raise RuntimeError("kernel exploded")
        return fn

    monkeypatch.setitem(IMPLS, "naive", IMPLS["naive"].__class__(
        "naive", "broken", True, lambda d: None, broken, needs_cuda=False))
    spec = K.CaseSpec(group="g", n=8, d=16, v=40, dtype="float32", device="cpu", temperature=1.0, warmup=0,
                      repeats=1, seed=0, impls=("naive",), mode="all")
    (res,) = K.run_shape(spec)["cases"]
    assert res["status"] == "error" and "kernel exploded" in res["reason"]


def test_naive_matches_float64():
    torch.manual_seed(0)
    h, w = torch.randn(6, 8), torch.randn(50, 8)
    y = torch.randint(0, 50, (6,))
    lp, ent = naive(h, w, y, 0.7)
    ref_lp, ref_ent = KC._reference_rows(h, w, y, 0.7, 6)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)


def test_correctness_gpu_needs_cuda(capsys):
    from bench import correctness_gpu as C

    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    with pytest.raises(SystemExit) as exc:
        C.main([])
    assert exc.value.code == 2
    assert "needs a CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("temperature,with_bias", [(1.0, False), (0.6, True)])
def test_correctness_gpu_reference_matches_autograd(temperature, with_bias):
    """The chunked float64 reference of bench/correctness_gpu.py equals float64 autograd (on CPU)."""
    from bench import correctness_gpu as C

    cpu = torch.device("cpu")
    h, w, y, b, g, e = C.make_case(40, 16, 90, torch.bfloat16, 0, with_bias, 0.1, 4, cpu)
    rows, cols = C.pick_subsets(y, 90, 10, 20, 4, 0, cpu)
    lp, ent, dh, dw, db = C.reference(h, w, b, y, temperature, g, e, rows, cols, chunk=16)
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    b64 = None if b is None else b.double().requires_grad_()
    z = (h64 @ w64.T + (0 if b64 is None else b64)) / temperature
    logp = torch.log_softmax(z, -1)
    valid = y != C.IGNORE
    ref_lp = logp.gather(1, torch.where(valid, y, 0)[:, None]).squeeze(1) * valid
    ref_ent = -(logp.exp() * logp).sum(1) * valid
    loss = (g.double() * ref_lp).sum() + (e.double() * ref_ent).sum()
    grads = torch.autograd.grad(loss, [x for x in (h64, w64, b64) if x is not None])
    for got, want in [(lp, ref_lp), (ent, ref_ent), (dh, grads[0][rows]), (dw, grads[1][cols])]:
        torch.testing.assert_close(got, want.detach(), atol=1e-10, rtol=1e-10)
    if with_bias:
        torch.testing.assert_close(db, grads[2], atol=1e-10, rtol=1e-10)
        assert (z.detach() < 0).all()


# ---------------------------------------------------------------- the h100 preset, end to end at a tiny size


@pytest.fixture(scope="module")
def h100_tiny(tmp_path_factory):
    """The GPU preset on CPU at N 16, D 32, V 100 (fp32; fastcov-triton under the interpreter), all
    in one process, so the first GPU run exercises code that has run before."""
    out = tmp_path_factory.mktemp("bench-h100")
    rc = K.main(["--preset", "h100", "--device", "cpu", "--dtype", "float32", "--n", "16", "--d", "32",
                 "--v", "100", "--repeats", "1", "--warmup", "0", "--isolate", "never", "--out", str(out)])
    assert rc == 0
    (lines,) = list(out.glob("*/kernels-*.jsonl"))
    return lines, K.read_jsonl(lines)


def test_h100_preset_writes_one_json_line_per_case(h100_tiny):
    path, rows = h100_tiny
    impls = K.PRESETS["h100"]["impls"]
    groups = [g["name"] for g in K.PRESETS["h100"]["groups"]]
    assert {"naive", "naive-compile", "fastcov-triton", "liger", "verl"} <= set(impls)
    assert sorted((r["group"], r["impl"]) for r in rows) == sorted((g, i) for g in groups for i in impls)
    for r in rows:
        assert r["preset"] == "h100" and r["device"] and r["torch"] and "bench.kernels" in r["command"]
        assert r["floor_fb_ms"] > 0 and r["floor_fwd_ms"] > 0
    by_impl = {r["impl"]: r for r in rows if r["group"] == groups[0]}
    if KM._probe("fastcov-triton", torch.device("cpu"), False) is None:  # TRITON_INTERPRET=1 (tests/conftest.py)
        assert by_impl["fastcov-triton"]["status"] == "ok", by_impl["fastcov-triton"]
    for name in ("naive", "naive-compile", "fastcov-triton"):
        r = by_impl[name]
        if r["status"] != "ok":
            continue
        for key in ("fwd_ms", "fb_ms", "fwd_pct_floor", "fb_pct_floor", "fb_peak_bytes", "speedup_fb"):
            assert r[key] is not None and r[key] > 0, (name, key)
        assert r["check"]["logprob_max_abs"] < 1e-4 and r["check"]["entropy_max_abs"] < 1e-4
    md = path.with_suffix(".md").read_text()
    assert "| N | impl | fwd ms |" in md and "% of floor" in md and "cuBLAS floor: N 16" in md


def test_jsonl_survives_a_torn_last_line_and_renders(tmp_path, h100_tiny):
    path, rows = h100_tiny
    torn = tmp_path / "kernels.jsonl"
    torn.write_text(path.read_text() + '{"preset": "h100", "gro')  # a run killed mid-write
    assert K.read_jsonl(torn) == rows
    assert K.main(["--render", str(torn)]) == 0
    assert "| 16 | naive |" in (tmp_path / "kernels.md").read_text()
    assert K.main(["--render", str(tmp_path / "missing.jsonl")]) == 2


def test_cublas_floor_chain_does_the_four_gemms():
    """The floor closure really computes dW = Zᵀ·H over chunks (with Z = H·Wᵀ): it is not an empty loop."""
    torch.manual_seed(0)
    h, w = torch.randn(40, 8), torch.randn(30, 8)
    old = KC.FLOOR_CHUNK_BYTES
    try:
        KC.FLOOR_CHUNK_BYTES = 30 * 4 * 7  # chunks of 7 rows
        chain = K.floor_calls(h, w)
        assert chain["chunk"] == 7
        chain["fb"]()
    finally:
        KC.FLOOR_CHUNK_BYTES = old
    torch.testing.assert_close(chain["dw"], (h @ w.T).T @ h, atol=1e-4, rtol=1e-4)


def test_cce_torch_compile_is_a_cpu_peer_beside_the_logprob_only_twin():
    """Cut Cross-Entropy's torch_compile path runs on CPU, so it is not a CUDA-only peer; the twin asked for
    the same (log-probs only) returns no entropy, so the harness differentiates the same loss for both."""
    import importlib.util

    cce = IMPLS["cce-torch-compile"]
    assert not cce.needs_cuda and cce.compiles and not cce.entropy
    reason = cce.probe(torch.device("cpu"))
    assert (reason is None) == (importlib.util.find_spec("cut_cross_entropy") is not None)
    assert "cce-torch-compile" in K.PRESETS["cpu-cce"]["impls"]
    twin = IMPLS["fastcov-torch-logprob"]
    assert not twin.needs_cuda and not twin.entropy
    fn = twin.load(torch.device("cpu"))
    hidden, weight = torch.randn(6, 8), torch.randn(19, 8)
    labels = torch.randint(0, 19, (6,))
    logprob, entropy = fn(hidden, weight, labels, 0.8)
    assert entropy is None
    ref, _ = naive(hidden.double(), weight.double(), labels, 0.8)
    torch.testing.assert_close(logprob.double(), ref.double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("switch", ["sum-p2", "temperature", "softcap"])
def test_switch_rows_are_the_base_call_with_one_switch(switch):
    """The benchmark's switch rows give the base call's log-probs and entropies (the per-token temperature holds
    the scalar T; the cap 1e4 moves these logits by < 3e-5), so their float64 check stays meaningful."""
    from bench.peers import SWITCH_ROWS

    device = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 32, generator=g)
    weight = torch.randn(300, 32, generator=g) * (3.0 / 32 ** 0.5)
    labels = torch.randint(0, 300, (40,), generator=g)
    base = IMPLS["fastcov-torch"].load(device)(hidden, weight, labels, 0.7)
    row = IMPLS[f"fastcov-torch-{switch}"].load(device)(hidden, weight, labels, 0.7)
    for got, want in zip(row, base, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert switch in SWITCH_ROWS and IMPLS[f"fastcov-triton-{switch}"].needs_cuda


def test_gpu_run_switches_preset_holds_ligers_anchor_shape():
    """Issue 59's GPU shapes: the one-call GPU run's switch preset runs Liger's CuTe anchor shape (D 4096, V 131072,
    16K tokens) with every switch beside the base call and Liger's entropy-returning path."""
    from bench.kernels.presets import PRESETS

    preset = PRESETS["gpu-run-switches"]
    anchor = [g for g in preset["groups"] if (g["d"], g["v"]) == (4096, 131072)]
    assert anchor and 16384 in anchor[0]["ns"]
    impls = anchor[0].get("impls", preset["impls"])
    assert {"fastcov-triton", "liger-entropy"} <= set(impls)
    assert {f"fastcov-triton-{s}" for s in ("sum-p2", "temperature", "softcap")} <= set(impls)

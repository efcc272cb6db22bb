import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastcov.covariance import token_covariance, token_covariance_and_keys
from fastcov.kernels.covariance_torch import random_keys_torch

ODD_SHAPES = [(1, 1), (3, 7), (5, 13), (2, 1031), (7, 301)]  # 2·1031 and 7·301 span several 1024-blocks


def _reference(logprob, advantages, mask):
    """float64 loop reference of c_t = (A − Ā)(logp − mean logp), means over valid tokens."""
    cells = [(i, j) for i in range(mask.shape[0]) for j in range(mask.shape[1]) if mask[i, j]]
    out = torch.zeros(mask.shape, dtype=torch.float64)
    if not cells:
        return out
    mean_a = sum(float(advantages[c]) for c in cells) / len(cells)
    mean_l = sum(float(logprob[c]) for c in cells) / len(cells)
    for c in cells:
        out[c] = (float(advantages[c]) - mean_a) * (float(logprob[c]) - mean_l)
    return out


def _inputs(g, rows, cols, dtype=torch.float64):
    logprob = -4 * torch.rand(rows, cols, generator=g, dtype=dtype)
    advantages = torch.randn(rows, cols, generator=g, dtype=dtype)
    mask = torch.rand(rows, cols, generator=g) < 0.75
    if rows > 1:
        mask[1] = False
    return logprob, advantages, mask


@pytest.mark.parametrize("shape", ODD_SHAPES[:3] + [(4, 29)])
def test_matches_float64_reference(shape):
    g = torch.Generator().manual_seed(shape[0] * 100 + shape[1])
    logprob, advantages, mask = _inputs(g, *shape)
    cov = token_covariance(logprob, advantages, mask, impl="torch")
    assert cov.dtype == torch.float64 and cov.shape == shape
    torch.testing.assert_close(cov, _reference(logprob, advantages, mask), rtol=1e-12, atol=1e-12)
    assert (cov[~mask] == 0).all()


def test_float32_and_bfloat16_inputs_give_float32():
    g = torch.Generator().manual_seed(2)
    logprob, advantages, mask = _inputs(g, 4, 29)
    for dtype in (torch.float32, torch.bfloat16):
        lp, adv = logprob.to(dtype), advantages.to(dtype)
        cov = token_covariance(lp, adv, mask, impl="torch")
        assert cov.dtype == torch.float32
        torch.testing.assert_close(cov.double(), _reference(lp.double(), adv.double(), mask), rtol=1e-5, atol=1e-5)


def test_logprob_is_detached():
    g = torch.Generator().manual_seed(3)
    logprob, advantages, mask = _inputs(g, 3, 7)
    cov = token_covariance(logprob.requires_grad_(True), advantages, mask)
    assert not cov.requires_grad


def test_all_masked_gives_zeros():
    logprob = torch.full((3, 4), -1.0)
    cov = token_covariance(logprob, torch.ones(3, 4), torch.zeros(3, 4, dtype=torch.bool))
    assert torch.equal(cov, torch.zeros(3, 4))


def test_float_mask_equals_bool_mask():
    g = torch.Generator().manual_seed(4)
    logprob, advantages, mask = _inputs(g, 5, 13)
    torch.testing.assert_close(
        token_covariance(logprob, advantages, mask.double()), token_covariance(logprob, advantages, mask)
    )


def _triton_checks(device: str) -> None:
    """Triton kernel vs float64 reference and vs the PyTorch twin (covariance and keys)."""
    g = torch.Generator().manual_seed(11)
    seed = torch.tensor([2**61 + 987654321], dtype=torch.int64, device=device)
    for shape in ODD_SHAPES:
        for dtype in (torch.float32, torch.float64):
            logprob, advantages, mask = (t.to(device) for t in _inputs(g, *shape, dtype=dtype))
            cov, keys = token_covariance_and_keys(logprob, advantages, mask, seed=seed, impl="triton")
            twin_cov, twin_keys = token_covariance_and_keys(logprob, advantages, mask, seed=seed, impl="torch")
            assert cov.dtype == dtype and keys.dtype == torch.int64
            tol = 1e-12 if dtype == torch.float64 else 2e-6
            torch.testing.assert_close(cov, twin_cov, rtol=tol, atol=tol)
            reference = _reference(logprob.cpu().double(), advantages.cpu().double(), mask.cpu())
            torch.testing.assert_close(cov.cpu().double(), reference, rtol=tol * 10, atol=tol * 10)
            assert torch.equal(keys, twin_keys)
            position = torch.arange(mask.numel(), device=device).reshape(shape)
            assert torch.equal(keys, random_keys_torch(seed, position))
    # keys at global positions across the 2**32 boundary (the offset a later rank would have)
    from fastcov.kernels.covariance import covariance_and_keys_triton
    from fastcov.kernels.covariance_torch import covariance_and_keys_torch

    logprob, advantages, mask = (t.to(device) for t in _inputs(g, 3, 401, dtype=torch.float32))
    means = torch.tensor([0.1, -2.0], dtype=torch.float64, device=device)
    offset = torch.tensor(2**32 - 500, dtype=torch.int64, device=device)
    _, keys = covariance_and_keys_triton(advantages, logprob, mask, means, seed, offset)
    _, twin_keys = covariance_and_keys_torch(advantages, logprob, mask, means, seed, offset)
    assert torch.equal(keys, twin_keys)
    # all-masked input: zeros, no NaN
    cov = token_covariance(logprob, advantages, torch.zeros_like(mask), impl="triton")
    assert torch.equal(cov, torch.zeros_like(cov))


def test_triton_kernel_matches_reference_and_twin():
    if torch.cuda.is_available():
        _triton_checks("cuda")
        return
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        _triton_checks("cpu")
        return
    # TRITON_INTERPRET must be set before triton is imported: run the checks in a fresh interpreter.
    tests_dir = Path(__file__).resolve().parent
    code = f"import sys; sys.path.insert(0, {str(tests_dir)!r}); import test_covariance as t; t._triton_checks('cpu')"
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_impl_auto_uses_twin_on_cpu(monkeypatch):
    import fastcov.kernels.covariance as triton_impl

    def fail(*args, **kwargs):
        raise AssertionError("the Triton kernel must not run for CPU tensors with impl='auto'")

    monkeypatch.setattr(triton_impl, "masked_sums_triton", fail)
    g = torch.Generator().manual_seed(5)
    token_covariance(*_inputs(g, 3, 7), impl="auto")


def test_bad_arguments_raise_naming_them():
    logprob = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="advantages has shape"):
        token_covariance(logprob, torch.zeros(2, 4), mask)
    with pytest.raises(ValueError, match="mask has shape"):
        token_covariance(logprob, torch.zeros(2, 3), torch.ones(3, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="advantages is on meta"):
        token_covariance(logprob, torch.zeros(2, 3, device="meta"), mask)
    with pytest.raises(TypeError, match="logprob must be a floating tensor"):
        token_covariance(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3), mask)
    with pytest.raises(TypeError, match="advantages must be a torch.Tensor"):
        token_covariance(logprob, [[0.0] * 3] * 2, mask)
    with pytest.raises(ValueError, match="impl must be one of"):
        token_covariance(logprob, torch.zeros(2, 3), mask, impl="cuda")

import os

import pytest
import torch

# The Triton kernels run on CPU tensors through the interpreter when there is no GPU. Set before
# triton is imported anywhere.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# DeepSpeed picks its accelerator when first imported; the tests run it on CPU unless the caller chose another.
# Set once here for every room (subprocess drivers that skip conftest set their own).
os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture(autouse=True)
def _restore_the_environment():
    """In-process training sets MASTER_PORT/RANK/... in os.environ: a later test that launches its own
    training processes would inherit that (busy) rendezvous. Every test gets the environment back as it
    found it. (The gloo group stays: DeepSpeed keeps using it in later in-process runs.)"""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _torch_process_state() -> dict:
    return {"num_threads": torch.get_num_threads(), "default_dtype": torch.get_default_dtype(),
            "grad_enabled": torch.is_grad_enabled(), "anomaly": torch.is_anomaly_enabled(),
            "deterministic": (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled()),
            "matmul_precision": torch.get_float32_matmul_precision()}


def _set_torch_process_state(state: dict) -> None:
    torch.set_num_threads(state["num_threads"])
    torch.set_default_dtype(state["default_dtype"])
    torch.set_grad_enabled(state["grad_enabled"])
    torch.set_anomaly_enabled(state["anomaly"])
    torch.use_deterministic_algorithms(state["deterministic"][0], warn_only=state["deterministic"][1])
    torch.set_float32_matmul_precision(state["matmul_precision"])


# Taken when this file is imported, before any test module is: a module that sets a thread count at import, or a
# bench main run in-process, would otherwise decide the rounding of every later test (issue 52: a TRL comparison
# passed alone and failed after the benchmarks, which left torch at one thread).
_TORCH_BASELINE = _torch_process_state()


@pytest.fixture(autouse=True)
def _same_torch_state_for_every_test():
    """Every test starts from the session's torch state (intra-op threads, default dtype, grad mode, anomaly
    detection, deterministic algorithms, fp32 matmul precision) and whatever it changes is put back after it, so
    a result never depends on which tests ran before."""
    _set_torch_process_state(_TORCH_BASELINE)
    yield
    _set_torch_process_state(_TORCH_BASELINE)

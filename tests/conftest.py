import os

import pytest
import torch

# The Triton kernels run on CPU tensors through the interpreter when there is no GPU. Set before
# triton is imported anywhere.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _restore_the_environment():
    """In-process training sets MASTER_PORT/RANK/... in os.environ: a later test that launches its own
    training processes would inherit that (busy) rendezvous. Every test gets the environment back as it
    found it. (The gloo group stays: DeepSpeed keeps using it in later in-process runs.)"""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)

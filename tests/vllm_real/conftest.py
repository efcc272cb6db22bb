"""Real-vLLM tests (``make test-vllm``, environment .venv-vllm with vLLM's CPU build): vLLM must be there, and
nothing may be skipped. A missing vLLM fails the run instead of skipping it, so CI cannot pass without it.
They are collected only when ``FASTCOV_VLLM_REAL=1`` (make test-vllm sets it): ``make test`` runs in .venv,
which has no vLLM, and leaves this directory to its own target."""

from __future__ import annotations

import os

import pytest

_skipped: list[str] = []


def pytest_ignore_collect(collection_path, config):
    if os.environ.get("FASTCOV_VLLM_REAL") != "1":
        return True
    return None


@pytest.fixture(scope="session", autouse=True)
def real_vllm():
    try:
        import vllm
    except ImportError as exc:
        pytest.fail(f"make test-vllm needs vLLM in this environment (make creates .venv-vllm): {exc}",
                    pytrace=False)
    return vllm


def pytest_runtest_logreport(report):
    if report.skipped:
        _skipped.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    if _skipped and session.exitstatus == 0:
        print(f"\nmake test-vllm: {len(_skipped)} test(s) skipped, which this group does not allow: {_skipped}")
        session.exitstatus = 1

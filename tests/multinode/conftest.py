"""tests/multinode: two hosts on this machine (``_hosts.py``), collected only when ``FASTCOV_MULTINODE=1``
(``make test-multinode`` sets it; it needs root, and fails rather than skips without it)."""

from __future__ import annotations

import os

import pytest
from _hosts import hosts_made


def pytest_ignore_collect(collection_path, config):
    if os.environ.get("FASTCOV_MULTINODE") != "1":
        return True
    return None


@pytest.fixture
def two_hosts(tmp_path):
    """Two hosts, torn down (processes, namespaces, veth) when the test ends, however it ends."""
    with hosts_made(tmp_path) as hosts:
        yield hosts

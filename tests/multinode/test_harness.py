"""The two-host harness cleans up after a failing test: no namespace, veth or process of it is left."""

from __future__ import annotations

import subprocess
import time

import pytest
from _hosts import PREFIX, hosts_made


def _ours() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [ln.split()[0] for ln in out.splitlines() if ln.startswith(PREFIX)]


def test_everything_made_is_removed_when_a_test_fails(tmp_path):
    with pytest.raises(RuntimeError, match="the test failed"), hosts_made(tmp_path) as hosts:
        assert sorted(_ours()) == sorted([hosts.a.ns, hosts.b.ns])
        sleepers = [hosts.spawn(h, ["sleep", "600"]) for h in (hosts.a, hosts.b)]
        time.sleep(0.5)
        names = [subprocess.run(["ip", "netns", "exec", h.ns, "ip", "-o", "addr"], capture_output=True,
                                text=True, timeout=30).stdout for h in (hosts.a, hosts.b)]
        assert "10.231.0.1/24" in names[0] and "10.231.0.2/24" in names[1]
        for h in (hosts.a, hosts.b):  # no route out: nothing a test runs can reach another address
            routes = subprocess.run(["ip", "-n", h.ns, "route"], capture_output=True, text=True, timeout=30).stdout
            assert [r.split()[0] for r in routes.splitlines()] == ["10.231.0.0/24"], routes
        assert all(s.proc.poll() is None for s in sleepers)
        raise RuntimeError("the test failed")
    assert _ours() == []
    assert all(s.proc.poll() is not None for s in sleepers)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=30).stdout
    assert hosts.a.ifname not in links and hosts.b.ifname not in links

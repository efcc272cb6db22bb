"""A collective that fails because a peer went away becomes one line naming the peer (``lost_peer``) and,
in the loop, the last intact checkpoint (``LostRankError``); any other error passes through unchanged.
tests/multinode kills and freezes a real host."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fastcov.trainer.runtime import distributed

CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
          "[10.231.0.3]:23426. This is typically caused by a remote worker crashing. Check the logs.")
TIMEOUT = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms"


@pytest.fixture
def peers(monkeypatch):
    table = [("a", "10.231.0.1"), ("b", "10.231.0.2"), ("c", "10.231.0.3")]
    monkeypatch.setattr(distributed, "PEERS", table)
    return table


def test_the_peer_is_named_from_its_address(peers):
    assert distributed.lost_peer(RuntimeError(CLOSED), 0) == (
        "rank 2 (host c, 10.231.0.3): Connection closed by peer [10.231.0.3]:23426")


def test_a_timeout_names_the_candidates(peers, monkeypatch):
    assert distributed.lost_peer(RuntimeError(TIMEOUT), 1).startswith("one of ranks 0, 2: Timed out waiting")
    monkeypatch.setattr(distributed, "PEERS", peers[:2])
    assert distributed.lost_peer(RuntimeError(TIMEOUT), 0) == "rank 1 (host b, 10.231.0.2): Timed out waiting 5000ms"


def test_through_a_wrapping_error_and_not_for_others(peers):
    class RolloutError(RuntimeError):
        pass

    try:
        try:
            raise RuntimeError(CLOSED)
        except RuntimeError as exc:
            raise RolloutError("rollout engine failed at step 3") from exc
    except RolloutError as wrapped:
        assert distributed.lost_peer(wrapped, 0).startswith("rank 2 (host c")
    assert distributed.lost_peer(RuntimeError("CUDA out of memory"), 0) is None
    assert distributed.lost_peer(ValueError(CLOSED), 0) is None


def test_the_loop_turns_it_into_one_line_with_the_checkpoint(peers, tmp_path):
    from fastcov.trainer.runtime import errors as errors_mod

    ckpt = tmp_path / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{}")
    run = SimpleNamespace(rank=0, step=3, ckpt_root=tmp_path / "checkpoints")
    with pytest.raises(errors_mod.LostRankError) as info, errors_mod.lost_rank_exit(run):
        raise RuntimeError(CLOSED)
    line = str(info.value)
    assert "\n" not in line and info.value.exit_code == 1
    assert line.startswith("lost rank 2 (host c, 10.231.0.3)") and "(at step 3)" in line
    assert f"the last intact checkpoint is {ckpt};" in line and line.endswith("--resume")
    with pytest.raises(RuntimeError, match="something else"), errors_mod.lost_rank_exit(run):
        raise RuntimeError("something else")

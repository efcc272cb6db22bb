"""What the trainer's tests share (plain helpers, also used by subprocess drivers, are in tests/_fixtures.py)."""

import pytest
from _fixtures import odd_length_reward


@pytest.fixture
def varied_rewards(monkeypatch):
    """An untrained model never answers right: reward odd-length responses so advantages are non-zero. A module
    whose every test trains asks for it with ``pytestmark = pytest.mark.usefixtures("varied_rewards")``."""
    from fastcov.trainer.rewards import RewardFn

    monkeypatch.setattr(RewardFn, "__call__", odd_length_reward)


@pytest.fixture(scope="module")
def hub():
    """A local stand-in of the Hugging Face Hub's HTTP API (tests/_hub.py) for one test module; point HF_ENDPOINT at
    its ``url``."""
    from _hub import HubStandIn

    with HubStandIn() as stand_in:
        yield stand_in

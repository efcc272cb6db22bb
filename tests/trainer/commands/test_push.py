"""`fastcov push RUN_DIR --repo ID` and `trainer.push_to_hub` through huggingface_hub, against a local stand-in of
the Hub's HTTP API (tests/_hub.py, the ``hub`` fixture of tests/trainer/conftest.py) that HF_ENDPOINT points at: no
network. What goes wrong is one line; the config checks the repo id. A run that uploads, and `fastcov push` of it:
tests/trainer/e2e/test_push_e2e.py."""

from __future__ import annotations

import pytest
from _fixtures import TINY
from _hub import HubStandIn, hub_env, run_fastcov


def test_what_goes_wrong_is_one_line(hub, tmp_path, capsys):
    model = tmp_path / "model"  # any model directory: these stop before or at the Hub
    model.mkdir()
    (model / "config.json").write_text("{}")
    env = hub_env(tmp_path / "hf", hub.url, token="hf_wrong")
    res = run_fastcov(env, "push", str(model), "--repo", "user/refused")
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith(f"fastcov push: the Hub at {hub.url} refused the upload to 'user/refused': "
                                 "HTTP 401: Invalid credentials in Authorization header (log in with `hf auth login`")
    assert "user/refused" not in hub.repos
    with HubStandIn() as gone:
        closed = gone.url  # a port nothing listens on any more
    res = run_fastcov(hub_env(tmp_path / "hf", closed), "push", str(model), "--repo", "user/x")
    assert res.returncode == 2 and res.stderr.startswith(f"fastcov push: cannot reach the Hub at {closed}"), res.stderr
    assert res.stderr.count("\n") == 1
    from fastcov.cli import main  # these two never reach huggingface_hub: in this process

    (tmp_path / "unfinished").mkdir()
    (tmp_path / "unfinished" / "config.yaml").write_text("{}")
    assert main(["push", str(tmp_path / "unfinished"), "--repo", "user/x"]) == 2
    assert "has no final/ yet" in capsys.readouterr().err
    assert main(["push", str(model), "--repo", "a/b/c"]) == 2
    assert "--repo: 'a/b/c' is not a Hub repo id" in capsys.readouterr().err


def test_push_to_hub_is_checked_with_the_config():
    from fastcov.trainer.config import ConfigError, load_config

    assert load_config(TINY, ["trainer.push_to_hub=me/model"]).trainer.push_to_hub == "me/model"
    with pytest.raises(ConfigError, match="trainer.push_to_hub: must be a Hub repo id"):
        load_config(TINY, ["trainer.push_to_hub=not a repo"])

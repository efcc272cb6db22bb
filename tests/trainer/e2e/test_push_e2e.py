"""`trainer.push_to_hub` at the end of a tiny run and `fastcov push RUN_DIR --repo ID` of it, through huggingface_hub,
against a local stand-in of the Hub's HTTP API (tests/_hub.py, the ``hub`` fixture of tests/trainer/conftest.py) that
HF_ENDPOINT points at: no network. Each command runs in its own process, as a user runs it, with HF_HOME in tmp_path
(huggingface_hub writes its caches there, not in the user's home). The errors: tests/trainer/commands/test_push.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from _fixtures import TINY
from _hub import hub_env, run_fastcov


@pytest.fixture(scope="module")
def pushed_run(hub, tmp_path_factory):
    """A tiny run whose trainer.push_to_hub uploaded final/ to user/tiny-run at its end."""
    tmp = tmp_path_factory.mktemp("push")
    run = tmp / "run"
    res = run_fastcov(hub_env(tmp / "hf", hub.url), "train", str(TINY), f"trainer.run_dir={run}",
                      "trainer.max_steps=1", "trainer.eval_every=0", "reward.sandbox=inline",
                      "trainer.push_to_hub=user/tiny-run", timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return run, tmp, res.stdout


def _final_files(run: Path) -> dict[str, bytes]:
    final = run / "final"
    return {f.relative_to(final).as_posix(): f.read_bytes() for f in final.rglob("*") if f.is_file()}


@pytest.mark.slow
def test_trainer_push_to_hub_uploads_final_at_the_end(hub, pushed_run):
    run, _, stdout = pushed_run
    repo = hub.repos["user/tiny-run"]
    for name, data in _final_files(run).items():
        assert repo[name] == data, name  # the model and tokenizer files, byte for byte
    assert repo["fastcov_config.yaml"] == (run / "config.yaml").read_bytes()
    assert "[fastcov] pushed final/ to user/tiny-run: " in stdout
    assert [c["repo"] for c in hub.commits].count("user/tiny-run") == 1  # one commit
    assert not hub.private["user/tiny-run"]


@pytest.mark.slow
def test_fastcov_push_a_run_directory(hub, pushed_run):
    run, tmp, _ = pushed_run
    res = run_fastcov(hub_env(tmp / "hf", hub.url), "push", str(run), "--repo", "user/tiny-cli", "--private",
                      "--message", "first upload")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"[fastcov] pushed {run} to user/tiny-cli: {hub.url}/user/tiny-cli/commit/")
    repo = hub.repos["user/tiny-cli"]
    assert {k: repo[k] for k in _final_files(run)} == _final_files(run) and hub.private["user/tiny-cli"]
    card = repo["README.md"].decode()
    front = yaml.safe_load(card.split("---")[1])
    assert front["tags"] == ["fastcov", "reinforcement-learning", "grpo", "clip_cov"]
    assert "`algo.mode: clip_cov`" in card and "1 step from `a fresh model (model.arch)`" in card and "| entropy | 1 |" in card
    assert hub.commits[-1]["summary"] == "first upload" and hub.cards[-1] == card  # its metadata checked too
    # again, into the repo that now exists, from the model directory itself (a run's final/)
    res = run_fastcov(hub_env(tmp / "hf", hub.url), "push", str(run / "final"), "--repo", "user/tiny-cli")
    assert res.returncode == 0, res.stderr
    assert hub.commits[-1] == {**hub.commits[-1], "repo": "user/tiny-cli", "summary": "fastcov: upload final"}

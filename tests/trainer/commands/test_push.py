"""`fastcov push RUN_DIR --repo ID` and `trainer.push_to_hub` through huggingface_hub, against a local stand-in of
the Hub's HTTP API (tests/_hub.py) that HF_ENDPOINT points at: no network. Each command runs in its own process, as
a user runs it, with HF_HOME in tmp_path (huggingface_hub writes its caches there, not in the user's home)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from _dist import without_rank_environment
from _fixtures import ROOT, TINY
from _hub import TOKEN, HubStandIn


def _env(home: Path, endpoint: str, token: str | None = TOKEN) -> dict[str, str]:
    env = without_rank_environment("FASTCOV_DEBUG", "HF_TOKEN", "HF_HUB_OFFLINE", "HF_ENDPOINT", "HF_HOME")
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(home), HF_HUB_DISABLE_TELEMETRY="1", DS_ACCELERATOR="cpu")
    if token is not None:
        env["HF_TOKEN"] = token
    return env


def _fastcov(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastcov", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def hub():
    with HubStandIn() as stand_in:
        yield stand_in


@pytest.fixture(scope="module")
def pushed_run(hub, tmp_path_factory):
    """A tiny run whose trainer.push_to_hub uploaded final/ to user/tiny-run at its end."""
    tmp = tmp_path_factory.mktemp("push")
    run = tmp / "run"
    res = _fastcov(_env(tmp / "hf", hub.url), "train", str(TINY), f"trainer.run_dir={run}", "trainer.max_steps=1",
                   "trainer.eval_every=0", "reward.sandbox=inline", "trainer.push_to_hub=user/tiny-run",
                   timeout=600)
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
    res = _fastcov(_env(tmp / "hf", hub.url), "push", str(run), "--repo", "user/tiny-cli", "--private",
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
    res = _fastcov(_env(tmp / "hf", hub.url), "push", str(run / "final"), "--repo", "user/tiny-cli")
    assert res.returncode == 0, res.stderr
    assert hub.commits[-1] == {**hub.commits[-1], "repo": "user/tiny-cli", "summary": "fastcov: upload final"}


def test_what_goes_wrong_is_one_line(hub, tmp_path, capsys):
    model = tmp_path / "model"  # any model directory: these stop before or at the Hub
    model.mkdir()
    (model / "config.json").write_text("{}")
    res = _fastcov(_env(tmp_path / "hf", hub.url, token="hf_wrong"), "push", str(model), "--repo", "user/refused")
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith(f"fastcov push: the Hub at {hub.url} refused the upload to 'user/refused': "
                                 "HTTP 401: Invalid credentials in Authorization header (log in with `hf auth login`")
    assert "user/refused" not in hub.repos
    with HubStandIn() as gone:
        closed = gone.url  # a port nothing listens on any more
    res = _fastcov(_env(tmp_path / "hf", closed), "push", str(model), "--repo", "user/x")
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

"""Reliability, second round (docs/reliability.md): one run per directory, no window that loses metrics,
crash-safe by default, I/O errors as one line. Each test fails without the promise it checks."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _dist import without_rank_environment
from _fixtures import ROOT, TINY

from fastcov.trainer.runtime.run_dir import RunDirBusy, RunDirLock, read_metrics, trim_metrics

BASE = ["reward.sandbox=inline", "trainer.eval_every=0", "trainer.max_steps=2"]


@pytest.fixture
def train_mod(varied_rewards):
    from fastcov.trainer import train as train_mod

    return train_mod


def _cli(run_dir: Path, *extra: str) -> list[str]:
    return ["train", str(TINY), f"trainer.run_dir={run_dir}", *BASE, *extra]


def _holder(run_dir: Path) -> subprocess.Popen:
    """Another process that holds ``run_dir``'s lock until killed."""
    code = ("import sys, time; from fastcov.trainer.runtime.run_dir import RunDirLock; "
            "lock = RunDirLock.acquire(sys.argv[1]); print('held', flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


# ------------------------------------------------------------------------------------ one run per directory

def test_a_second_run_into_a_held_directory_exits_2_naming_the_holder(tmp_path, capsys):
    from fastcov.cli import main

    run = tmp_path / "run"
    holder = _holder(run)
    try:
        for extra in ((), ("--resume",)):
            assert main(_cli(run, *extra)) == 2
            err = capsys.readouterr().err
            assert f"is in use by pid {holder.pid} on host " in err and len(err.strip().splitlines()) == 1, err
        assert sorted(p.name for p in run.iterdir()) == [".lock"]  # nothing written by the refused runs
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_left_by_a_dead_run_is_taken_over_once(tmp_path, capsys):
    run = tmp_path / "run"
    holder = _holder(run)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    lock = RunDirLock.acquire(run)
    assert f"the lock left by pid {holder.pid} on host" in capsys.readouterr().out
    probe = subprocess.run([sys.executable, "-c", "import sys; from fastcov.trainer.runtime.run_dir import "
                            "RunDirLock; RunDirLock.acquire(sys.argv[1])", str(run)], capture_output=True, text=True)
    last = probe.stderr.strip().splitlines()[-1]  # another process is refused while this one holds it
    assert probe.returncode == 1 and last.startswith(f"{RunDirBusy.__module__}.RunDirBusy: ") and \
        f"is in use by pid {os.getpid()} on host" in last, probe.stderr
    lock.release()
    assert (run / ".lock").read_bytes() == b""  # released cleanly: the next run has nothing to take over
    RunDirLock.acquire(run).release()
    assert "taken over" not in capsys.readouterr().out


def test_overwrite_then_a_user_error_lets_go_of_the_new_directory(tmp_path, train_mod, monkeypatch):
    """--overwrite moves the old run aside and locks the new directory; a user error after that must let go
    of the new lock (not the old one), so that the next run in the same process can take the directory."""
    from fastcov.errors import UserError
    from fastcov.trainer import start as start_mod
    from fastcov.trainer.config import load_config

    run = tmp_path / "run"
    cfg = load_config(TINY, [f"trainer.run_dir={run}", *BASE, "trainer.max_steps=1"])
    train_mod.train(cfg)
    real = start_mod.prepare_data
    monkeypatch.setattr(start_mod, "prepare_data", lambda *a: (_ for _ in ()).throw(UserError("data: broken")))
    with pytest.raises(UserError, match="data: broken"):
        train_mod.train(cfg, overwrite=True)
    monkeypatch.setattr(start_mod, "prepare_data", real)
    RunDirLock.acquire(run).release()  # free: a leaked lock of this process would refuse this (flock per fd)
    train_mod.train(cfg, overwrite=True)
    assert [r["step"] for r in read_metrics(run)] == [1]


def test_two_runs_started_together_one_trains_one_refuses(tmp_path):
    env = {**without_rank_environment(), "DS_ACCELERATOR": "cpu"}
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "fastcov.cli", *_cli(run, "trainer.max_steps=1")]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    codes = sorted(p.returncode for p in procs)
    errs = "\n".join(e for _, e in outs)
    assert codes == [0, 2], errs[-3000:]
    assert "is in use by pid" in errs or "already holds a run" in errs
    assert "Traceback" not in errs
    assert [r["step"] for r in read_metrics(run)] == [1]


# ------------------------------------------------------------------------------------ no window that loses data

KILL_IN_REWRITE = r'''
import os, signal, sys
from pathlib import Path
from fastcov.trainer.runtime import checkpoint
from fastcov.trainer.runtime.run_dir import trim_metrics
stage = sys.argv[2]
checkpoint.REWRITE_HOOKS.append(lambda path, at: at == stage and os.kill(os.getpid(), signal.SIGKILL))
trim_metrics(Path(sys.argv[1]), 3)
'''


@pytest.mark.parametrize("stage", ["written", "replaced"])
def test_a_kill_inside_the_metrics_rewrite_loses_nothing(tmp_path, stage):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "entropy": 1.0 / s} for s in range(1, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "entr')  # and a torn line
    proc = subprocess.run([sys.executable, "-c", KILL_IN_REWRITE, str(path), stage], capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    got = read_metrics(path)
    assert got == (rows if stage == "written" else rows[:3])  # the old file or the new one, whole
    assert trim_metrics(path, 3)["kept"] == 3 and read_metrics(path) == rows[:3]


def test_resuming_does_not_rewrite_metrics_again(tmp_path):
    from fastcov.trainer.runtime.run_log import MetricsLogger

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n')
    before = (path.read_bytes(), path.stat().st_ino, path.stat().st_mtime_ns)
    MetricsLogger(tmp_path, {}, resume_step=2).close()
    assert (path.read_bytes(), path.stat().st_ino, path.stat().st_mtime_ns) == before


# ------------------------------------------------------------------------------------ crash-safe by default

def test_resume_before_the_first_checkpoint_starts_again(tmp_path, train_mod, capsys):
    from fastcov.trainer.config import load_config

    run = tmp_path / "run"
    train_mod.train(load_config(TINY, [f"trainer.run_dir={run}", *BASE]))
    shutil.rmtree(run / "checkpoints")  # as if killed before its first checkpoint
    shutil.rmtree(run / "final")
    capsys.readouterr()
    train_mod.train(load_config(TINY, [f"trainer.run_dir={run}", *BASE]), resume=True)
    assert "has no checkpoint yet (the run stopped before its first); it starts from step 0" in \
        capsys.readouterr().out
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    assert (run / "final" / "config.json").is_file()


def test_resume_before_the_run_directory_existed_starts_fresh(tmp_path, train_mod, capsys):
    """A requeued job runs the same ``--resume`` after a kill before the run created its directory: it starts from
    step 0 and says so; ``--resume DIR`` naming a checkpoint that is not there still refuses."""
    from fastcov.trainer.config import load_config
    from fastcov.trainer.runtime.checkpoint import CheckpointError

    run = tmp_path / "never-started"
    train_mod.train(load_config(TINY, [f"trainer.run_dir={run}", *BASE]), resume=True)
    assert "holds no run yet (a first attempt stopped before it started); it starts from step 0" in \
        capsys.readouterr().out
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    with pytest.raises(CheckpointError, match="does not exist"):
        train_mod.train(load_config(TINY, [f"trainer.run_dir={tmp_path / 'other'}", *BASE]),
                        resume=str(tmp_path / "other" / "checkpoints" / "step_000001"))


def test_a_build_lock_is_taken_over_at_any_age_only_when_its_holder_is_gone(tmp_path, capsys):
    """torch's extension builder keeps ``<op>/lock`` open while it builds; every lock nobody holds open (its builder
    was killed), planted 0, 1, 2 or 600 s ago, is removed with one line naming it; a held one is left alone."""
    import time

    from fastcov.trainer.runtime.extensions import take_over_stale_locks

    ages = {"age0_op": 0, "age1_op": 1, "age2_op": 2, "age600_op": 600, "held_op": 600}
    locks = {name: tmp_path / name / "lock" for name in ages}
    for name, lock in locks.items():
        lock.parent.mkdir()
        lock.touch()
        os.utime(lock, (time.time() - ages[name], time.time() - ages[name]))
    held = locks.pop("held_op")
    holder = subprocess.Popen([sys.executable, "-c", "import os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); "
                               "print('open', flush=True); time.sleep(60)", str(held)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        assert take_over_stale_locks(tmp_path) == sorted(locks.values())
    finally:
        holder.kill()
        holder.wait()
    assert held.exists() and not any(lock.exists() for lock in locks.values())
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 4, lines
    for (name, lock), line in zip(sorted(locks.items()), lines, strict=True):
        assert f"removing the stale build lock {lock} (left {ages[name]}s ago" in line, line
    assert take_over_stale_locks(tmp_path) == [held]  # its holder is gone now


def test_the_take_over_line_comes_before_the_lock_goes(tmp_path, monkeypatch):
    """A run killed while it takes a lock over has said so already: the line is written before the unlink."""
    import io
    import time

    from fastcov.trainer.runtime import extensions

    lock = tmp_path / "op" / "lock"
    lock.parent.mkdir()
    lock.touch()
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(extensions.time, "sleep", lambda s: None)
    said_before = []
    real_unlink = Path.unlink

    def unlink(self, *a, **k):
        said_before.append(f"removing the stale build lock {self}" in err.getvalue())
        return real_unlink(self, *a, **k)

    monkeypatch.setattr(Path, "unlink", unlink)
    assert extensions.take_over_stale_locks(tmp_path, now=time.time()) == [lock]
    assert said_before == [True] and not lock.exists()


def test_a_lock_being_released_is_left_to_its_releaser(tmp_path, monkeypatch):
    """torch's builder closes its lock, then removes it. A look between the two sees an old lock no one holds; the
    take-over looks again a moment later and leaves a lock that is gone or is another file by then, so the
    builder's own remove still finds it (removing it under the builder crashed a rank of a 2-process test)."""
    import time

    from fastcov.trainer.runtime import extensions

    releasing, retaken, stale = (tmp_path / name / "lock" for name in ("releasing_op", "retaken_op", "stale_op"))
    for lock in (releasing, retaken, stale):
        lock.parent.mkdir()
        lock.touch()
        os.utime(lock, (time.time() - 60, time.time() - 60))
    looks_again = []

    def meanwhile(seconds):  # the recheck's pause: the builders finish their release (and one takes the lock again)
        looks_again.append(seconds)
        releasing.unlink()
        retaken.unlink()
        retaken.touch()

    monkeypatch.setattr(extensions.time, "sleep", meanwhile)
    assert extensions.take_over_stale_locks(tmp_path) == [stale]
    assert looks_again == [extensions.RECHECK_AFTER_S] and retaken.exists() and not stale.exists()
    monkeypatch.setattr(extensions.time, "sleep", looks_again.append)
    assert extensions.take_over_stale_locks(tmp_path) == [retaken]  # its taker was never seen holding it: stale
    assert extensions.take_over_stale_locks(tmp_path) == []  # nothing looks stale: no pause either
    assert looks_again == [extensions.RECHECK_AFTER_S] * 2


def test_build_locks_are_found_under_torchs_default_root_without_creating_folders(tmp_path, monkeypatch):
    """Without TORCH_EXTENSIONS_DIR the locks are looked for in every per-Python, per-accelerator folder of torch's
    default root, and looking creates nothing there."""
    import time

    import torch.utils.cpp_extension as cpp_extension

    from fastcov.trainer.runtime.extensions import extensions_roots, take_over_stale_locks

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(cpp_extension, "get_default_build_root", lambda: str(tmp_path))
    lock = tmp_path / "py311_cpu" / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    os.utime(lock, (time.time() - 60, time.time() - 60))
    before = sorted(p for p in tmp_path.rglob("*"))
    assert extensions_roots() == [tmp_path / "py311_cpu"]
    assert take_over_stale_locks() == [lock]
    assert sorted(p for p in tmp_path.rglob("*")) == [p for p in before if p != lock]


def test_build_locks_planted_just_before_a_run_are_each_taken_over_with_one_line(tmp_path):
    """Locks a killed builder left 0, 1, 2 and 600 s before the run starts (what a run killed during start-up a moment
    earlier leaves), and one stamped 600 s ahead (a file server whose clock runs ahead): the run takes each over with
    one line naming it, none stays, and it trains."""
    import time

    env = {**without_rank_environment(), "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    ages = {"deepspeed_shm_comm": 0, "cpu_adam": 1, "fused_adam": 2, "transformer_inference": 600, "skewed_op": -600}
    for op, age in ages.items():
        lock = tmp_path / "ext" / op / "lock"
        lock.parent.mkdir(parents=True)
        lock.touch()
        os.utime(lock, (time.time() - age, time.time() - age))
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "fastcov.cli", *_cli(run, "trainer.max_steps=1")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "stale build lock" in line]
    assert len(said) == len(ages), done.stderr[-3000:]
    for op in ages:
        assert sum(f"removing the stale build lock {tmp_path / 'ext' / op / 'lock'} (left " in ln for ln in said) == 1
    assert not list((tmp_path / "ext").glob("*/lock"))
    assert [r["step"] for r in read_metrics(run)] == [1]


def test_a_kill_during_start_up_never_hangs_the_next_run(tmp_path):
    """Runs SIGKILLed at moments through their start-up (imports, DeepSpeed and gloo, the model, the first rollout),
    with build locks a killed builder left in the extensions folder: the next ``--resume`` trains, in bounded time."""
    import random
    import time

    env = {**without_rank_environment(), "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    for op in ("deepspeed_shm_comm", "cpu_adam"):  # what a builder killed mid-build leaves
        (tmp_path / "ext" / op).mkdir(parents=True)
        (tmp_path / "ext" / op / "lock").touch()
        os.utime(tmp_path / "ext" / op / "lock", (time.time() - 60, time.time() - 60))
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "fastcov.cli", *_cli(run, "trainer.max_steps=1"), "--resume"]
    rng = random.Random(os.getpid())
    for delay in sorted(rng.uniform(0.2, 8.0) for _ in range(3)):
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run)] == [1]
    assert not list((tmp_path / "ext").glob("*/lock"))


def test_a_checkpoint_is_written_by_wall_time(tmp_path, train_mod, monkeypatch):
    from fastcov.trainer.config import Config, load_config

    assert Config().trainer.save_every_minutes > 0  # on by default
    clock = [1000.0]

    def tick():
        clock[0] += 60.0  # one minute per call
        return clock[0]

    monkeypatch.setattr(train_mod.time, "monotonic", tick)
    run = tmp_path / "run"
    train_mod.train(load_config(TINY, [f"trainer.run_dir={run}", *BASE, "trainer.max_steps=3",
                                       "trainer.save_every_minutes=2", "trainer.keep_last=5"]))
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert "step_000001" in names or "step_000002" in names, names  # before the end, by time alone


# ------------------------------------------------------------------------------------ I/O errors are one line

def test_a_disk_full_mid_run_is_one_line_and_keeps_the_last_checkpoint(tmp_path, train_mod, monkeypatch, capsys):
    from fastcov.cli import main

    real = train_mod.write_checkpoint

    def fail_at_step_2(root, step, *a, **k):
        if step == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(root / "step_000002"))
        return real(root, step, *a, **k)

    monkeypatch.setattr(train_mod, "write_checkpoint", fail_at_step_2)
    run = tmp_path / "run"
    assert main(_cli(run, "trainer.save_every=1")) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "No space left on device" in err, err
    assert "step_000002" in err and "the last intact checkpoint is" in err and "step_000001" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001"]


def _in_a_read_only_mount(cmd: str) -> subprocess.CompletedProcess:
    script = f"mkdir -p /tmp/fastcov-ro && mount -t tmpfs -o ro tmpfs /tmp/fastcov-ro && {cmd}"
    return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})


def test_a_read_only_run_directory_is_one_line(tmp_path):
    if shutil.which("unshare") is None or _in_a_read_only_mount("true").returncode != 0:
        pytest.skip("no user and mount namespaces here to make a read-only directory (root ignores modes)")
    proc = _in_a_read_only_mount(f"{sys.executable} -m fastcov.cli train {TINY} trainer.run_dir=/tmp/fastcov-ro/run "
                                 + " ".join(BASE))
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "Read-only file system" in err[0] and "choose a writable trainer.run_dir" in err[0], err


def test_a_kill_while_the_synthetic_task_is_written_leaves_no_half_task(tmp_path, monkeypatch):
    from fastcov.trainer.config import load_config
    from fastcov.trainer.data import loading, synthetic

    cfg = load_config(TINY, [f"trainer.run_dir={tmp_path / 'run'}"])
    assert cfg.data.synthetic.enabled and cfg.data.synthetic.n_val > 0
    real = synthetic.write_parquet

    def die_after_the_first_file(path, *a, **k):
        real(path, *a, **k)
        raise KeyboardInterrupt  # stands for a kill between the two files

    monkeypatch.setattr(synthetic, "write_parquet", die_after_the_first_file)
    with pytest.raises(KeyboardInterrupt):
        loading.prepare_data(cfg, None, tmp_path / "run")
    assert not (tmp_path / "run" / "data" / "train.parquet").exists()  # so the next run writes it again
    monkeypatch.setattr(synthetic, "write_parquet", real)
    train, val = loading.prepare_data(cfg, None, tmp_path / "run")
    assert [len(loading.read_parquet(f)) for f in train + val] == [cfg.data.synthetic.n_train, cfg.data.synthetic.n_val]
    assert not (tmp_path / "run" / ".data.tmp").exists()

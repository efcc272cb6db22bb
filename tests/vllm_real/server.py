"""A real vLLM server for the tests, started as a user would (``python -m fastcov.trainer.rollout_vllm serve``)
on 127.0.0.1, and stopped with no process left behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from fastcov.trainer.rollout.vllm_server import post_json
from fastcov.trainer.runtime.distributed import free_port


def write_model_dir(lm, tokenizer, path: Path) -> Path:
    """The config (and tokenizer: vLLM's completions with log-probs need one) a dummy-weight server builds
    its model from; the weights arrive with the first sync."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = lm.config
    if not getattr(cfg, "architectures", None):
        cfg.architectures = [type(lm).__name__]
    cfg.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@contextlib.contextmanager
def vllm_server(model_dir: Path, log: Path, timeout: float = 300.0):
    """Yields (url, Popen). The server runs in its own session (process group); on exit it gets SIGTERM,
    then the test checks that the whole group is gone (vLLM's engine-core child included)."""
    port = free_port()
    cmd = [sys.executable, "-m", "fastcov.trainer.rollout_vllm", "serve", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "256", "--load-format", "dummy",
           "--seed", "0"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                post_json(url + "/v1/models", None, timeout=5)
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM server not up in {timeout:.0f} s:\n{log.read_text()[-3000:]}") from None
                time.sleep(1.0)
        yield url, proc
    finally:
        stop(proc)


def stop(proc: subprocess.Popen, grace: float = 60.0) -> bool:
    """SIGTERM, wait; True when the server and every process of its group exited by themselves."""
    pgid = proc.pid
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + grace
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.5)
    clean = not group_alive(pgid)
    if not clean:  # leave nothing behind, then let the test say so
        os.killpg(pgid, signal.SIGKILL)
    proc.stopped_cleanly = clean
    return clean

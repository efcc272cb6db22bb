"""``python -m fastcov.trainer.rollout.engine_worker SPEC.json``: the HF rollout engine's own process (started by
``EngineProcess``, engine_process.py, which documents the requests). It builds an empty copy of the policy from
the Hugging Face config beside the spec (LoRA: the same adapter modules), joins the trainer's channel, and serves
requests until ``stop`` or until the channel breaks; the weights arrive with the first ``update``.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import logging
import os
import signal
import sys
import traceback
from types import SimpleNamespace

PR_SET_PDEATHSIG = 1
logger = logging.getLogger("fastcov.trainer.rollout.engine_worker")  # fastcov's handler: ``import fastcov``


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the trainer that started it dies (Linux; elsewhere the broken channel ends it)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


def build_engine(spec: dict):
    """The spec's HFRolloutEngine on an empty model (meta → its device), with LoRA adapters when asked."""
    import torch
    from transformers import AutoConfig

    from fastcov.trainer.rollout.hf import HFRolloutEngine
    from fastcov.trainer.rollout.node import rollout_copy

    config = AutoConfig.from_pretrained(spec["model_dir"])
    config._attn_implementation = spec["attn_implementation"]
    model = rollout_copy(config, torch.device(spec["device"]), getattr(torch, spec["dtype"]))
    if spec.get("lora"):
        from peft import inject_adapter_in_model

        from fastcov.trainer.runtime.lora import ADAPTER, lora_config

        model = inject_adapter_in_model(lora_config(SimpleNamespace(**spec["lora"])), model, adapter_name=ADAPTER)
    return HFRolloutEngine(model, spec["eos_token_ids"], spec["pad_token_id"], spec["batch_size"],
                           spec["token_budget"])


def receive_update(channel, engine) -> dict:
    """The buckets of one ``update`` up to ``end``, each loaded as it arrives; a failure is reported after the
    stream has been read to its end, so the two sides stay in step."""
    from fastcov.trainer.runtime.weight_buckets import BucketMeta, unflatten

    loaded, error = 0, None
    while True:
        msg = channel.recv()
        if msg["op"] == "end":
            return {"error": error} if error else {"tensors": loaded}
        meta = BucketMeta.from_json(msg["meta"])
        flat = channel.recv_tensor(meta.nbytes)
        if error is None:
            try:
                engine.update_weights(unflatten(flat, meta))
                loaded += len(meta.names)
            except (KeyError, ValueError, RuntimeError) as exc:
                error = f"{type(exc).__name__}: {exc}"


def serve(channel, engine) -> None:
    from fastcov.trainer.rollout.base import SamplingParams

    while True:
        msg = channel.recv()
        op = msg["op"]
        if op == "stop":
            return
        if op == "update":
            channel.send(receive_update(channel, engine))
        elif op == "generate":
            try:
                out = engine.generate(msg["prompts"], SamplingParams(**msg["sampling"]))
                reply = {"token_ids": out.token_ids, "logprobs": out.logprobs, "stats": dict(engine.last_stats)}
            except (RuntimeError, ValueError, IndexError) as exc:
                reply = {"error": f"generate: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
            channel.send(reply)
        else:
            channel.send({"error": f"unknown request {op!r}"})


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's: it stops this process itself
    with open(argv[0]) as f:
        spec = json.load(f)
    die_with_parent(int(spec["parent_pid"]))
    import torch
    import torch.distributed as dist

    from fastcov.trainer.rollout.engine_process import Channel

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    timeout = datetime.timedelta(seconds=float(spec["timeout_s"]))
    store = dist.TCPStore(spec["host"], int(spec["port"]), 2, False, timeout=timeout)
    engine = build_engine(spec)
    store.set("ready", str(os.getpid()))
    channel = Channel(store, 1, spec["host"], float(spec["timeout_s"]))
    try:
        serve(channel, engine)
    except RuntimeError as exc:  # the channel broke: the trainer is gone
        logger.warning(f"engine worker (rank {spec['rank']}): the trainer went away: {str(exc).splitlines()[0]}")
        return 1
    return 0


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except Exception:  # noqa: BLE001 - the trainer reads the last line of this log
        traceback.print_exc()
        code = 2
    sys.stderr.flush()
    os._exit(code)  # no teardown of gloo's threads, which can abort a process whose peer is gone

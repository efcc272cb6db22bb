"""``make_vllm_engine``: the vLLM engine ``cfg.rollout`` asks for (registered as "vllm" in
``ROLLOUT_ENGINES``), colocated (vllm_colocated.py) or server (vllm_server.py).

Colocated runs where vLLM's platform can host it beside the trainer: CUDA training ranks, or vLLM's CPU
build with CPU ranks. Sleep mode exists only where vLLM says so (``is_sleep_mode_available``: CUDA); elsewhere
the engine stays awake, said once in the log. vLLM is imported only here, when an engine is built.
"""

from __future__ import annotations

import copy
import importlib
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from fastcov.trainer.rollout.base import ROLLOUT_ENGINES, RolloutEngine
from fastcov.trainer.rollout.vllm_api import LOCAL_BACKEND, LOGPROBS_MODE, VLLMApi, import_vllm
from fastcov.trainer.rollout.vllm_colocated import VLLMColocatedEngine, register_local_backend
from fastcov.trainer.rollout.vllm_server import VLLMServerEngine, transfer_backend
from fastcov.trainer.rollout.vllm_wire import derived_buffer_names, dtype_name
from fastcov.trainer.runtime.lora import AdapterSync, has_adapters, smallest_rank_at_least
from fastcov.trainer.runtime.weight_buckets import bucket_bytes_from_mb, iter_buckets

CPU_KV_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE when unset: vLLM's CPU default counts the trainer's own memory
_SAID: set[str] = set()


def rollout_dtype(cfg) -> torch.dtype:
    """vLLM's model dtype: bf16 unless ``model.dtype: fp32``, on every device. Not ``runtime.precision.
    param_dtype`` on purpose: that rule trains in fp32 on CPU, while vLLM's CPU kernels run bf16 (its
    attention is built for it), so the rollout is bf16 there too and the log-prob gap to the policy is
    the bf16 one (``rollout_logprob_diff_*``)."""
    return torch.float32 if cfg.model.dtype == "fp32" else torch.bfloat16


def colocated_llm_kwargs(cfg, model_dir: str, sleep: bool = True, lora_rank: int = 0) -> dict:
    """``vllm.LLM(**kwargs)`` of the colocated engine (every key checked against vLLM's source); with
    ``lora_rank`` > 0, one LoRA adapter slot of at least that rank."""
    r = cfg.rollout
    max_new = max(r.max_new_tokens, cfg.trainer.eval_max_new_tokens or 0)
    lora = dict(enable_lora=True, max_lora_rank=smallest_rank_at_least(lora_rank), max_loras=1) if lora_rank else {}
    return dict(model=str(model_dir), skip_tokenizer_init=True, load_format="dummy", **lora,
                dtype=dtype_name(rollout_dtype(cfg)), tensor_parallel_size=r.vllm_tensor_parallel_size,
                distributed_executor_backend="external_launcher",
                gpu_memory_utilization=r.vllm_gpu_memory_utilization, enable_sleep_mode=sleep,
                enable_prefix_caching=True, seed=cfg.trainer.seed,
                max_model_len=cfg.data.max_prompt_len + max_new, logprobs_mode=LOGPROBS_MODE,
                weight_transfer_config={"backend": LOCAL_BACKEND})


def say_once(msg: str) -> None:
    if msg not in _SAID:
        _SAID.add(msg)
        print(f"[fastcov] {msg}", file=sys.stderr, flush=True)


def colocated_platform(device: torch.device) -> bool:
    """Whether vLLM's platform can host a colocated engine on ``device`` (raises the one-line error if not);
    returns whether it has sleep mode."""
    current_platform = importlib.import_module("vllm.platforms").current_platform  # resolved lazily by vLLM
    if not (device.type == "cuda" or (device.type == "cpu" and current_platform.is_cpu())):
        raise ValueError(f"rollout.vllm_mode: colocated vLLM needs CUDA training ranks, or CPU ranks with vLLM's "
                         f"CPU build (trainer.device is {device.type}, vLLM's platform "
                         f"{type(current_platform).__name__})")
    sleep = bool(current_platform.is_sleep_mode_available())
    if not sleep:
        say_once(f"vLLM on {device.type} has no sleep mode (CUDA only): the colocated engine stays awake, "
                 "its weights and KV cache resident while the policy trains")
    if current_platform.is_cpu():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_GIB)
    return sleep


def write_model_dir(cfg, model, rank: int) -> Path:
    """vLLM builds its model from a config directory; the weights arrive with the first update_weights."""
    model_dir = Path(cfg.trainer.run_dir) / "vllm" / f"rank{rank}"
    model_dir.mkdir(parents=True, exist_ok=True)
    hf_config = copy.deepcopy(model.config)  # vLLM picks its model class from `architectures`
    if not getattr(hf_config, "architectures", None):
        hf_config.architectures = [type(model).__name__]
    hf_config.save_pretrained(model_dir)
    return model_dir


def make_colocated(cfg, model, eos: list[int], device: torch.device, rank: int, world: int,
                   vllm) -> VLLMColocatedEngine:
    r = cfg.rollout
    t = r.vllm_tensor_parallel_size
    if world % t:
        raise ValueError(f"rollout.vllm_tensor_parallel_size: {t} does not divide the {world} training ranks")
    sleep = colocated_platform(device)
    group = None
    if t > 1:
        group, _ = dist.new_subgroups(group_size=t)  # ranks [k*t, (k+1)*t): vLLM's TP groups
    model_dir = write_model_dir(cfg, model, rank)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine (and worker) in this process
    register_local_backend()
    lora = AdapterSync(model, model_dir / "lora") if has_adapters(model) else None
    llm = vllm.LLM(**colocated_llm_kwargs(cfg, str(model_dir), sleep=sleep, lora_rank=lora.rank if lora else 0))
    bucket_bytes = bucket_bytes_from_mb(r.sync_bucket_mb)
    refresh = None
    if cfg.trainer.zero_stage < 3 and sleep:  # the policy's full parameters are readable on this rank alone
        named = list(model.named_parameters()) + list(model.named_buffers())

        def refresh():
            return iter_buckets(named, bucket_bytes)

    return VLLMColocatedEngine(llm, vllm, eos, device, tp=t, group=group, dtype=rollout_dtype(cfg),
                               bucket_bytes=bucket_bytes, refresh=refresh, sleep=sleep,
                               skip=derived_buffer_names(model), lora=lora)


@ROLLOUT_ENGINES.register("vllm")
def make_vllm_engine(cfg, model, tokenizer, *, device: torch.device, rank: int = 0, world: int = 1,
                     zero_stage: int = 0) -> RolloutEngine:
    """The vLLM engine for ``cfg.rollout`` (see ``make_rollout_engine``; ``zero_stage`` is read from
    ``cfg.trainer``)."""
    vllm = import_vllm()
    r = cfg.rollout
    eos = [tokenizer.eos_token_id]
    if r.vllm_mode == "server":
        return VLLMServerEngine(r.vllm_server_urls, eos, r.vllm_tensor_parallel_size, device, rank=rank,
                                world=world, api=VLLMApi(vllm.__version__), dtype=rollout_dtype(cfg),
                                bucket_bytes=bucket_bytes_from_mb(r.sync_bucket_mb),
                                backend=transfer_backend(device.type), skip=derived_buffer_names(model))
    return make_colocated(cfg, model, eos, device, rank, world, vllm)

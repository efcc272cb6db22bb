"""``make_vllm_engine``: the vLLM engine ``cfg.rollout`` asks for (registered as "vllm" in
``ROLLOUT_ENGINES``), colocated (vllm_colocated.py) or server (vllm_server.py).

Colocated runs where vLLM's platform can host it beside the trainer: CUDA training ranks, or vLLM's CPU
build with CPU ranks. Sleep mode exists only where vLLM says so (``is_sleep_mode_available``: CUDA); elsewhere
the engine stays awake, said once in the log. vLLM is imported only here, when an engine is built.
"""

from __future__ import annotations

import copy
import importlib
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist

from fastcov.errors import ConfigError
from fastcov.trainer.rollout.base import ROLLOUT_ENGINES, RolloutEngine
from fastcov.trainer.rollout.vllm_api import LOCAL_BACKEND, LOGPROBS_MODE, VLLMApi, import_vllm
from fastcov.trainer.rollout.vllm_colocated import VLLMColocatedEngine, register_local_backend
from fastcov.trainer.rollout.vllm_server import VLLMServerEngine, transfer_backend
from fastcov.trainer.rollout.vllm_wire import derived_buffer_names, dtype_name
from fastcov.trainer.runtime.distributed import before_shutdown
from fastcov.trainer.runtime.lora import AdapterSync, has_adapters, smallest_rank_at_least
from fastcov.trainer.runtime.weight_buckets import bucket_bytes_from_mb, iter_buckets

logger = logging.getLogger(__name__)

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
        logger.warning(msg)


# vLLM's CPU attention kernels, where its backend class cannot be read (vLLM 0.32's CPUAttentionBackend)
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def model_head_dim(config) -> int:
    """The attention head size of an HF ``config``: its ``head_dim`` where set, else hidden / heads."""
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim) if head_dim else int(config.hidden_size) // int(config.num_attention_heads)


def cpu_head_dims() -> tuple[int, ...]:
    """The head sizes vLLM's CPU attention backend takes, from the installed vLLM where it says."""
    try:
        backend = importlib.import_module("vllm.v1.attention.backends.cpu_attn").CPUAttentionBackend
        return tuple(int(d) for d in backend.get_supported_head_sizes())
    except (ImportError, AttributeError):
        return CPU_HEAD_DIMS


def check_cpu_attention(config) -> None:
    """vLLM's CPU build fails at the first rollout on a head size its kernels lack, after the engine started
    (20 s on a small model): the same check first, in one line naming model.arch."""
    head_dim, dims = model_head_dim(config), cpu_head_dims()
    if head_dim not in dims:
        raise ConfigError(f"model.arch: head_dim {head_dim} (hidden_size {config.hidden_size} / "
                          f"{config.num_attention_heads} heads) is not one vLLM's CPU attention takes; it takes "
                          f"{', '.join(map(str, dims))} (e.g. model.arch.hidden_size="
                          f"{64 * int(config.num_attention_heads)} for 64)")


def colocated_platform(device: torch.device, config=None) -> bool:
    """Whether vLLM's platform can host a colocated engine on ``device`` for a model of HF ``config`` (raises the
    one-line error if not); returns whether it has sleep mode."""
    current_platform = importlib.import_module("vllm.platforms").current_platform  # resolved lazily by vLLM
    if not (device.type == "cuda" or (device.type == "cpu" and current_platform.is_cpu())):
        raise ConfigError(f"rollout.vllm_mode: colocated vLLM needs CUDA training ranks, or CPU ranks with vLLM's "
                          f"CPU build (trainer.device is {device.type}, vLLM's platform "
                          f"{type(current_platform).__name__})")
    if current_platform.is_cpu() and config is not None:
        check_cpu_attention(config)
    sleep = bool(current_platform.is_sleep_mode_available())
    if not sleep:
        say_once(f"vLLM on {device.type} has no sleep mode (CUDA only): the colocated engine stays awake, "
                 "its weights and KV cache resident while the policy trains")
    if current_platform.is_cpu():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_GIB)
    return sleep


class _NoChatTemplateWarmup(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "Chat template warmup failed"


def quiet_chat_template_warmup() -> None:
    """fastcov hands vLLM token ids (``skip_tokenizer_init``), so the chat-template warm-up of vLLM's ``LLM`` (0.3x)
    has no tokenizer and logs a traceback as a warning at every start: dropped, nothing else of that logger."""
    logger = logging.getLogger("vllm.renderers.base")
    if not any(isinstance(f, _NoChatTemplateWarmup) for f in logger.filters):
        logger.addFilter(_NoChatTemplateWarmup())


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
    sleep = colocated_platform(device, getattr(model, "config", None))
    group = None
    if t > 1:
        group, _ = dist.new_subgroups(group_size=t)  # ranks [k*t, (k+1)*t): vLLM's TP groups
    model_dir = write_model_dir(cfg, model, rank)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine (and worker) in this process
    register_local_backend()
    lora = AdapterSync(model, model_dir / "lora") if has_adapters(model) else None
    quiet_chat_template_warmup()
    llm = vllm.LLM(**colocated_llm_kwargs(cfg, str(model_dir), sleep=sleep, lora_rank=lora.rank if lora else 0))
    bucket_bytes = bucket_bytes_from_mb(r.sync_bucket_mb)
    refresh = None
    if cfg.trainer.zero_stage < 3 and sleep:  # the policy's full parameters are readable on this rank alone
        named = list(model.named_parameters()) + list(model.named_buffers())

        def refresh():
            return iter_buckets(named, bucket_bytes)

    engine = VLLMColocatedEngine(llm, vllm, eos, device, tp=t, group=group, dtype=rollout_dtype(cfg),
                                 bucket_bytes=bucket_bytes, refresh=refresh, sleep=sleep,
                                 skip=derived_buffer_names(model), lora=lora)
    before_shutdown(engine.close)  # vLLM's groups end before fastcov destroys the default one, at exit
    return engine


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

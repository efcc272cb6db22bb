"""LoRA and QLoRA policies: peft adapters injected into the Hugging Face model in place, a frozen base.

The model stays the transformers class it was (``peft.inject_adapter_in_model``, no PeftModel wrapper),
so the policy's decoder/head split, the fused kernel and the HF rollout engine see the same module.
Only the adapters require gradients: DeepSpeed's optimizer holds only them, checkpoints store only them
(``exclude_frozen_parameters``), and the weight sync after the first one sends only them.

* ``model.quantization: 4bit`` (QLoRA): every ``nn.Linear`` of the decoder becomes a bitsandbytes NF4
  ``Linear4bit`` before the adapters go in; the weights are quantized when the model moves to its device.
* The LM head stays a frozen ``nn.Linear`` unless ``lm_head`` is in ``model.lora_targets``; then it
  trains in full (the fused kernel needs its weight matrix as it is).
* The reference policy of a KL term is the same module with the adapters switched off
  (``adapters_disabled``), never a second copy.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from peft import LoraConfig

HEAD = "lm_head"
ADAPTER = "default"  # peft's adapter name


def is_adapter_param(name: str) -> bool:
    """Whether a parameter (or weight-sync tensor) name belongs to a LoRA adapter (peft's ``lora_A``/``lora_B``)."""
    return ".lora_" in name


def lora_enabled(mcfg) -> bool:
    """Whether a ``model`` config section (or None) asks for adapters."""
    return mcfg is not None and int(getattr(mcfg, "lora_rank", 0) or 0) > 0


def lora_config(mcfg) -> LoraConfig:
    """peft's LoraConfig of a ``model`` section (the head, if listed, trains in full: not a LoRA target)."""
    from peft import LoraConfig

    targets = [t for t in mcfg.lora_targets if t != HEAD]
    # peft annotates lora_alpha int but computes alpha / r: a fractional alpha works
    return LoraConfig(r=int(mcfg.lora_rank), lora_alpha=float(mcfg.lora_alpha),  # type: ignore[arg-type]
                      lora_dropout=float(mcfg.lora_dropout), target_modules=targets, bias="none")


def _packable(lin: nn.Linear) -> bool:
    """bitsandbytes' NF4 blocks are 64 inputs wide and its CPU kernel packs outputs by 32."""
    return lin.in_features % 64 == 0 and lin.out_features % 32 == 0


def quantize_4bit(model: nn.Module, compute_dtype: torch.dtype) -> int:
    """Replace every ``nn.Linear`` except the output embedding by an NF4 ``Linear4bit`` holding the same
    (not yet quantized) weights; they are quantized when the model moves to its device. A layer too
    narrow for NF4 blocks (fewer than 64 inputs: toy models only) stays as it is, said once. Returns the count."""
    import warnings

    import bitsandbytes as bnb

    head = _head(model)
    linears = [(name, mod) for name, mod in model.named_modules() if type(mod) is nn.Linear and mod is not head]
    swaps = [(name, lin) for name, lin in linears if _packable(lin)]
    if len(swaps) < len(linears):
        warnings.warn(f"model.quantization: {len(linears) - len(swaps)} of {len(linears)} Linear layers stay "
                      "unquantized (NF4 needs in_features % 64 == 0 and out_features % 32 == 0)", stacklevel=2)
    for name, lin in swaps:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                              compute_dtype=compute_dtype, quant_type="nf4", device="meta")
        q.weight = bnb.nn.Params4bit(lin.weight.data.float(), requires_grad=False, quant_type="nf4")
        # bitsandbytes' AVX512-BF16 inference path repacks the weights (absmax rounded to bf16) on the first
        # no-grad forward and then runs without autograd: rollouts and training would see different weights
        q.support_avx512bf16_for_cpu = False
        if lin.bias is not None:
            q.bias = nn.Parameter(lin.bias.data, requires_grad=False)
        setattr(parent, child, q)
    return len(swaps)


def add_adapters(model: nn.Module, mcfg, compute_dtype: torch.dtype) -> nn.Module:
    """The model with LoRA adapters on ``mcfg.lora_targets`` (after NF4 quantization when asked), every
    other parameter frozen (the head trainable when listed). Raises ValueError naming the key."""
    from peft import inject_adapter_in_model

    if mcfg.quantization == "4bit":
        if quantize_4bit(model, compute_dtype) == 0:
            raise ValueError("model.quantization: the model has no nn.Linear layer to quantize")
    try:
        model = inject_adapter_in_model(lora_config(mcfg), model, adapter_name=ADAPTER)
    except ValueError as exc:
        raise ValueError(f"model.lora_targets: {str(exc).splitlines()[0]}") from None
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_param(name))
    if HEAD in mcfg.lora_targets:
        for p in _head(model).parameters():
            p.requires_grad_(True)
    info = {"rank": int(mcfg.lora_rank), "alpha": float(mcfg.lora_alpha), "dropout": float(mcfg.lora_dropout),
            "targets": list(mcfg.lora_targets), "quantization": mcfg.quantization}
    setattr(model, "_fastcov_lora", info)  # noqa: B010 - nn.Module's __setattr__ would type it Tensor | Module
    return model


def has_adapters(model: nn.Module) -> bool:
    return getattr(model, "_fastcov_lora", None) is not None


def lora_info(model: nn.Module) -> dict:
    """What ``add_adapters`` recorded on the model: rank, alpha, dropout, targets, quantization."""
    return getattr(model, "_fastcov_lora")  # noqa: B009 - nn.Module's __getattr__ would type it Tensor | Module


def _head(model: nn.Module) -> nn.Module:
    return model.get_output_embeddings()  # type: ignore[operator]  # transformers' PreTrainedModel method


def _peft_config(model: nn.Module):
    return getattr(model, "peft_config")[ADAPTER]  # noqa: B009 - nn.Module's __getattr__ would type it Tensor | Module


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """The base model: every LoRA layer of ``model`` bypassed inside the block, back on after (peft's
    switch also flips the adapters' requires_grad; each parameter's flag is restored as it was)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield model
    finally:
        for m in layers:
            m.enable_adapters(True)
        for p, flag in flags:
            p.requires_grad_(flag)


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors in peft's saved layout (``...q_proj.lora_A.weight``; the head's full weight
    when it trains), detached, on the CPU."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=ADAPTER)
    if HEAD in lora_info(model)["targets"]:
        head = _head(model)
        state.update({f"{HEAD}.{k}": v for k, v in head.state_dict().items()})
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items()}


def adapter_config_dict(model: nn.Module, base_name: str | None = None) -> dict:
    """adapter_config.json as peft writes it for this model's adapters."""
    cfg = _peft_config(model).to_dict()
    cfg["base_model_name_or_path"] = base_name
    if HEAD in lora_info(model)["targets"]:
        cfg["modules_to_save"] = [HEAD]
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in cfg.items()}


def save_adapter(model: nn.Module, directory: Path, base_name: str | None = None) -> int:
    """``adapter_config.json`` + ``adapter_model.safetensors`` (peft's layout, loadable with
    ``PeftModel.from_pretrained(base, directory)`` and by vLLM's ``LoRARequest``). Returns the bytes written."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {f"base_model.model.{k}": v for k, v in adapter_state_dict(model).items()}
    save_file(state, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(adapter_config_dict(model, base_name), indent=1))
    return sum(t.numel() * t.element_size() for t in state.values())


def is_adapter_dir(path) -> bool:
    """Whether ``path`` is a saved adapter (peft's layout, as a LoRA run's ``final/``)."""
    return (Path(path) / "adapter_config.json").is_file()


def load_merged_adapter(adapter_dir, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The base model named in ``adapter_dir``'s adapter_config.json with the adapter merged into its weights:
    a plain causal LM for evaluation and generation. The base loads in ``dtype`` (a QLoRA run's base is
    evaluated unquantized). Raises ValueError naming the missing or unreadable base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter_dir = Path(adapter_dir)
    base = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{str(adapter_dir)!r}: adapter_config.json names no base model "
                         "(base_model_name_or_path); a run from model.arch has none on disk")
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{str(adapter_dir)!r}: cannot load its base model {base!r}: "
                         f"{str(exc).splitlines()[0]}") from None
    model = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    return model.to(device)


def copy_adapter_layout(src: nn.Module, dst: nn.Module) -> nn.Module:
    """``dst`` (a plain copy of ``src``'s architecture) with the same adapter modules as ``src``, frozen:
    a rollout copy whose tensors the weight sync can fill by name."""
    from peft import inject_adapter_in_model

    dst = inject_adapter_in_model(_peft_config(src), dst, adapter_name=ADAPTER)
    for p in dst.parameters():
        p.requires_grad_(False)
    setattr(dst, "_fastcov_lora", dict(lora_info(src)))  # noqa: B010 - nn.Module's __setattr__ would type it Tensor | Module
    return dst


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, all) parameter counts; a 4-bit weight counts its unpacked size."""
    total = trainable = 0
    for p in model.parameters():
        n = p.numel() * 2 if p.dtype == torch.uint8 else p.numel()  # two NF4 values per byte
        total += n
        trainable += n if p.requires_grad else 0
    return trainable, total


# ---------------------------------------------------------------------------------------------------- vLLM


def peft_name(name: str) -> str:
    """A policy parameter's name as peft saves it: ``model.layers.0.self_attn.q_proj.lora_A.default.weight``
    -> ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".")


def smallest_rank_at_least(rank: int, allowed=(1, 8, 16, 32, 64, 128, 256, 320, 512)) -> int:
    """vLLM's ``max_lora_rank`` takes one of a fixed set of values: the smallest one >= ``rank``."""
    for r in allowed:
        if r >= rank:
            return r
    raise ValueError(f"model.lora_rank: {rank} is above vLLM's largest max_lora_rank ({allowed[-1]})")


class AdapterSync:
    """A LoRA policy's weight sync as an engine that loads base weights by their Hugging Face names and
    takes the adapters as a peft directory (vLLM's ``LoRARequest``) receives it.

    ``base_weights(items)`` passes the base tensors on (``...q_proj.base_layer.weight`` renamed
    ``...q_proj.weight``, an NF4 weight dequantized) and sets the adapter tensors aside; ``write()`` then
    writes them as ``<root>/v000001/`` (adapter_model.safetensors, adapter_config.json), one directory per
    sync, keeping the newest ``keep`` of them, and returns (directory, bytes) or None when none came.
    """

    def __init__(self, model: nn.Module, root: Path, keep: int = 2):
        self.config = adapter_config_dict(model)
        self.rank = int(lora_info(model)["rank"])
        self.quant = {n: getattr(p, "quant_state") for n, p in model.named_parameters()  # noqa: B009 - a Parameter's quant_state is bitsandbytes', not torch's
                      if getattr(p, "quant_state", None) is not None}
        self.root = Path(root)
        self.keep = keep
        self.version = 0
        self.adapter: dict[str, torch.Tensor] = {}

    def base_weights(self, items) -> Iterator[tuple[str, torch.Tensor]]:
        from fastcov.trainer.runtime.weight_buckets import iter_named

        self.adapter = {}
        for name, tensor in iter_named(items):
            if is_adapter_param(name):
                self.adapter[peft_name(name)] = tensor.detach().to("cpu", copy=True).contiguous()
                continue
            if name in self.quant:
                import bitsandbytes.functional as bnbf

                tensor = bnbf.dequantize_4bit(tensor, self.quant[name])
            yield name.replace(".base_layer.", "."), tensor

    def write(self) -> tuple[Path, int] | None:
        import shutil

        from safetensors.torch import save_file

        if not self.adapter:
            return None
        self.version += 1
        directory = self.root / f"v{self.version:06d}"
        directory.mkdir(parents=True, exist_ok=True)
        save_file(self.adapter, str(directory / "adapter_model.safetensors"))
        (directory / "adapter_config.json").write_text(json.dumps(self.config, indent=1))
        for old in sorted(self.root.glob("v*"))[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return directory, sum(t.numel() * t.element_size() for t in self.adapter.values())

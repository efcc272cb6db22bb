"""LoRA and QLoRA policies (model.lora_rank, model.quantization: 4bit): the settings' one-line errors, the adapters
switched off give the base and load in peft, a head listed trains in full, activation offload. Training runs (only
the adapters train, checkpoint and resume bit-exactly, the reference is the base with the adapters switched off):
tests/trainer/e2e/test_lora_e2e.py."""

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from _fixtures import LORA, TINY, tiny_on_cpu

from fastcov.trainer import train as train_mod
from fastcov.trainer.config import ConfigError, load_config

pytestmark = pytest.mark.usefixtures("varied_rewards")  # tests/trainer/conftest.py


@pytest.mark.parametrize("override, message", [
    ("model.lora_rank=-1", "model.lora_rank: must be >= 0"),
    ("model.lora_alpha=0", "model.lora_alpha: must be > 0"),
    ("model.lora_dropout=1.0", "model.lora_dropout: must be in [0, 1)"),
    ("model.lora_targets=[]", "model.lora_targets: give at least one module name"),
    ("model.quantization=4bit", "model.quantization: a 4-bit base cannot train"),
    ("model.quantization=8bit", "model.quantization: '8bit' is not one of"),
    ("trainer.offload_activations=true", "trainer.offload_activations: offloads gradient checkpointing"),
])
def test_bad_lora_settings_name_the_key(tmp_path, override, message):
    with pytest.raises(ConfigError) as info:
        tiny_on_cpu(tmp_path, "bad", override)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_four_bit_refuses_zero3_and_lora_refuses_vllm_servers(tmp_path):
    with pytest.raises(ConfigError, match=r"^model.quantization: ZeRO-3"):
        tiny_on_cpu(tmp_path, "z3", *LORA, "model.quantization=4bit", "trainer.zero_stage=3")
    with pytest.raises(ConfigError, match=r"^model.lora_rank: LoRA syncs its adapters to a colocated vLLM"):
        tiny_on_cpu(tmp_path, "server", *LORA, "rollout.engine=vllm", "rollout.vllm_mode=server",
             "rollout.vllm_server_urls=[http://h:1]")
    # a reference model is the policy with its adapters off (tests/trainer/e2e/test_lora_e2e.py): both accepted
    tiny_on_cpu(tmp_path, "prime", *LORA, "algo.adv_estimator=prime")
    tiny_on_cpu(tmp_path, "kl", *LORA, "algo.adv_estimator=reinforce_pp", "algo.kl_coef=0.1")


def test_unknown_target_module_is_a_config_error(tmp_path):
    from fastcov.errors import UserError

    with pytest.raises(UserError, match=r"^model.lora_targets: "):
        train_mod.train(tiny_on_cpu(tmp_path, "run", *LORA, "model.lora_targets=[no_such_proj]", "trainer.max_steps=1"))


def test_adapters_disabled_is_the_base_and_adapter_files_load_in_peft(tmp_path):
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    from fastcov.trainer.runtime.lora import adapters_disabled, add_adapters, save_adapter

    cfg = tiny_on_cpu(tmp_path, "x", *LORA, "model.lora_targets=[q_proj,v_proj,down_proj]").model
    arch = {k: v for k, v in cfg.arch.items() if k != "model_type"}
    config = AutoConfig.for_model("qwen2", vocab_size=50, **arch)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config)
    torch.manual_seed(0)
    lm = add_adapters(AutoModelForCausalLM.from_config(config), cfg, torch.float32)
    for n, p in lm.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p)  # peft starts B at 0: move it so the adapters change the output
    x = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        want = base(x).logits
        assert not torch.allclose(lm(x).logits, want)
        with adapters_disabled(lm):
            assert torch.equal(lm(x).logits, want)
        adapted = lm(x).logits
    assert all(p.requires_grad == (".lora_" in n) for n, p in lm.named_parameters())  # flags restored
    save_adapter(lm, tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, adapted)


def test_head_listed_trains_in_full(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from fastcov.trainer.runtime.lora import adapter_state_dict, add_adapters

    cfg = tiny_on_cpu(tmp_path, "x", *LORA, "model.lora_targets=[q_proj,lm_head]").model
    arch = {k: v for k, v in cfg.arch.items() if k != "model_type"}
    lm = add_adapters(AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", vocab_size=50, **arch)),
                      cfg, torch.float32)
    assert type(lm.lm_head) is torch.nn.Linear and lm.lm_head.weight.requires_grad
    assert "lm_head.weight" in adapter_state_dict(lm)


# ---------------------------------------------------------------------------------------- activation offload

def test_activation_offload_on_cpu_is_a_no_op_said_once(monkeypatch):
    import contextlib

    from fastcov.trainer.runtime import offload

    monkeypatch.setattr(offload, "_said_once", False)
    with pytest.warns(UserWarning, match="trainer.offload_activations: this run is on the CPU") as record:
        assert offload.activation_offload(True, torch.device("cpu")) is contextlib.nullcontext
        offload.activation_offload(True, torch.device("cpu"))
    assert len([w for w in record if "offload_activations" in str(w.message)]) == 1
    assert offload.activation_offload(False, torch.device("cuda")) is contextlib.nullcontext


def test_offloaded_activations_give_the_same_gradients():
    """The offload path itself (forced on CPU): saved tensors leave for host copies and come back for the
    backward; the gradients of a checkpointed LoRA model are the ones without it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fastcov.trainer.runtime.lora import add_adapters
    from fastcov.trainer.runtime.model import PolicyModel
    from fastcov.trainer.runtime.offload import activation_offload

    cfg = load_config(TINY, [*LORA, "model.gradient_checkpointing=true", "trainer.offload_activations=true"])
    arch = {k: v for k, v in cfg.model.arch.items() if k != "model_type"}
    torch.manual_seed(0)
    lm = add_adapters(AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", vocab_size=50, **arch)),
                      cfg.model, torch.float32)
    for n, p in lm.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p)
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lm.train()
    policy = PolicyModel(lm)
    ids = torch.randint(0, 50, (2, 9))
    labels = ids.roll(-1, 1)
    grads = []
    for ctx in (activation_offload(False, torch.device("cpu")),
                activation_offload(True, torch.device("cpu"), force=True)):
        lm.zero_grad()
        made = ctx()
        assert isinstance(made, torch.autograd.graph.save_on_cpu) == (len(grads) == 1)  # the second pass offloads
        with made:
            out = policy(ids, torch.ones_like(ids), labels)
        (out.logprob.sum() + out.entropy.sum()).backward()
        grads.append({n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=0, atol=0)

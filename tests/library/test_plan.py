"""`fastcov plan` against hand computations (against a training process's measured peak memory:
tests/library/e2e/test_plan_e2e.py)."""

import json

import pytest

from fastcov.cli import main
from fastcov.plan import GIB, QWEN25, ModelShape, plan_memory


def test_parameter_counts_match_hand_computation():
    # Qwen2.5-7B by hand: per layer q,o 3584² each, k,v 3584·512 each, biases 3584+2·512,
    # MLP 3·3584·18944, two norms; untied embeddings 2·152064·3584; final norm.
    layer = 2 * 3584**2 + 2 * 3584 * 512 + (3584 + 1024) + 3 * 3584 * 18944 + 2 * 3584
    assert QWEN25["qwen2.5-7b"].num_parameters() == 28 * layer + 2 * 152064 * 3584 + 3584
    # published totals (billions): within 1.5%
    for name, billions in (("qwen2.5-0.5b", 0.49), ("qwen2.5-7b", 7.61), ("qwen2.5-32b", 32.5),
                           ("qwen2.5-72b", 72.7)):
        assert QWEN25[name].num_parameters() / 1e9 == pytest.approx(billions, rel=0.015)


def test_zero_stages_shard_what_they_should():
    model = QWEN25["qwen2.5-7b"]
    psi = model.num_parameters()
    plans = {s: plan_memory(model, gpus=8, tokens_per_gpu=16384, zero_stage=s) for s in range(4)}
    assert plans[0].optimizer_states == 12 * psi and plans[0].gradients == 2 * psi
    assert plans[1].optimizer_states == 12 * psi / 8 and plans[1].gradients == 2 * psi
    assert plans[2].gradients == 2 * psi / 8 and plans[2].parameters == 2 * psi
    assert plans[3].parameters == 2 * psi / 8


def test_logits_and_kv_cache_by_hand():
    model = QWEN25["qwen2.5-32b"]
    plan = plan_memory(model, gpus=32, tokens_per_gpu=20480, zero_stage=3, kv_tokens_per_gpu=10000)
    assert plan.logits_naive == 20480 * 152064 * 10
    assert plan.logits_fused == 20480 * 16 + 256 * 2**20  # O(T) statistics + the dZ workspace budget
    small = plan_memory(model, gpus=32, tokens_per_gpu=100, zero_stage=3, workspace_mb=256)
    assert small.logits_fused == 100 * 16 + 100 * 152064 * 2  # dZ never larger than the chunk itself
    assert plan.zero3_gathered == 2 * 152064 * 5120 * 2
    assert plan.rollout_kv_cache == 10000 * 2 * 64 * 8 * 128 * 2
    assert plan.activations == 64 * 20480 * 5120 * 2 + 20480 * (10 * 5120 + 4 * 27648) * 2


def test_fits_verdict_and_cli(tmp_path, capsys):
    assert main(["plan", "--model", "qwen2.5-7b", "--gpus", "8", "--tokens-per-gpu", "65536", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and not plan["fits_naive"]  # 64k-token logits alone are ~93 GiB naive
    assert plan["logits_naive"] / GIB > 80
    # a tiny GPU fits nothing: exit code 1
    assert main(["plan", "--model", "qwen2.5-32b", "--gpus", "1", "--tokens-per-gpu", "4096",
                 "--gpu-memory", "24"]) == 1
    assert "does NOT fit" in capsys.readouterr().out


def test_model_from_hf_config(tmp_path, capsys):
    config = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
              "tie_word_embeddings": True}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    shape = ModelShape.from_hf_config(config)
    assert shape.num_parameters() == 2 * (2 * 64 * 64 + 2 * 64 * 32 + 64 + 64 + 3 * 64 * 128 + 128) + 64000 + 64
    assert main(["plan", "--model", str(path), "--gpus", "1", "--tokens-per-gpu", "128"]) == 0
    assert str(path) in capsys.readouterr().out


@pytest.mark.parametrize("kwargs,match", [(dict(gpus=0), "gpus"), (dict(tokens_per_gpu=-1), "tokens_per_gpu"),
                                          (dict(zero_stage=4), "zero_stage"), (dict(gpu_memory_gib=0), "gpu_memory")])
def test_bad_arguments(kwargs, match):
    args = dict(gpus=8, tokens_per_gpu=1024, zero_stage=3)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        plan_memory(QWEN25["qwen2.5-7b"], **args)


def test_unknown_model_is_a_clear_error(capsys):
    assert main(["plan", "--model", "gpt-9", "--gpus", "1", "--tokens-per-gpu", "1"]) == 2
    assert "unknown preset 'gpt-9'" in capsys.readouterr().err


@pytest.mark.parametrize("spec", ["Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b"])
def test_a_hub_id_of_a_preset_plans_offline(spec, capsys):
    """`--config` mapped Qwen/Qwen2.5-7B to its preset and `--model` did not: both do now, without a download."""
    assert main(["plan", "--model", spec, "--gpus", "8", "--tokens-per-gpu", "4096", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["num_parameters"] == QWEN25["qwen2.5-7b"].num_parameters()


def test_a_model_directory_and_a_cached_hub_config(tmp_path, monkeypatch, capsys):
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    expected = ModelShape.from_hf_config(config).num_parameters()
    assert main(["plan", "--model", str(tmp_path / "model"), "--json"]) == 0  # a directory, as model.path takes
    assert json.loads(capsys.readouterr().out)["num_parameters"] == expected
    # any other Hub id: its config.json from the local Hugging Face cache, as a download would have left it
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a request would fail the test instead of hanging on no network
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert main(["plan", "--model", "org/tiny", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_parameters"] == expected
    assert main(["plan", "--model", "org/absent"]) == 2
    err = capsys.readouterr().err
    assert "not in the Hugging Face cache (plan never downloads)" in err and "hf download org/absent" in err
    (tmp_path / "empty").mkdir()
    assert main(["plan", "--model", str(tmp_path / "empty")]) == 2
    assert "directory without config.json" in capsys.readouterr().err


def test_what_plan_defaults(capsys):
    """--gpus and --tokens-per-gpu were 'required' although --help showed them optional; --zero's default 3 refused
    a 4-bit base."""
    assert main(["plan", "--model", "qwen2.5-0.5b", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["gpus"], plan["tokens_per_gpu"], plan["zero_stage"]) == (1, 8192, 0)
    assert main(["plan", "--gpus", "1", "--lora-rank", "16", "--quantization", "4bit", "--model", "qwen2.5-7b",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["zero_stage"] == 0
    assert main(["plan", "--model", "qwen2.5-7b", "--gpus", "4", "--lora-rank", "16", "--quantization", "4bit",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["zero_stage"] == 2
    assert main(["plan", "--model", "qwen2.5-7b", "--gpus", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["zero_stage"] == 3  # unchanged on several GPUs
    assert main(["plan", "--model", "qwen2.5-7b", "--gpus", "4", "--zero", "3", "--lora-rank", "16",
                 "--quantization", "4bit"]) == 2  # asked for explicitly: still refused, with the reason
    assert "zero_stage <= 2" in capsys.readouterr().err


def test_cli_accepts_the_deepspeed_launchers_local_rank(monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_RANK", "unset")  # monkeypatch restores the original environment afterwards
    monkeypatch.delenv("LOCAL_RANK")
    assert main(["--local_rank=3", "plan", "--model", "qwen2.5-0.5b", "--gpus", "1", "--tokens-per-gpu", "8"]) == 0
    import os

    assert os.environ["LOCAL_RANK"] == "3"
    assert "qwen2.5-0.5b" in capsys.readouterr().out


# ---------------------------------------------------------------- recipes as they would run

RECIPES = sorted(str(p) for p in __import__("pathlib").Path(__file__).resolve().parents[2].glob("configs/qwen2.5-*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.rsplit("/", 1)[-1])
def test_every_recipe_fits_one_8x80gb_node(path, capsys):
    """`fastcov plan --config` plans the recipe's own settings, and each recipe fits 8 x 80 GB; the 32B
    recipes leave 10 GB of headroom (≤ 70 GB per GPU)."""
    pytest.importorskip("yaml")
    from fastcov.plan import model_shape_of, plan_recipe
    from fastcov.trainer.config import load_config

    cfg = load_config(path, [])
    plan = plan_recipe(cfg, gpus=8)
    assert plan.zero_stage == cfg.trainer.zero_stage and plan.tokens_per_gpu == cfg.trainer.micro_token_budget
    assert (plan.host_optimizer_states > 0) == cfg.trainer.offload_optimizer
    assert plan.num_parameters == model_shape_of(cfg.model).num_parameters()
    if cfg.rollout.engine == "vllm":
        assert plan.rollout_weights == 2 * plan.num_parameters / cfg.rollout.vllm_tensor_parallel_size
    peak = max(plan.training_total, plan.rollout_total)
    assert plan.fits(), f"{path}: peak {peak / GIB:.1f} GiB"
    if "32b" in path:
        assert peak <= 70 * GIB, f"{path}: peak {peak / GIB:.1f} GiB"
    assert main(["plan", "--config", path]) == 0
    assert "peak" in capsys.readouterr().out


def test_plan_of_a_recipe_changes_with_it(tmp_path):
    """The plan follows the recipe: without the optimizer offload the 32B recipe no longer fits 8 GPUs."""
    pytest.importorskip("yaml")
    from fastcov.plan import plan_recipe
    from fastcov.trainer.config import load_config

    path = next(p for p in RECIPES if p.endswith("32b-kl-cov.yaml"))
    assert not plan_recipe(load_config(path, ["trainer.offload_optimizer=false"]), gpus=8).fits()
    assert plan_recipe(load_config(path, ["trainer.offload_optimizer=false"]), gpus=32).fits()
    hf = plan_recipe(load_config(path, ["rollout.engine=hf"]), gpus=8)
    assert hf.rollout_engine == "hf-copy" and hf.rollout_during_training == 2 * hf.num_parameters
    # the HF engine's KV cache: rollout.token_budget tokens, or with no budget every sequence sampled at once
    cfg = load_config(path, ["rollout.engine=hf"])
    per_token = hf.rollout_kv_cache / (cfg.trainer.prompts_per_step // 8 * cfg.rollout.n * 8
                                       * (cfg.data.max_prompt_len + cfg.rollout.max_new_tokens))
    budgeted = plan_recipe(load_config(path, ["rollout.engine=hf", "rollout.token_budget=65536"]), gpus=8)
    assert budgeted.rollout_kv_cache == pytest.approx(65536 * per_token)
    per_rank = plan_recipe(load_config(path, ["rollout.engine=hf", "rollout.hf_copies=rank"]), gpus=8)
    assert per_rank.rollout_kv_cache == pytest.approx(hf.rollout_kv_cache / 8)


# ----------------------------------------------------------------------------------------- LoRA, QLoRA, offload

def test_lora_terms_by_hand():
    from fastcov.plan import NF4_BYTES

    model = QWEN25["qwen2.5-7b"]
    h, kv, i, r = 3584, 512, 18944, 32
    per_layer = r * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + i) + (i + h))
    lora = 28 * per_layer
    assert model.lora_parameters(r) == lora
    psi = model.num_parameters()
    plan = plan_memory(model, gpus=1, tokens_per_gpu=4096, zero_stage=0, lora_rank=r)
    assert plan.trainable_parameters == lora
    assert plan.parameters == 2 * psi + 2 * lora  # frozen bf16 base + bf16 adapters
    assert plan.gradients == 2 * lora and plan.optimizer_states == 12 * lora  # only the adapters train
    linear = 28 * (h * h * 2 + h * kv * 2 + 3 * h * i)
    q = plan_memory(model, gpus=1, tokens_per_gpu=4096, zero_stage=0, lora_rank=r, quantization="4bit")
    assert q.parameters == NF4_BYTES * linear + 2 * (psi - linear) + 2 * lora
    assert q.parameters < 0.4 * plan.parameters
    full = plan_memory(model, gpus=1, tokens_per_gpu=4096, zero_stage=0)
    assert full.parameters == 2 * psi and full.trainable_parameters == psi  # lora_rank 0: as before


def test_activation_offload_moves_the_checkpoints_to_the_host():
    model = QWEN25["qwen2.5-7b"]
    on = plan_memory(model, gpus=1, tokens_per_gpu=8192, zero_stage=0, lora_rank=16, offload_activations=True)
    off = plan_memory(model, gpus=1, tokens_per_gpu=8192, zero_stage=0, lora_rank=16)
    assert on.host_activations == 28 * 8192 * 3584 * 2
    assert off.activations - on.activations == (28 - 2) * 8192 * 3584 * 2


@pytest.mark.parametrize("kwargs, match", [
    ({"lora_rank": -1}, "lora_rank"), ({"quantization": "4bit"}, "needs lora_rank"),
    ({"lora_rank": 8, "quantization": "3bit"}, "quantization"),
    ({"lora_rank": 8, "offload_activations": True, "gradient_checkpointing": False}, "needs checkpointing"),
])
def test_bad_lora_plans(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_memory(QWEN25["qwen2.5-7b"], gpus=1, tokens_per_gpu=1024, zero_stage=0, **kwargs)


def test_max_response_is_the_longest_that_fits():
    from fastcov.plan import max_response, plan_response

    model = QWEN25["qwen2.5-7b"]
    kw = {"lora_rank": 32, "quantization": "4bit"}
    best, plan = max_response(model, **kw)
    assert plan is not None and plan.fits() and plan.tokens_per_gpu == 512 + best
    assert not plan_response(model, best + 1, **kw).fits()
    assert plan.rollout_kv_cache == 8 * (512 + best) * 2 * 28 * 4 * 128 * 2  # 8 rollouts' KV cache
    assert max_response(model, lora_rank=32)[0] < best  # a bf16 base leaves less room than NF4
    assert max_response(QWEN25["qwen2.5-32b"], **kw)[0] < best
    assert max_response(QWEN25["qwen2.5-72b"], lora_rank=32)[0] == 0  # 145 GB of bf16 weights


def test_max_response_cli(capsys):
    assert main(["plan", "--model", "qwen2.5-7b", "--gpus", "1", "--lora-rank", "32", "--quantization", "4bit",
                 "--max-response"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("longest response on one 80 GiB GPU: ") and "x 8 rollouts per prompt" in out
    for term in ("parameters", "gradients", "optimizer states", "activations", "rollout KV cache"):
        assert term in out
    assert main(["plan", "--model", "qwen2.5-7b", "--gpus", "1", "--lora-rank", "32", "--max-response",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["max_response"] > 0 and data["rollouts"] == 8 and data["fits"]
    assert main(["plan", "--model", "qwen2.5-7b", "--gpus", "2", "--max-response"]) == 2
    assert "--max-response plans one GPU" in capsys.readouterr().err


def test_plan_of_a_lora_recipe_counts_the_adapters_only():
    from fastcov.plan import plan_recipe
    from fastcov.trainer.config import load_config

    cfg = load_config("configs/qwen2.5-7b-kl-cov-lora.yaml")
    plan = plan_recipe(cfg, gpus=1)
    assert cfg.model.lora_rank > 0 and plan.trainable_parameters == QWEN25["qwen2.5-7b"].lora_parameters(
        cfg.model.lora_rank)
    assert plan.fits()

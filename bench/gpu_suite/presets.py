"""What each part runs, per size: the parts' order and time caps, the correctness heads, the kernel
presets, the training overrides (bench/gpu_suite/__init__.py describes the parts)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PARTS_ORDER = ("correctness", "kernels", "train", "pytest", "extra", "vllm", "trainer", "memory")
RUN_ORDER = ("correctness", "kernels", "train", "pytest", "extra")  # --part all, and gpu_run.sh
SIZE_ALIASES = {"full": "full", "1.5b": "full", "smoke": "smoke", "tiny": "smoke", "rehearse": "rehearse"}
BAD_STATUSES = ("error", "fail", "timeout", "OOM")
GIB = 2**30
# Seconds each part may take (its subprocesses are stopped there), per size; the run's --budget bounds them all.
# "extra" starts only when its whole cap is left ("only if time remains").
PART_CAPS = {
    "full": {"correctness": 50, "kernels": 200, "train": 100, "pytest": 45, "extra": 120, "vllm": 400,
             "trainer": 420, "memory": 480},
    "smoke": {"correctness": 120, "kernels": 300, "train": 300, "pytest": 300, "extra": 300, "vllm": 300,
              "trainer": 300, "memory": 300},
    "rehearse": {"correctness": 40, "kernels": 60, "train": 60, "pytest": 60, "extra": 600, "vllm": 60,
                 "trainer": 300, "memory": 300},
}
NEEDS_WHOLE_CAP = ("extra",)
# the files `pytest -m gpu` runs (the GPU-marked tests; collecting all of tests/ costs ~20 s)
GPU_TEST_FILES = ("tests/kernels/test_linear_logprob_entropy.py", "tests/kernels/test_head_switches.py",
                  "tests/library/test_selection.py")
COMMIT_ENV = "FASTCOV_COMMIT"  # the commit id when the tree travels without .git
# (module, distribution) whose versions the environment record holds; null where not installed
PACKAGES = (("triton", "triton"), ("transformers", "transformers"), ("deepspeed", "deepspeed"),
            ("liger_kernel", "liger-kernel"), ("cut_cross_entropy", "cut-cross-entropy"), ("verl", "verl"),
            ("vllm", "vllm"), ("trl", "trl"), ("accelerate", "accelerate"), ("datasets", "datasets"),
            ("peft", "peft"), ("setuptools", "setuptools"), ("numpy", "numpy"), ("pyarrow", "pyarrow"))
# correctness_gpu per size: one argument list per head (7B, 32B); a few cases each, fastcov's Triton path
# with the naive bf16 path beside it
CORRECTNESS = {
    "full": [["--n", "4096", "--d", "3584", "--v", "152064", "--impls", "triton", "naive", "--temperatures", "1.0"],
             ["--n", "4096", "--d", "5120", "--v", "152064", "--impls", "triton", "naive", "--temperatures", "0.6",
              "--no-bias-case"]],
    "smoke": [["--n", "1024", "--d", "512", "--v", "32064", "--rows", "128", "--vocab-rows", "512"]],
    # float16: Triton 3.9's CPU interpreter returns garbage for the kernels in bfloat16 (fp16 and fp32 agree with
    # float64 to 2e-6); the bf16 path is the GPU's to check
    "rehearse": [["--n", "64", "--d", "32", "--v", "300", "--rows", "8", "--vocab-rows", "16", "--peaked-rows", "4",
                  "--chunk", "32", "--impls", "triton", "naive", "--temperatures", "1.0", "--dtype", "float16"],
                 ["--n", "48", "--d", "48", "--v", "200", "--rows", "8", "--vocab-rows", "16", "--peaked-rows", "4",
                  "--chunk", "16", "--impls", "triton", "naive", "--temperatures", "0.6", "--no-bias-case",
                  "--dtype", "float16"]],
}
# bench.kernels per size: (name, preset, extra options), in order
KERNEL_RUNS = {
    "full": [("fastcov", "gpu-run", ["--impls", "fastcov-triton", "naive"]),
             ("switches", "gpu-run-switches", []),
             ("peers", "gpu-run", ["--impls", "naive", "naive-compile", "liger", "cce", "verl"])],
    "smoke": [("smoke", "smoke", [])],
    "rehearse": [("fastcov", "rehearse", ["--impls", "fastcov-triton", "naive", "--isolate", "never"]),
                 ("peers", "rehearse", ["--impls", "naive", "liger", "cce", "verl", "--isolate", "never"])],
}
EXTRA_KERNELS = {"full": ("large", "gpu-run-large", []),
                 "smoke": ("large", "smoke", []), "rehearse": ("large", "rehearse", ["--isolate", "never"])}
COMPILE_REPORT = REPO / "bench" / "results" / "compile" / "fastcov.jsonl"
# the trainer: configs/tiny.yaml plus these (both sizes), then the size's own
TRAIN_CONFIG = REPO / "configs" / "tiny.yaml"
TRAIN_COMMON = ["trainer.eval_every=0", "trainer.save_every=0", "trainer.progress=false", "trainer.zero_stage=3",
                "reward.sandbox=inline", "rollout.engine=hf", "algo.adv_estimator=grpo", "algo.mode=kl_cov"]
QWEN25_15B_ARCH = ("{model_type: qwen2, hidden_size: 1536, intermediate_size: 8960, num_hidden_layers: 28, "
                   "num_attention_heads: 12, num_key_value_heads: 2, vocab_size: 151936, tie_word_embeddings: true, "
                   "max_position_embeddings: 4096, rope_theta: 1000000.0, rms_norm_eps: 1.0e-6}")
# Qwen2.5-1.5B's shape, random weights, the synthetic task; KL-Cov as configs/qwen2.5-7b-kl-cov.yaml has it.
# 32 prompts x 8 rollouts x up to 256 new tokens: one HF generation batch (token_budget), about 77k tokens per
# step in 16k-token micro-batches, two optimizer steps per rollout batch.
TRAIN_FULL = [f"model.arch={QWEN25_15B_ARCH}", "model.gradient_checkpointing=true", "data.synthetic.n_train=512",
              "trainer.prompts_per_step=32", "rollout.n=8", "rollout.max_new_tokens=256",
              "rollout.token_budget=131072", "trainer.micro_token_budget=16384", "algo.mini_batches=2",
              "algo.loss.kl_cov_ratio=2.0e-3", "algo.loss.kl_cov_coef=1.0", "algo.loss_agg=token-mean",
              "optim.lr=5.0e-7"]
TRAIN_SMOKE: list[str] = []  # tiny.yaml's model and batch as they are
# the extra part's training steps: the train part's run with the optimizer offloaded, then with LoRA adapters
TRAIN_EXTRA = {"offload": ["trainer.offload_optimizer=true"],
               "lora": ["model.lora_rank=16", "model.lora_alpha=32", "model.lora_dropout=0.0"],
               # the HF engine in its own process on the same GPU, generating while the policy trains (docs/async.md)
               "one_step": ["rollout.async=one_step"]}

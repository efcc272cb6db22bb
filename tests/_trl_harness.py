"""fastcov's FastcovGRPOTrainer against TRL 1.16's own GRPOTrainer on the same inputs, end to end.

The inputs both trainers get: a tiny Qwen2 built from a config, a char-level tokenizer and a digit-share reward
(CPU, offline). ``run`` trains one of them for ``STEPS`` plain-SGD steps on ``PROMPTS`` (``steps_per_generation=2``:
every second step is off-policy) and records every step's loss and every parameter's update; where ``use_vllm`` is
set, TRL's own transformers generation hands over ``sampler_logps`` as vLLM's log-probs (vLLM is never called).
``check`` asserts two such runs agree within what fp32 rounding of the loss's sums allows (tests/_agreement.py).

Used by tests/integrations/test_integration_trl*.py and their end-to-end half in tests/integrations/e2e/.
"""

from __future__ import annotations

import math

import torch
from _agreement import fp32_loss_tolerance, loss_term_scale

VOCAB = 160
SPECIAL = ["<pad>", "<eos>", "<unk>"]
PROMPTS = ["12+7=", "3*4=", "9-5=", "20/4="]
STEPS = 4
LR = 0.5


def tiny_tokenizer():
    """A char-level tokenizer of VOCAB ids: the specials, printable ASCII one token each, then fillers; left padding."""
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = [chr(c) for c in range(32, 127)]  # printable ASCII, one token each
    tokens = SPECIAL + chars + [f"<x{i}>" for i in range(VOCAB - len(SPECIAL) - len(chars))]
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left",
    )


def tiny_model(seed=0):
    """A tiny Qwen2 (2 layers, hidden 32, untied head, fp32, sdpa) with random weights from ``seed``."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=None,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).float()


def reward_digits(completions, **kwargs):
    """A verifiable-looking reward that varies across samples: the share of digits in the completion."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) + 0.01 * len(c) for c in completions]


def sampler_logps(ids: list[int]) -> list[float]:
    """A stand-in for vLLM's log-probs of the sampled tokens: near the tiny model's (≈ log 1/160), off by a
    deterministic few percent per token, so the importance ratios π_old / π_sampler spread around 1."""
    return [math.log(1 / 160) + 0.08 * math.sin(1.7 * tok + 0.9 * pos) for pos, tok in enumerate(ids)]


def recording_trainer(base, losses: list, scales: list | None = None):
    """``base`` (TRL's GRPOTrainer or fastcov's) that appends each step's loss to ``losses`` (and to ``scales`` its
    number of valid tokens and ``loss_term_scale``, what ``fp32_loss_tolerance`` needs) and, when TRL reads vLLM's
    log-probs (``trainer.use_vllm``), generates with transformers and hands over ``sampler_logps`` as the sampler's
    (vLLM itself is never called)."""

    class Recording(base):
        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
            self._recorded_logps = out[0]
            return out

        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)  # its log-probs are the last the method above saw
            losses.append(float(loss.detach()))
            if scales is not None:
                mask = inputs["completion_mask"]
                scales.append((int(mask.sum()), loss_term_scale(inputs["advantages"], self._recorded_logps, mask)))
            return loss

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, **kwargs):
            use_vllm, self.use_vllm = self.use_vllm, False  # TRL's transformers generation, then vLLM's log-probs
            try:
                ids, logps = super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                           **kwargs)
            finally:
                self.use_vllm = use_vllm
            return ids, ([sampler_logps(row) for row in ids] if use_vllm else logps)

    return Recording


def run(kind: str, out_dir: str, model, vllm: bool, options: dict, world: int = 1, trainer_cls=None) -> dict:
    """``STEPS`` plain-SGD steps of one trainer on ``PROMPTS`` from ``model`` (a saved model's directory, or a model),
    on this process's share of ``world`` processes (4 completions per prompt, 4 rows per step over all ranks).

    ``kind`` "trl" is TRL's GRPOTrainer with its GRPOConfig; any other kind runs ``trainer_cls`` (FastcovGRPOTrainer
    unless given) with FastcovGRPOConfig, fastcov_loss_mode "vanilla" unless ``options`` set it; ``kind`` also names the
    output folder under ``out_dir``. ``vllm``: TRL's vLLM branch is on for the rollout and the loss, with
    ``sampler_logps`` as the rollout's log-probs. ``options`` override the config's keys.

    Returns ``losses`` (each step's), ``scales`` (each step's valid tokens and term scale, what ``check`` reads),
    ``updates`` (every parameter's, fp32 tensors), ``spacing`` (each parameter's fp32 resolution) and ``logs`` (the
    logged ``sampling/``, ``fastcov/`` and ``aux_loss`` values)."""
    import datasets
    import trl

    from fastcov.integrations.trl import FastcovGRPOConfig, FastcovGRPOTrainer

    if kind == "trl":
        base, config_cls, extra = trl.GRPOTrainer, trl.GRPOConfig, {}
    else:
        base, config_cls = trainer_cls or FastcovGRPOTrainer, FastcovGRPOConfig
        extra = {"fastcov_loss_mode": options.get("fastcov_loss_mode", "vanilla")}
    losses: list[float] = []
    scales: list[tuple[int, float]] = []
    Recording = recording_trainer(base, losses, scales)
    kwargs = dict(
        output_dir=f"{out_dir}/{kind}", use_cpu=True, bf16=False, report_to="none", save_strategy="no", seed=0,
        max_steps=STEPS, logging_steps=1, learning_rate=LR, lr_scheduler_type="constant", optim="sgd",
        max_grad_norm=1e6, per_device_train_batch_size=4 // world, gradient_accumulation_steps=1,
        steps_per_generation=2, num_generations=4, max_completion_length=6, disable_tqdm=True,
        dataloader_num_workers=0, accelerator_config={"use_configured_state": world > 1},
    )
    args = config_cls(**{**kwargs, **options, **extra})
    trainer = Recording(model=model, reward_funcs=reward_digits, args=args, processing_class=tiny_tokenizer(),
                        train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}))
    trainer.use_vllm = vllm  # what TRL reads in its rollout and loss (vLLM itself is never called)
    params = dict(trainer.model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    trainer.train()
    updates = {n: params[n].detach() - before[n] for n in params}
    spacing = {n: 2.0 ** -23 * float(params[n].detach().abs().max()) for n in params}  # fp32 parameters' resolution
    logs = {k: v for row in trainer.state.log_history for k, v in row.items()
            if k.startswith(("sampling/", "fastcov/", "aux_loss"))}
    return dict(losses=losses, scales=scales, updates=updates, spacing=spacing, logs=logs)


def for_report(result: dict) -> dict:
    """``run``'s result with its updates as nested lists, for a rank's JSON report (tests/_dist.report_rank)."""
    return {**result, "updates": {n: u.tolist() for n, u in result["updates"].items()}}


def loss_tolerance(theirs: dict, step: int) -> float:
    """How far a loss may be from ``theirs`` at ``step`` (1-based): fp32 rounding of its sum over TRL's tokens."""
    tokens, scale = theirs["scales"][step - 1]
    return fp32_loss_tolerance(tokens, scale, step)


def check(ours: dict, theirs: dict, where) -> None:
    """Every step's loss and every parameter's update equal TRL's within what fp32 rounding of the loss's sums
    allows (``fp32_loss_tolerance``; TRL's tokens and term scale: both sides see the same batch). Updates may be
    tensors or, from a rank's report, lists."""
    assert len(theirs["losses"]) == STEPS, (where, theirs["losses"])
    assert len(theirs["scales"]) == len(theirs["losses"]), (where, theirs["scales"])
    for step, (a, b) in enumerate(zip(ours["losses"], theirs["losses"], strict=True), start=1):
        tol = loss_tolerance(theirs, step)
        assert abs(a - b) <= tol, (where, step, ours["losses"], theirs["losses"], abs(a - b), tol)
    # an update is lr × the sum of STEPS gradients, each a sum of a step's per-token terms: relative to the largest
    # update, the same STEPS·n·u as the loss, plus the fp32 parameters' spacing (the update is their difference)
    rel = fp32_loss_tolerance(max(n for n, _ in theirs["scales"]), 1.0, STEPS)
    moved = 0.0
    for name, update in theirs["updates"].items():
        a, b = torch.as_tensor(ours["updates"][name]), torch.as_tensor(update)
        tol = rel * float(b.abs().max()) + 4 * theirs["spacing"][name]
        assert float((a - b).abs().max()) <= tol, (where, name, float((a - b).abs().max()), tol)
        moved = max(moved, float(b.abs().max()))
    assert moved > 1e-4, (where, "nothing trained")

"""FastcovGRPOTrainer under DeepSpeed ZeRO-3 (2 CPU processes, gloo), against TRL's own GRPOTrainer under ZeRO-3.

Each rank runs, from the same saved tiny Qwen2 (untied head, then a head tied to the input embedding) and seed, two
SGD steps on one rollout batch with TRL's trainer, with fastcov's (vanilla mode, which equals TRL's loss), and with
fastcov's once more with DeepSpeed's on-the-fly discovery of externally read parameters switched off. The per-rank
losses of both steps must equal TRL's, and so must every parameter update: with plain SGD an update is -lr × the
reduced gradient, the LM head's included. Nothing is exempt from partitioning (no persistence threshold), so the fused
head only works on the gathered weight, and only its explicit registration gathers it when discovery is off.
"""

import os

import pytest
from _agreement import fp32_loss_tolerance
from _dist import free_port, read_rank_reports, report_rank, spawn_ranks

pytest.importorskip("trl")
pytest.importorskip("deepspeed")
pytest.importorskip("datasets")

WORLD = 2
LR = 0.5
PROMPTS = ["12+7=", "3*4=", "9-5=", "20/4="]


def _ds_config():
    return {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {
            "stage": 3, "stage3_param_persistence_threshold": 0,  # partition even the tiny model's head
            "stage3_prefetch_bucket_size": 0, "reduce_bucket_size": 1e6,
        },
    }


def _run(kind: str, model_dir: str, out_dir: str, discovery: bool = True, vllm: bool = False,
         options: dict | None = None):
    """Two SGD steps of TRL's trainer ("trl") or fastcov's ("fastcov") on one rollout batch. Returns the losses
    ``_compute_loss`` gave on this rank, the gathered parameters before and after, whether the head was partitioned
    and whether it was registered with the policy and the reference model before any forward.

    ``discovery=False`` switches off DeepSpeed's own discovery of parameters read outside their module's forward
    (``ZeROOrderedDict.__getitem__`` gathers and registers such a parameter on the fly): the head must then be
    gathered through its explicit registration alone, as with a DeepSpeed without that discovery.

    ``vllm=True``: the rollout returns the sampler's per-token log-probs beside the completions, as vLLM does
    (``_trl_harness.sampler_logps``), and TRL's vLLM branch is on for the loss, so its
    importance-sampling correction applies; ``options`` override the config's keys."""
    from collections import OrderedDict

    import datasets
    import deepspeed
    import trl
    from _trl_harness import recording_trainer, reward_digits, tiny_tokenizer
    from accelerate.state import AcceleratorState
    from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict

    from fastcov.integrations.trl import FastcovGRPOConfig, FastcovGRPOTrainer

    base_trainer, config_cls = (trl.GRPOTrainer, trl.GRPOConfig) if kind == "trl" else \
        (FastcovGRPOTrainer, FastcovGRPOConfig)
    losses: list[float] = []
    scales: list[tuple[int, float]] = []
    Recording = recording_trainer(base_trainer, losses, scales)

    extra = dict(fastcov_loss_mode="vanilla") if kind == "fastcov" else {}
    # steps_per_generation=2: TRL scores the old log-probs with the bare policy module (no DeepSpeed engine call)
    # and the second step's ratios differ from 1; beta > 0: the reference model runs the fused head too
    args = config_cls(**{**dict(
        output_dir=f"{out_dir}/{kind}", bf16=False, report_to="none", save_strategy="no", seed=0,
        max_steps=2, steps_per_generation=2, logging_steps=1, learning_rate=LR, lr_scheduler_type="constant",
        optim="sgd", max_grad_norm=1e6, per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
        temperature=0.7, beta=0.05, loss_type="dapo", disable_tqdm=True, dataloader_num_workers=0,
        deepspeed=_ds_config(), accelerator_config={"use_configured_state": True}), **(options or {}), **extra})
    AcceleratorState._reset_state()  # a new Accelerator with its DeepSpeed plugin; the gloo PartialState stays
    getitem = ZeROOrderedDict.__getitem__
    if not discovery:
        ZeROOrderedDict.__getitem__ = OrderedDict.__getitem__
    try:
        trainer = Recording(model=model_dir, reward_funcs=reward_digits, args=args,
                            train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}),
                            processing_class=tiny_tokenizer())
        trainer.use_vllm = vllm  # what TRL reads in its rollout and loss (vLLM itself is never called)
        model = trainer.model
        head = model.get_output_embeddings().weight
        ref_head = trainer.ref_model.module.get_output_embeddings().weight
        registered = [id(head) in getattr(model, "_external_params", {}),
                      id(ref_head) in getattr(trainer.ref_model.module, "_external_params", {})]
        partitioned = head.numel() == 0 and ref_head.numel() == 0 and head.ds_numel == ref_head.ds_numel > 0

        def gathered():
            with deepspeed.zero.GatheredParameters(list(model.parameters())):
                return {name: p.detach().clone() for name, p in model.named_parameters()}

        before = gathered()
        trainer.train()
        after = gathered()
    finally:
        ZeROOrderedDict.__getitem__ = getitem
    head_name = next(name for name, p in model.named_parameters() if p is head)  # embed_tokens.weight when tied
    ratios = [(row["sampling/importance_sampling_ratio/min"], row["sampling/importance_sampling_ratio/max"])
              for row in trainer.state.log_history if "sampling/importance_sampling_ratio/min" in row]
    return dict(losses=losses, scales=scales, before=before, after=after, partitioned=partitioned,
                registered=registered, head=head_name, is_ratio_range=ratios)


def _compare(ours: dict, trl: dict) -> dict:
    """Per-rank numbers of one fastcov run against TRL's run: losses, LM-head update and every parameter's."""
    head = ours["head"]
    update = {n: ours["after"][n] - ours["before"][n] for n in ours["after"]}
    trl_update = {n: trl["after"][n] - trl["before"][n] for n in trl["after"]}
    return dict(
        losses=ours["losses"], partitioned=ours["partitioned"], registered=ours["registered"],
        same_start=max(float((ours["before"][n] - trl["before"][n]).abs().max()) for n in update),
        head_update_norm=float(update[head].norm()), head_update_diff=float((update[head] - trl_update[head]).norm()),
        max_update_diff={n: float((update[n] - trl_update[n]).abs().max()) for n in update},
        max_update={n: float(trl_update[n].abs().max()) for n in update},
        # an update is a difference of fp32 parameters: it is only known to the parameters' spacing
        update_resolution={n: 2.0 ** -23 * float(trl["after"][n].abs().max()) for n in update},
    )


# GSPO (sequence-level ratio) with TRL's vLLM importance-sampling correction at token level (truncated to a band
# the sampler's log-probs leave, so it acts) and the off-policy mask; and VESPO, which folds the ratio into its own
CORRECTION_CASES = {
    "gspo_is": dict(importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-3, epsilon_high=4e-3,
                    vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=1.04,
                    vllm_importance_sampling_clip_min=0.96, off_policy_mask_threshold=0.01),
    "vespo_is": dict(loss_type="vespo", vllm_importance_sampling_mode="token_truncate",
                     vllm_importance_sampling_clip_max=1.04, vllm_importance_sampling_clip_min=0.96),
}


def _two_process_body(model_dirs: dict, out_dir: str, correction: bool = False) -> dict:
    """One rank (run by ``report_rank``): per model (or, with ``correction``, per correction case) TRL's run and
    fastcov's compared with it."""
    from accelerate import PartialState

    result: dict = {}
    # transformers hands accelerate no backend under DeepSpeed, and without CUDA accelerate then counts one
    # process: configure the state once with gloo, and let every trainer use it (use_configured_state)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    from fastcov.trainer.runtime.extensions import skip_shm_comm_op

    skip_shm_comm_op()  # gloo does the work: no JIT build of DeepSpeed's shm op (its lock races other jobs')
    PartialState(backend="gloo")
    if correction:  # each case: TRL's and fastcov's run on the untied model
        for case, options in CORRECTION_CASES.items():
            trl_run = _run("trl", model_dirs["untied"], out_dir, vllm=True, options=options)
            head = trl_run["head"]
            result[case] = dict(
                trl=dict(losses=trl_run["losses"], scales=trl_run["scales"], partitioned=trl_run["partitioned"], head=head,
                         is_ratio_range=trl_run["is_ratio_range"],
                         head_update_norm=float((trl_run["after"][head] - trl_run["before"][head]).norm())),
                fastcov=_compare(_run("fastcov", model_dirs["untied"], out_dir, vllm=True, options=options),
                                 trl_run))
        return result
    for model_kind, model_dir in model_dirs.items():
        trl_run = _run("trl", model_dir, out_dir)
        head = trl_run["head"]
        result[model_kind] = dict(
            trl=dict(losses=trl_run["losses"], scales=trl_run["scales"], partitioned=trl_run["partitioned"], head=head,
                     head_update_norm=float((trl_run["after"][head] - trl_run["before"][head]).norm())),
            fastcov=_compare(_run("fastcov", model_dir, out_dir), trl_run),
            fastcov_no_discovery=_compare(_run("fastcov", model_dir, out_dir, discovery=False), trl_run),
        )
    return result


def _check_against_trl(ours: dict, trl: dict, where) -> None:
    assert ours["partitioned"] and ours["registered"] == [True, True], (where, ours)
    assert ours["same_start"] == 0.0, where
    assert len(ours["losses"]) == len(trl["losses"]) == len(trl["scales"]), where
    for step, (a, b, (tokens, scale)) in enumerate(zip(ours["losses"], trl["losses"], trl["scales"], strict=True),
                                                   start=1):
        tol = fp32_loss_tolerance(tokens, scale, step)  # this rank's share of the mean: its own tokens' terms
        assert abs(a - b) <= tol, (where, step, ours["losses"], trl["losses"], tol)
    # SGD: each update is -lr × the reduced gradient, so equal updates mean equal gradients at both steps; a
    # gradient sums the per-token terms of both ranks: relative to the update, the loss's n·u per step
    rel = fp32_loss_tolerance(WORLD * max(n for n, _ in trl["scales"]), 1.0, len(trl["losses"]))
    assert ours["head_update_diff"] <= rel * trl["head_update_norm"], (where, ours, rel)
    for name, diff in ours["max_update_diff"].items():
        tol = rel * ours["max_update"][name] + ours["update_resolution"][name]
        assert diff <= tol, (where, name, diff, tol)


@pytest.mark.slow
def test_zero3_rollout_correction_gspo_and_vespo_equal_trl(tmp_path):
    """TRL's vLLM importance-sampling correction with GSPO (+ the off-policy mask) and with VESPO, under ZeRO-3 on
    2 processes: per-rank losses and parameter updates equal TRL's GRPOTrainer's."""
    from _trl_harness import tiny_model

    model_dirs = {"untied": str(tmp_path / "untied")}
    tiny_model().save_pretrained(model_dirs["untied"])
    spawn_ranks(report_rank, (WORLD, free_port(), str(tmp_path), _two_process_body, model_dirs, str(tmp_path), True),
                WORLD)
    for rank, res in enumerate(read_rank_reports(tmp_path, WORLD)):
        for case in CORRECTION_CASES:
            trl = res[case]["trl"]
            assert trl["partitioned"] and len(trl["losses"]) == 2, (case, trl)
            # the correction's band acts: some ratio is truncated to one of its ends
            assert any(low == pytest.approx(0.96) or high == pytest.approx(1.04)
                       for low, high in trl["is_ratio_range"]), (case, trl)
            assert trl["head_update_norm"] > 1e-3, (case, trl)
            _check_against_trl(res[case]["fastcov"], trl, (case, rank))


@pytest.mark.slow
def test_zero3_loss_and_update_equal_trl(tmp_path):
    from _trl_harness import tiny_model

    model_dirs = {}
    for model_kind, tied in (("untied", False), ("tied", True)):  # tied: the head is the input embedding
        model = tiny_model()
        if tied:
            model.config.tie_word_embeddings = True
            model.tie_weights()
        assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
        model_dirs[model_kind] = str(tmp_path / model_kind)
        model.save_pretrained(model_dirs[model_kind])
    spawn_ranks(report_rank, (WORLD, free_port(), str(tmp_path), _two_process_body, model_dirs, str(tmp_path)), WORLD)
    for rank, res in enumerate(read_rank_reports(tmp_path, WORLD)):
        for model_kind in model_dirs:
            trl = res[model_kind]["trl"]
            assert trl["partitioned"], "ZeRO-3 should partition the tiny model's head"
            assert trl["head"] == ("model.embed_tokens.weight" if model_kind == "tied" else "lm_head.weight")
            assert len(trl["losses"]) == 2 and abs(trl["losses"][1]) > 1e-3, trl
            assert trl["head_update_norm"] > 1e-3
            for run in ("fastcov", "fastcov_no_discovery"):
                _check_against_trl(res[model_kind][run], trl, (model_kind, run, rank))

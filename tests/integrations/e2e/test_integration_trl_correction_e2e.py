"""TRL's rollout correction in FastcovGRPOTrainer against TRL 1.16's own GRPOTrainer on 2 processes (gloo): GSPO
with the token-level vLLM ratio and the off-policy mask give each rank the same losses and every parameter the same
update (tests/_trl_harness.py runs and compares both; every option on one process:
tests/integrations/test_integration_trl_correction.py)."""

import pytest
from _dist import free_port, read_rank_reports, report_rank, spawn_ranks
from _trl_harness import STEPS, check, for_report, run, tiny_model

pytest.importorskip("trl")
pytest.importorskip("datasets")

WORLD = 2
# test_integration_trl_correction.py's "gspo" case (GSPO with the token-level vLLM ratio, truncated to a band the
# sampler's log-probs leave) with the off-policy mask as well
OPTIONS = dict(importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-3, epsilon_high=4e-3,
               vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=1.04,
               vllm_importance_sampling_clip_min=0.96, off_policy_mask_threshold=0.01)


def _two_process_body(model_dir: str, out_dir: str, world: int) -> dict:
    """One rank of the 2-process case (run by ``report_rank``): TRL's run, then fastcov's."""
    from accelerate import PartialState

    PartialState(backend="gloo", cpu=True)
    return {kind: for_report(run(kind, out_dir, model_dir, True, OPTIONS, world=world))
            for kind in ("trl", "fastcov")}


@pytest.mark.slow
def test_gspo_vllm_ratio_and_off_policy_mask_equal_trl_on_two_processes(tmp_path):
    model_dir = str(tmp_path / "model")
    tiny_model().save_pretrained(model_dir)
    spawn_ranks(report_rank, (WORLD, free_port(), str(tmp_path), _two_process_body, model_dir, str(tmp_path), WORLD),
                WORLD)
    for rank, res in enumerate(read_rank_reports(tmp_path, WORLD)):
        # a rank's loss is its share of a global mean that can cancel to near 0: the terms' scale sets the bound
        check(res["fastcov"], res["trl"], f"rank {rank}")
        assert sum(loss != 0.0 for loss in res["trl"]["losses"]) >= STEPS // 2, res["trl"]["losses"]  # not all masked

"""Rollout engines (``fastcov.trainer.rollout``): the interface the loop talks to (base.py), the built-in
Hugging Face engine (hf.py; as the trainer builds it, one copy per node under ZeRO-3: node.py) and vLLM
(``vllm_*.py``; vLLM itself is imported only when its engine is built). ``make_rollout_engine`` builds the
engine ``rollout.engine`` names through ``ROLLOUT_ENGINES``, where each engine module registers itself.

May import: ``fastcov.*`` (not the CLI), ``fastcov.trainer.runtime.*`` and each other; never the loop,
the config, rewards or experiments (docs/design.md, checked by tests/project/test_architecture.py).
"""

from fastcov.trainer.rollout.base import (
    ROLLOUT_ENGINES,
    RolloutBatch,
    RolloutEngine,
    SamplingParams,
    finish_rollouts,
    make_rollout_engine,
    split_evenly,
)
from fastcov.trainer.rollout.hf import HFRolloutEngine, kv_cache_argument, sample_next, token_budget_batches
from fastcov.trainer.rollout.node import NodeRolloutEngine, make_hf_engine, node_group, rollout_copy
from fastcov.trainer.rollout.vllm_factory import make_vllm_engine

__all__ = [
    "ROLLOUT_ENGINES", "HFRolloutEngine", "NodeRolloutEngine", "RolloutBatch", "RolloutEngine", "SamplingParams",
    "finish_rollouts", "kv_cache_argument", "make_hf_engine", "make_rollout_engine", "make_vllm_engine",
    "node_group", "rollout_copy", "sample_next", "split_evenly", "token_budget_batches",
]

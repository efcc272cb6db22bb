"""fastcov's top level (docs/api.md): at most 15 names, each without a warning; every name exported in 0.4 is still
there or resolves, from its new home, to the same object with one FutureWarning naming that home (``fastcov.NAME``
and ``from fastcov import NAME`` alike), and the same for what left ``fastcov.dynamics``. That nothing in the
repository uses an old path is tests/project/test_library_surface.py."""

from __future__ import annotations

import importlib
import re
import types
import warnings

import pytest

import fastcov
import fastcov.dynamics
from fastcov._moved import moved_attribute

# fastcov.__all__ of 0.4.0, the last release before the library was put on one level
ALL_0_4 = (
    "LogprobEntropy", "linear_logprob_entropy", "logprob_entropy_from_logits", "LossConfig", "Selection",
    "aggregate_loss", "available_modes", "compute_global_selection", "get_policy_loss", "policy_loss",
    "register_policy_loss", "rollout_correction", "rollout_rejection", "off_policy_sequence_mask", "mismatch_metrics",
    "correction", "policy_modes", "token_covariance", "token_covariance_and_keys", "select_top_covariance",
    "select_random_in_band", "get_advantage", "register_advantage", "grpo", "dr_grpo", "rloo", "reinforce_pp",
    "dapo_filter", "broadcast_to_tokens", "entropy_advantage", "PositiveWeightSchedule", "EntropyController",
    "all_rank_entropy", "EntropyLaw", "fit_entropy_law", "predicted_entropy_change", "TabularProblem",
    "DynamicsConfig", "DynamicsRun", "simulate", "advantages", "losses", "metrics", "selection", "token_advantages",
)
# fastcov.dynamics.__all__ of 0.4.0
DYNAMICS_0_4 = (
    "TabularProblem", "DynamicsConfig", "DynamicsRun", "policy_entropy", "logprob_covariance",
    "predicted_entropy_change", "policy_gradient_step", "grpo_advantages", "simulate", "compare_methods", "plot_runs",
    "TABULAR_LOSS_OVERRIDES",
)


def test_the_top_level_is_short_and_warns_for_none_of_its_names():
    assert len(fastcov.__all__) <= 15 and len(set(fastcov.__all__)) == len(fastcov.__all__)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in fastcov.__all__:
            assert getattr(fastcov, name) is not None
        namespace: dict = {}
        exec("from fastcov import *", namespace)
    assert set(fastcov.__all__) <= set(namespace)
    assert not set(fastcov.__all__) & set(fastcov._MOVED)


def test_every_name_of_0_4_is_exported_a_module_or_moved():
    modules = {name for name in ALL_0_4 if isinstance(vars(fastcov).get(name), types.ModuleType)}
    assert modules == {"correction", "policy_modes", "advantages", "losses", "metrics", "selection", "token_advantages"}
    new_in_0_5 = {"VocabParallel"}  # the vocabulary-parallel head's options (issue 59)
    assert set(ALL_0_4) - modules == (set(fastcov.__all__) - new_in_0_5) | set(fastcov._MOVED)
    kept_in_dynamics = set(fastcov.dynamics.__all__) & set(DYNAMICS_0_4)
    assert set(DYNAMICS_0_4) - kept_in_dynamics <= set(fastcov.dynamics._MOVED)


def _one_warning(record, home: str, old: str) -> None:
    warned = [w for w in record if issubclass(w.category, FutureWarning)]
    assert {str(w.message) for w in warned} == {f"{old} is deprecated: use {home}"}
    assert all(w.filename == __file__ for w in warned)  # attributed to the line that used the old name


@pytest.mark.parametrize("name", sorted(fastcov._MOVED))
def test_a_name_that_left_the_top_level_still_works_and_names_its_home(name):
    home = fastcov._MOVED[name]
    owner = importlib.import_module(home)
    with pytest.warns(FutureWarning, match=re.escape(f"fastcov.{name} is deprecated: use {home}.{name}")) as record:
        obj = getattr(fastcov, name)
    assert obj is getattr(owner, name)
    _one_warning(record, f"{home}.{name}", f"fastcov.{name}")
    namespace: dict = {}
    with pytest.warns(FutureWarning) as record:
        exec(compile(f"from fastcov import {name}", __file__, "exec"), namespace)
    assert namespace[name] is obj
    _one_warning(record, f"{home}.{name}", f"fastcov.{name}")


@pytest.mark.parametrize("name", sorted(fastcov.dynamics._MOVED))
def test_the_simulators_names_still_work_from_fastcov_dynamics(name):
    home = fastcov.dynamics._MOVED[name]
    with pytest.warns(FutureWarning, match=re.escape(f"fastcov.dynamics.{name} is deprecated: use {home}.{name}")):
        obj = getattr(fastcov.dynamics, name)
    assert obj is getattr(importlib.import_module(home), name)


def test_an_unknown_name_is_still_an_attribute_error():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not hasattr(fastcov, "no_such_name") and not hasattr(fastcov.dynamics, "simulatee")
        with pytest.raises(ImportError, match="cannot import name 'no_such_name'"):
            exec("from fastcov import no_such_name", {})


def test_a_home_outside_an_installed_fastcov_says_where_it_went():
    """In a wheel there is no bench/: the simulator's old names say where it is instead of returning it."""
    with pytest.warns(FutureWarning), pytest.raises(AttributeError, match=r"moved out of the library to "
                                                    r"no_bench\.sim\.simulate, the repository's no_bench/sim\.py"):
        moved_attribute("fastcov", "simulate", {"simulate": "no_bench.sim"})

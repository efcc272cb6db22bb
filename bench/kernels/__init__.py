"""The kernel benchmark, ``python -m bench.kernels`` (usage: bench/kernels/cli.py, bench/README.md), in five
modules: ``presets`` (what a preset runs; ``CaseSpec``, one shape), ``case`` (one case), ``measure`` (one preset),
``render`` (the results files) and ``cli`` (the command line). The names other code uses are here."""

from bench.kernels.case import floor_calls, run_shape, run_shape_isolated, shape_autotune_picks
from bench.kernels.cli import build_parser, main
from bench.kernels.measure import run_preset
from bench.kernels.presets import PRESET_ALIASES, PRESETS, CaseSpec
from bench.kernels.render import case_line, jsonl_path, read_jsonl, render_jsonl_md, render_md, write_results

__all__ = ["PRESETS", "PRESET_ALIASES", "CaseSpec", "build_parser", "case_line", "floor_calls", "jsonl_path", "main",
           "read_jsonl", "render_jsonl_md", "render_md", "run_preset", "run_shape", "run_shape_isolated",
           "shape_autotune_picks", "write_results"]

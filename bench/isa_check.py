"""Does the demo depend on the CPU it runs on? Shake out ISA dependence on whatever machine you have.

Runs the demo's first computation (the synthetic task, then ``--steps`` steps of the supervised warm-start on one
thread) in a fresh process per variant of the environment variables through which the math libraries pick their
code paths, and prints a hash of the data and of the trained weights for each:

* ``pinned``: the demo's own pins (``trainer/experiments/demo.py``, REPRODUCIBLE_CPU_ENV);
* ``pinned, MKL as without AVX-512`` / ``... without AVX2``: MKL_ENABLE_INSTRUCTIONS lowers the instruction set
  MKL may use, as a CPU without them would;
* ``pinned, oneDNN with AMX``, ``pinned, NumPy without AVX-512``: the other libraries' switches;
* ``old pins (MKL_CBWR=AVX2)``, with and without AVX2 for MKL: why the pins changed (MKL's AVX2 branch exists on
  Intel CPUs only; elsewhere MKL falls back to its own dispatch without a word);
* ``native``: nothing pinned (informational: the numbers this CPU gives with its widest paths).

Every ``pinned`` variant must give the same weights: the command exits 1 when they do not. A variant that can only
lower a switch (e.g. MKL_ENABLE_INSTRUCTIONS=AVX512 on a CPU without AVX-512) is still run; it then equals
``pinned`` trivially. docs/reproducibility.md says what it found.

    python -m bench.isa_check [--steps 40] [--variants "pinned; native"]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

PIN_KEYS = ("MKL_CBWR", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
            "NPY_DISABLE_CPU_FEATURES", "FASTCOV_NATIVE_CPU")
NUMPY_AVX512 = "AVX512F,AVX512CD,AVX512_SKX,AVX512_CLX,AVX512_CNL,AVX512_ICL,AVX512_SPR"


def variants() -> dict[str, dict[str, str]]:
    """Name -> the environment variables set for that run (on top of an environment with none of PIN_KEYS)."""
    from fastcov.trainer.experiments.demo import REPRODUCIBLE_CPU_ENV

    pinned = dict(REPRODUCIBLE_CPU_ENV)
    old = {**pinned, "MKL_CBWR": "AVX2"}
    return {
        "pinned": pinned,
        "pinned, MKL as without AVX-512": {**pinned, "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
        "pinned, MKL as without AVX2": {**pinned, "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
        "pinned, oneDNN with AMX": {**pinned, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"},
        "pinned, NumPy without AVX-512": {**pinned, "NPY_DISABLE_CPU_FEATURES": NUMPY_AVX512},
        "old pins (MKL_CBWR=AVX2)": old,
        "old pins, MKL as without AVX2": {**old, "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
        "native": {},
    }


WORKER = r"""
import hashlib, json, sys, tempfile
from pathlib import Path
import torch
from fastcov.trainer.experiments import demo
steps = int(sys.argv[1])
out = Path(tempfile.mkdtemp(prefix="isa-check-"))
demo.write_task(out / "data", 2000, demo.N_VAL, demo.MAX_OPS, demo.MAX_VALUE, seed=0)
data = hashlib.sha256(b"".join(p.read_bytes() for p in sorted((out / "data").glob("*.parquet")))).hexdigest()
result = demo.warm_start(out / "sft", out / "data", demo.SFTConfig(steps=steps), demo.MAX_OPS, demo.MAX_VALUE)
from safetensors.torch import load_file
state = load_file(str(out / "sft" / "model" / "model.safetensors"))
weights = hashlib.sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state))).hexdigest()
print(json.dumps({"aten": torch.backends.cpu.get_cpu_capability(), "data": data[:12], "weights": weights[:12],
                  "loss": result["sft_loss"]}))
"""


def run_variant(env_vars: dict[str, str], steps: int) -> dict:
    """One variant in a fresh process (the libraries read these variables when they load)."""
    env = {k: v for k, v in os.environ.items() if k not in PIN_KEYS}
    env.update(env_vars)
    env["FASTCOV_NATIVE_CPU"] = "1"  # nothing re-executes behind our back
    env.setdefault("DS_ACCELERATOR", "cpu")
    proc = subprocess.run([sys.executable, "-c", WORKER, str(steps)], capture_output=True, text=True, env=env,
                          timeout=1800)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"isa_check: variant {env_vars} failed: {tail[0]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check(steps: int, names: list[str] | None = None) -> tuple[dict[str, dict], bool]:
    """Run the variants (all, or ``names``); returns (results by name, whether every pinned variant agrees)."""
    todo = variants()
    if names:
        unknown = sorted(set(names) - set(todo))
        if unknown:
            raise ValueError(f"--variants: unknown {unknown}; known: {sorted(todo)}")
        todo = {n: todo[n] for n in names}
    results = {}
    for name, env_vars in todo.items():
        results[name] = run_variant(env_vars, steps)
        print(f"{name:34s} ATen {results[name]['aten']:7s} data {results[name]['data']} "
              f"weights {results[name]['weights']}  loss {results[name]['loss']!r}", flush=True)
    pinned = {r["weights"] for n, r in results.items() if n.startswith("pinned")}
    return results, len(pinned) <= 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.isa_check", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40, help="warm-start steps per variant (the demo runs 300)")
    ap.add_argument("--variants", default="", help="variant names separated by \";\" (default: all)")
    args = ap.parse_args(argv)
    from fastcov.trainer.experiments.demo import cpu_model

    print(f"CPU: {cpu_model()}; {args.steps} warm-start steps per variant", flush=True)
    _, same = check(args.steps, [v.strip() for v in args.variants.split(";") if v.strip()] or None)
    print("pinned variants agree: the demo does not depend on these switches on this CPU" if same else
          "pinned variants DIFFER: a library still picks its code path by CPU despite the pins")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

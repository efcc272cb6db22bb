"""The kernel benchmark's presets (named sets of shapes, implementations and repeats) and the typed spec of
one case: what ``python -m bench.kernels --preset NAME`` runs, shape by shape."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

import torch

from bench.peers import DEFAULT_IMPLS

# Every benchmark row has a valid label: ignore_index handling is tested in tests/, not timed here.
CHECK_ROWS = 32

# A preset is a list of groups; a group is one (D, V) with its token counts.
PRESETS: dict[str, dict] = {
    "cpu-small": {
        # one intra-op thread: on a shared 2-core box a second OpenMP thread makes every parallel
        # region wait for whichever thread the OS descheduled, which hits many-small-op code (the
        # chunked twin) far harder than few-big-op code (naive) and scrambles the ratios.
        "device": "cpu", "dtype": "float32", "warmup": 1, "repeats": 3, "threads": 1,
        "groups": [
            {"name": "main", "d": 256, "v": 16384, "ns": [512, 2048]},
            {"name": "interpreter", "d": 32, "v": 500, "ns": [32], "interpret": True,
             "impls": ["naive", "fastcov-torch", "fastcov-triton"], "warmup": 0, "repeats": 1,
             "note": "fastcov-triton under TRITON_INTERPRET=1 (a numpy emulation): it shows the "
                     "kernels run; its times say nothing about GPU speed"},
        ],
    },
    # the twin against Cut Cross-Entropy's torch_compile path on CPU (issue 31): fp32, the shape
    "cpu-cce": {
        "device": "cpu", "dtype": "float32", "warmup": 1, "repeats": 3, "threads": 2,
        "impls": ["naive", "fastcov-torch", "fastcov-torch-logprob", "cce-torch-compile"],
        "groups": [{"name": "cce-shape", "d": 256, "v": 65536, "ns": [4096]}],
    },
    "qwen2.5-7b": {
        "device": "cuda", "dtype": "bfloat16", "warmup": 3, "repeats": 10,
        "groups": [{"name": "qwen2.5-7b", "d": 3584, "v": 152064, "ns": [4096, 16384, 65536]}],
    },
    "qwen2.5-32b": {
        "device": "cuda", "dtype": "bfloat16", "warmup": 3, "repeats": 10,
        "groups": [{"name": "qwen2.5-32b", "d": 5120, "v": 152064, "ns": [4096, 16384, 65536]}],
    },
    # The GPU run of the kernel issue: both Qwen2.5 heads, bf16, every peer, the cuBLAS floor, one
    # JSON line per case as it finishes; sized to stay under 8 minutes on one H100.
    "h100": {
        "device": "cuda", "dtype": "bfloat16", "warmup": 2, "repeats": 5,
        "impls": ["naive", "naive-compile", "fastcov-triton", "liger", "liger-entropy", "cce", "verl"],
        "groups": [
            {"name": "qwen2.5-7b", "d": 3584, "v": 152064, "ns": [4096, 16384, 65536]},
            {"name": "qwen2.5-32b", "d": 5120, "v": 152064, "ns": [16384, 65536]},
        ],
    },
    # The one-call GPU run (bench/gpu_run.sh): both heads at N 4096 and 16384, fastcov's Triton path beside
    # naive, compiled naive, Liger, CCE and verl; 4 shapes x 2 grad modes = 8 compiled graphs.
    "gpu-run": {
        "device": "cuda", "dtype": "bfloat16", "warmup": 2, "repeats": 5,
        "impls": ["fastcov-triton", "naive", "naive-compile", "liger", "cce", "verl"],
        "groups": [
            {"name": "qwen2.5-7b", "d": 3584, "v": 152064, "ns": [4096, 16384]},
            {"name": "qwen2.5-32b", "d": 5120, "v": 152064, "ns": [4096, 16384]},
        ],
    },
    # The switches of issue 59 in the one-call GPU run: each beside the base call at the 7B head, N 16384, and at
    # Liger's CuTe anchor shape (D 4096, V 131072, 16K tokens, fwd+bwd with entropy: Liger reports 103.65 ms on an
    # H100) beside Liger's own entropy-returning path
    "gpu-run-switches": {
        "device": "cuda", "dtype": "bfloat16", "warmup": 2, "repeats": 5,
        "impls": ["fastcov-triton", "fastcov-triton-sum-p2", "fastcov-triton-temperature", "fastcov-triton-softcap",
                  "liger-entropy"],
        "groups": [
            {"name": "liger-anchor", "d": 4096, "v": 131072, "ns": [16384]},
            {"name": "qwen2.5-7b", "d": 3584, "v": 152064, "ns": [16384],
             "impls": ["fastcov-triton", "fastcov-triton-sum-p2", "fastcov-triton-temperature",
                       "fastcov-triton-softcap"]},
        ],
    },
    # what gpu_run.sh adds only when time is left: N 65536 (naive OOMs there on 80 GB; recorded as OOM)
    "gpu-run-large": {
        "device": "cuda", "dtype": "bfloat16", "warmup": 1, "repeats": 3,
        "impls": ["fastcov-triton", "naive", "liger", "cce", "verl"],
        "groups": [
            {"name": "qwen2.5-7b", "d": 3584, "v": 152064, "ns": [65536]},
            {"name": "qwen2.5-32b", "d": 5120, "v": 152064, "ns": [65536]},
        ],
    },
    # gpu_run.sh --rehearse on CPU: the run's two head groups at toy sizes, fastcov's Triton path under the
    # interpreter (the rehearsal exports TRITON_INTERPRET=1), the peers recorded as unavailable without CUDA
    "rehearse": {
        "device": "cpu", "dtype": "float32", "warmup": 0, "repeats": 1, "threads": 1,
        "impls": ["fastcov-triton", "naive", "liger", "cce", "verl"],
        "groups": [
            {"name": "tiny-7b", "d": 32, "v": 500, "ns": [32]},
            {"name": "tiny-32b", "d": 48, "v": 500, "ns": [32]},
        ],
    },
    # a seconds-long run for the smoke test
    "smoke": {
        "device": "auto", "dtype": "float32", "warmup": 1, "repeats": 2,
        "groups": [{"name": "smoke", "d": 64, "v": 1000, "ns": [128]}],
    },
}
PRESET_ALIASES = {"gpu": ["qwen2.5-7b", "qwen2.5-32b"]}


@dataclass(frozen=True)
class CaseSpec:
    """One shape of a run, as measured in one process: the shape, its dtype and device, the implementations
    (``impls``) and how to time them. It travels to an isolated case process as JSON (``to_json``).

    mode: "time" (timing only), "memory" (peak memory + the float64 check only) or "all".
    interleave: time the implementations round-robin, one call each per round, so that a shared machine's
    load drifts into all of them alike (the CPU default); otherwise one implementation after the other,
    ``warmup`` then ``repeats`` calls each (the CUDA default).
    """

    group: str
    n: int
    d: int
    v: int
    dtype: str
    device: str
    warmup: int
    repeats: int
    temperature: float = 1.0
    seed: int = 0
    impls: tuple[str, ...] = ()
    mode: str = "all"
    interpret: bool = False
    interleave: bool = False
    threads: int = 0
    verbose: bool = False
    check_rows: int = CHECK_ROWS

    @property
    def where(self) -> str:
        return f"{self.group} N={self.n}"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def with_(self, **changes) -> CaseSpec:
        """A copy with ``changes`` (``impls`` as a tuple)."""
        if "impls" in changes:
            changes["impls"] = tuple(changes["impls"])
        return replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> CaseSpec:
        fields = json.loads(text)
        return cls(**{**fields, "impls": tuple(fields.get("impls", ()))})


@dataclass(frozen=True)
class PlannedShape:
    """One shape of a preset's group as run: command-line overrides applied."""

    group: str
    n: int
    d: int
    v: int
    impls: list[str] = field(default_factory=list)
    warmup: int = 0
    repeats: int = 1
    interpret: bool = False


def resolve_presets(name: str) -> list[str]:
    return PRESET_ALIASES.get(name, [name])


def plan_groups(preset: dict, args, device: torch.device, dtype_name: str) -> tuple[list[dict], list[PlannedShape]]:
    """The preset's groups as run (command-line overrides applied) and one ``PlannedShape`` per shape."""
    groups_out, plan = [], []
    for grp in preset["groups"]:
        interp = bool(grp.get("interpret"))
        d = grp["d"] if interp or args.d is None else args.d
        v = grp["v"] if interp or args.v is None else args.v
        ns = grp["ns"] if interp or not args.n else args.n
        impls = [i for i in (args.impls or preset.get("impls") or DEFAULT_IMPLS)
                 if grp.get("impls") is None or i in grp["impls"]]
        if interp and (device.type == "cuda" or "fastcov-triton" not in impls):
            continue  # the interpreter group exists for CPU-only machines, for the Triton row
        warmup = grp.get("warmup", args.warmup if args.warmup is not None else preset["warmup"])
        repeats = grp.get("repeats", args.repeats if args.repeats is not None else preset["repeats"])
        groups_out.append({"name": grp["name"], "d": d, "v": v, "ns": ns, "impls": impls, "dtype": dtype_name,
                           "warmup": warmup, "repeats": repeats, "interpret": interp, "note": grp.get("note", "")})
        plan += [PlannedShape(grp["name"], n, d, v, impls, warmup, repeats, interp) for n in ns]
    return groups_out, plan

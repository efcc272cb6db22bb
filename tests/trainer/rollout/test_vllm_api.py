"""API drift: every vLLM name the vLLM engine (trainer/rollout/vllm_*.py) and its CPU-test fakes use, checked
against the real source of each supported vLLM release, parsed with ``ast`` (vLLM is never imported: it
cannot be installed where fastcov is developed).

The source comes from the release wheels (``pip download --no-deps``), of which only ``vllm/**/*.py`` is
kept, under ``.cache/vllm-src/<version>/`` (git-ignored; ``FASTCOV_VLLM_SRC`` points elsewhere):

    make test-vllm-api                                  # downloads what is missing, runs this file
    python tests/trainer/rollout/test_vllm_api.py fetch DIR 0.26.0 ...  # the download step alone

Without the source the tests skip, saying so. What is checked, per version:
  * every ``from vllm... import`` of the engine resolves (through re-exports and vLLM's lazy
    ``MODULE_ATTRS``), and every call the engine makes on a vLLM object (``self.llm.sleep(level=...)``,
    ``vllm.LLM(**...)``, ``trainer_init(...)``, ...) names a method that accepts those arguments;
  * the keyword sets the engine builds (``LLM`` kwargs, ``SamplingParams``, the ``/v1/completions`` body,
    the NCCL init/update info of the version adapter) are fields of the vLLM classes that receive them;
  * the ``fastcov_local`` backend implements every abstract method of vLLM's ``WeightTransferEngine`` and
    uses only attributes it sets; the weight-update routes, the env switch and the CLI entry exist;
  * the flat bucket layout and chunking equal vLLM's own ``pack_tensors`` (run from the parsed file);
  * the fakes of tests/trainer/rollout/test_rollout_vllm.py have the real signatures and attribute names.
A test removes a used name from a copy of the source and shows the check fails.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ENGINE_DIR = ROOT / "trainer" / "rollout"  # the vLLM engine: vllm_*.py
SMOKE = ROOT / "bench" / "vllm_smoke.py"  # the GPU check: its direct vLLM calls are checked too
FAKES = ROOT / "tests" / "test_rollout_vllm.py"
SRC_DIR = Path(os.environ.get("FASTCOV_VLLM_SRC", ROOT / ".cache" / "vllm-src"))
DEFAULT_VERSIONS = ("0.26.0", "0.33.0")  # = vllm_api.TESTED_VERSIONS and the Makefile's (checked below)
# make test-vllm-api VLLM_VERSIONS="0.26.0 0.27.0 ... 0.33.0" checks every release of the range
VERSIONS = tuple(os.environ.get("FASTCOV_VLLM_VERSIONS", " ".join(DEFAULT_VERSIONS)).split())


# ----------------------------------------------------------------------------------------- fetching

def fetch(dest: Path, versions) -> None:
    """Download each release wheel (no dependencies) and keep its Python files under dest/<version>/."""
    dest = Path(dest)
    for v in versions:
        out = dest / v
        if (out / ".complete").exists():
            continue
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                   "--platform", "manylinux_2_28_x86_64", "--python-version", "3.12", "-d", tmp, f"vllm=={v}"]
            subprocess.run(cmd, check=True)
            wheel = next(Path(tmp).glob("vllm-*.whl"))
            part = dest / f".{v}.partial"  # renamed into place once complete: no half-extracted tree
            shutil.rmtree(part, ignore_errors=True)
            with zipfile.ZipFile(wheel) as z:
                for name in z.namelist():
                    if name.startswith("vllm/") and name.endswith(".py"):
                        z.extract(name, part)
            (part / ".complete").write_text(v + "\n")
            shutil.rmtree(out, ignore_errors=True)
            part.rename(out)
        print(f"vLLM {v} source: {out}")


# ----------------------------------------------------------------------------------------- the source index

@dataclass
class Def:
    kind: str  # module | class | function | value
    module: str
    node: ast.AST | None = None


class SourceIndex:
    """Definitions of a vLLM source tree, resolved like Python would import them (without running it)."""

    def __init__(self, root: Path, overlay: dict[str, Path] | None = None):
        """``overlay``: source-relative path -> a file read instead (a modified copy, for drift tests)."""
        self.root = Path(root)
        self.overlay = {str(k): Path(v) for k, v in (overlay or {}).items()}
        self._trees: dict[str, ast.Module | None] = {}
        self._routes: set[str] | None = None

    def read(self, path: Path) -> str:
        rel = str(Path(path).relative_to(self.root))
        return (self.overlay.get(rel) or Path(path)).read_text()

    # modules
    def module_path(self, mod: str) -> Path | None:
        base = self.root.joinpath(*mod.split("."))
        for p in (base.with_suffix(".py"), base / "__init__.py"):
            if p.is_file():
                return p
        return None

    def tree(self, mod: str) -> ast.Module | None:
        if mod not in self._trees:
            p = self.module_path(mod)
            self._trees[mod] = ast.parse(self.read(p), str(p)) if p else None
        return self._trees[mod]

    @staticmethod
    def _stmts(body):
        """Top-level statements, also inside if/try/with blocks (TYPE_CHECKING imports, fallbacks)."""
        for st in body:
            yield st
            for attr in ("body", "orelse", "finalbody"):
                if isinstance(st, (ast.If, ast.Try, ast.With)) and hasattr(st, attr):
                    yield from SourceIndex._stmts(getattr(st, attr))
            if isinstance(st, ast.Try):
                for h in st.handlers:
                    yield from SourceIndex._stmts(h.body)

    def lookup(self, mod: str, name: str, _seen=None) -> Def | None:
        """The definition ``name`` refers to at the top level of module ``mod``."""
        seen = _seen if _seen is not None else set()
        if (mod, name) in seen:
            return None
        seen.add((mod, name))
        tree = self.tree(mod)
        if tree is None:
            return None
        is_pkg = self.module_path(mod).name == "__init__.py"
        found = None
        for st in self._stmts(tree.body):
            if isinstance(st, ast.ClassDef) and st.name == name:
                found = Def("class", mod, st)
            elif isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)) and st.name == name:
                found = Def("function", mod, st)
            elif isinstance(st, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in st.targets):
                found = found or Def("value", mod, st)
            elif isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.target.id == name:
                found = found or Def("value", mod, st)
            elif isinstance(st, ast.ImportFrom):
                for a in st.names:
                    if (a.asname or a.name) == name:
                        pkg = mod if is_pkg else mod.rpartition(".")[0]
                        if st.level:
                            parts = pkg.split(".")
                            parts = parts[: len(parts) - st.level + 1]
                            src = ".".join(parts + ([st.module] if st.module else []))
                        else:
                            src = st.module
                        hit = self.lookup(src, a.name, seen)
                        if hit is None and self.module_path(f"{src}.{a.name}"):
                            hit = Def("module", f"{src}.{a.name}")
                        if hit is not None:
                            return hit
            elif isinstance(st, ast.Import):
                for a in st.names:
                    if (a.asname or a.name.split(".")[0]) == name:
                        return Def("module", a.name if a.asname else a.name.split(".")[0])
        if found is not None:
            return found
        if self.module_path(f"{mod}.{name}"):  # a submodule
            return Def("module", f"{mod}.{name}")
        return self._lazy_attr(mod, name, seen)

    def _lazy_attr(self, mod: str, name: str, seen) -> Def | None:
        """vLLM's ``MODULE_ATTRS = {"LLM": ".entrypoints.llm:LLM", ...}`` served by a module ``__getattr__``."""
        for st in self._stmts(self.tree(mod).body):
            if (isinstance(st, ast.Assign) and isinstance(st.value, ast.Dict)
                    and any(isinstance(t, ast.Name) and t.id == "MODULE_ATTRS" for t in st.targets)):
                for k, v in zip(st.value.keys, st.value.values, strict=True):
                    if isinstance(k, ast.Constant) and k.value == name and isinstance(v, ast.Constant):
                        path, _, attr = v.value.partition(":")
                        target = mod + path if path.startswith(".") else path
                        return self.lookup(target, attr, seen)
        return None

    def resolve(self, dotted: str) -> Def | None:
        """``vllm.distributed.weight_transfer.base.WeightTransferEngine.update_weights`` -> its Def."""
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):
            if self.module_path(".".join(parts[:i])):
                cur, rest = Def("module", ".".join(parts[:i])), parts[i:]
                break
        else:
            return None
        for name in rest:
            if cur is None:
                return None
            if cur.kind == "module":
                cur = self.lookup(cur.module, name)
            elif cur.kind == "class":
                cur = self.member(cur, name)
            else:
                return None
        return cur

    # classes
    def bases(self, cls: Def) -> list[Def]:
        out = []
        for b in cls.node.bases:
            b = b.value if isinstance(b, ast.Subscript) else b
            d = None
            if isinstance(b, ast.Name):
                d = self.lookup(cls.module, b.id)
            elif isinstance(b, ast.Attribute):
                d = self.resolve(ast.unparse(b))
            if d is not None and d.kind == "class":
                out.append(d)
        return out

    def mro(self, cls: Def) -> list[Def]:
        out, todo = [], [cls]
        while todo:
            c = todo.pop(0)
            if all(c.node is not o.node for o in out):
                out.append(c)
                todo.extend(self.bases(c))
        return out

    @staticmethod
    def _own_members(cls: Def) -> dict[str, Def]:
        members: dict[str, Def] = {}
        for st in cls.node.body:
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
                members.setdefault(st.name, Def("function", cls.module, st))
            elif isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                members.setdefault(st.target.id, Def("value", cls.module, st))
            elif isinstance(st, ast.Assign):
                for t in st.targets:
                    if isinstance(t, ast.Name):
                        members.setdefault(t.id, Def("value", cls.module, st))
        for st in ast.walk(cls.node):  # self.x = ... in any method: instance attributes
            targets = st.targets if isinstance(st, ast.Assign) else [st.target] if isinstance(
                st, (ast.AnnAssign, ast.AugAssign)) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    members.setdefault(t.attr, Def("value", cls.module, st))
        return members

    def member(self, cls: Def, name: str) -> Def | None:
        for c in self.mro(cls):
            m = self._own_members(c).get(name)
            if m is not None:
                return m
        return None

    def fields(self, cls: Def) -> dict[str, bool]:
        """Annotated class fields across the MRO (dataclass, msgspec.Struct, pydantic): name -> required."""
        out: dict[str, bool] = {}
        for c in reversed(self.mro(cls)):
            for st in c.node.body:
                if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                    if "ClassVar" in ast.unparse(st.annotation):
                        continue
                    required = st.value is None or (
                        isinstance(st.value, ast.Call) and ast.unparse(st.value.func).endswith("Field")
                        and not st.value.args and not any(k.arg in ("default", "default_factory")
                                                          for k in st.value.keywords))
                    out[st.target.id] = required
        return out

    def abstract_methods(self, cls: Def) -> set[str]:
        out = set()
        for c in self.mro(cls):
            for st in c.node.body:
                if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                        ast.unparse(d).endswith("abstractmethod") for d in st.decorator_list):
                    out.add(st.name)
        return out


@dataclass
class Sig:
    positional: list[str]
    keyword: set[str]
    required: set[str]
    var_pos: bool
    var_kw: bool


def signature(fn: ast.FunctionDef, bound: bool = True) -> Sig:
    """Parameters of a def; ``bound``: drop the first one of a method (self/cls) unless it is static."""
    a = fn.args
    pos = [p.arg for p in a.posonlyargs + a.args]
    if bound and pos and not any(ast.unparse(d) == "staticmethod" for d in fn.decorator_list):
        pos = pos[1:]
    n_def = len(a.defaults)
    req_pos = pos[: len(pos) - n_def] if n_def else pos
    keyword = {p.arg for p in a.args + a.kwonlyargs} - {"self", "cls"}
    req_kw = {p.arg for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is None}
    return Sig(pos, keyword, set(req_pos) | req_kw, a.vararg is not None, a.kwarg is not None)


def accepts(sig: Sig, n_positional: int, keywords: set[str]) -> list[str]:
    """What is wrong with calling ``sig`` with that many positional arguments and those keywords."""
    bad = []
    if n_positional > len(sig.positional) and not sig.var_pos:
        bad.append(f"takes {len(sig.positional)} positional arguments, called with {n_positional}")
    unknown = sorted(k for k in keywords if k not in sig.keyword)
    if unknown and not sig.var_kw:
        bad.append(f"has no parameter {', '.join(unknown)}")
    given = set(sig.positional[:n_positional]) | keywords
    missing = sorted(sig.required - given)
    if missing:
        bad.append(f"requires {', '.join(missing)}")
    return bad


# ----------------------------------------------------------------------------------------- what the engine uses

def _vllm_imports(tree: ast.Module) -> dict[str, str]:
    """Local name -> dotted vLLM path, for every ``from vllm... import`` in the file (any depth)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


# receivers in the engine's source whose attribute calls are vLLM calls
RECEIVERS = {
    "self.llm": "vllm.LLM",
    "llm": "vllm.LLM",
    "engine.llm": "vllm.LLM",  # bench/vllm_smoke.py
    "self.vllm": "vllm",
    "engine.vllm": "vllm",
    "vllm": "vllm",
    "self.comm": "vllm.distributed.device_communicators.pynccl.PyNcclCommunicator",
}


def _call_target(idx: SourceIndex, func: ast.expr, imports: dict[str, str]) -> tuple[str, Def | None] | None:
    """(what, Def) for a call the engine makes into vLLM, or None when the callee is not vLLM's."""
    if isinstance(func, ast.Name) and func.id in imports:
        return imports[func.id], idx.resolve(imports[func.id])
    if isinstance(func, ast.Attribute):
        recv = ast.unparse(func.value)
        base = RECEIVERS.get(recv) or imports.get(recv)
        if base is not None:
            owner = idx.resolve(base)
            if owner is None:
                return f"{base}.{func.attr}", None
            d = idx.member(owner, func.attr) if owner.kind == "class" else idx.lookup(owner.module, func.attr)
            return f"{base}.{func.attr}", d
    return None


def _callable_sig(idx: SourceIndex, d: Def, what: str) -> tuple[Sig | None, list[str]]:
    if d.kind == "function":
        return signature(d.node, bound="." in what and idx.resolve(what.rpartition(".")[0]) is not None
                         and idx.resolve(what.rpartition(".")[0]).kind == "class"), []
    if d.kind == "class":
        init = idx.member(d, "__init__")
        if init is not None and init.kind == "function":
            return signature(init.node), []
        f = idx.fields(d)
        return Sig([], set(f), {k for k, r in f.items() if r}, False, False), []
    return None, [f"{what} is a {d.kind}, not callable"]


def check_engine_calls(idx: SourceIndex, source: str) -> list[str]:
    """Imports resolve; every vLLM call in the engine source names a callable that takes its arguments."""
    tree = ast.parse(source)
    imports = _vllm_imports(tree)
    problems = [f"import {path}: not found" for path in sorted(set(imports.values())) if idx.resolve(path) is None]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        hit = _call_target(idx, node.func, imports)
        if hit is None:
            continue
        what, d = hit
        if d is None:
            problems.append(f"{what}: not found")
            continue
        sig, errs = _callable_sig(idx, d, what)
        problems += errs
        if sig is None:
            continue
        if any(isinstance(a, ast.Starred) for a in node.args):
            continue
        kws = {k.arg for k in node.keywords if k.arg is not None}
        if any(k.arg is None for k in node.keywords):  # **kwargs: the keys are checked by the builder checks
            sig = Sig(sig.positional, sig.keyword, set(), sig.var_pos, True)
        problems += [f"{what}({ast.unparse(node)[len(ast.unparse(node.func)):][:60]}...): {e}"
                     for e in accepts(sig, len(node.args), kws)]
    return problems


def _class(idx: SourceIndex, path: str) -> Def | None:
    d = idx.resolve(path)
    return d if d is not None and d.kind == "class" else None


def check_keys(idx: SourceIndex, path: str, keys, what: str, forward_to: str | None = None,
               complete: bool = False) -> list[str]:
    """``keys`` are accepted by class ``path`` (its __init__ or fields; ``forward_to``: the class that
    receives its **kwargs); ``complete``: they also cover its required fields."""
    cls = _class(idx, path)
    if cls is None:
        return [f"{what}: class {path} not found"]
    init = idx.member(cls, "__init__")
    if init is not None and init.kind == "function" and not idx.fields(cls):
        sig = signature(init.node)
        names, open_kw = sig.keyword, sig.var_kw
        required = sig.required
    else:
        f = idx.fields(cls)
        names, open_kw, required = set(f), False, {k for k, r in f.items() if r}
    if forward_to is not None:
        fwd = _class(idx, forward_to)
        if fwd is None:
            return [f"{what}: class {forward_to} not found"]
        names = names | set(idx.fields(fwd))
        open_kw = False
    problems = [f"{what}: {path} has no field/parameter {k!r}" for k in sorted(keys)
                if k not in names and not open_kw]
    if complete:
        problems += [f"{what}: {path} requires {k!r}" for k in sorted(required - set(keys))]
    return problems


def _literal_values(idx: SourceIndex, path: str) -> set[str]:
    d = idx.resolve(path)
    if d is None or d.node is None:
        return set()
    return {n.value for n in ast.walk(d.node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _routes(idx: SourceIndex) -> set[str]:
    """Paths of every ``@router.post("...")`` under vllm/entrypoints (cached per index)."""
    if idx._routes is not None:
        return idx._routes
    out = idx._routes = set()
    for p in (idx.root / "vllm" / "entrypoints").rglob("*.py"):
        for node in ast.walk(ast.parse(idx.read(p))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for d in node.decorator_list:
                    if (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "post"
                            and d.args and isinstance(d.args[0], ast.Constant)):
                        out.add(d.args[0].value)
    return out


def _registered_backends(idx: SourceIndex) -> set[str]:
    tree = idx.tree("vllm.distributed.weight_transfer.factory")
    return {n.args[0].value for n in ast.walk(tree) if isinstance(n, ast.Call)
            and ast.unparse(n.func) == "WeightTransferEngineFactory.register_engine"
            and n.args and isinstance(n.args[0], ast.Constant)}


def check_builders(idx: SourceIndex, version: str, api=None) -> list[str]:
    """The keyword sets the engine builds against the vLLM classes that receive them."""
    from types import SimpleNamespace as NS

    from fastcov.trainer.rollout import SamplingParams, vllm_api, vllm_factory, vllm_wire

    api = api or vllm_api.VLLMApi(version)
    cfg = NS(rollout=NS(max_new_tokens=8, vllm_tensor_parallel_size=1, vllm_gpu_memory_utilization=0.5),
             trainer=NS(eval_max_new_tokens=None, seed=0), data=NS(max_prompt_len=8), model=NS(dtype="bf16"))
    llm_kw = vllm_factory.colocated_llm_kwargs(cfg, "/m")
    p = check_keys(idx, "vllm.LLM", llm_kw, "LLM(**colocated_llm_kwargs)",
                   forward_to="vllm.engine.arg_utils.EngineArgs")
    samp = vllm_wire.sampling_kwargs(SamplingParams(1.0, 1.0, 4), [2], 7)
    p += check_keys(idx, "vllm.SamplingParams", samp, "SamplingParams(**sampling_kwargs)")
    body = vllm_wire.completion_payload("m", [[1]], SamplingParams(1.0, 1.0, 4), [2])
    p += check_keys(idx, "vllm.entrypoints.openai.completion.protocol.CompletionRequest", body,
                    "/v1/completions body")
    init = api.nccl_init_info(host="h", port=1, world_size=2, rank_offset=1, buffer_bytes=64)
    p += check_keys(idx, "vllm.distributed.weight_transfer.nccl_common.NCCLWeightTransferInitInfo", init,
                    f"init_info (VLLMApi {api.version})", complete=True)
    upd = api.nccl_update_info(["a"], ["bfloat16"], [[1]], 64)
    p += check_keys(idx, "vllm.distributed.weight_transfer.nccl_engine.NCCLWeightTransferUpdateInfo", upd,
                    f"update_info (VLLMApi {api.version})", complete=True)
    # the packed geometry must reach the worker: in the init info or in every update info
    if not ({"packed", "packed_buffer_size_bytes"} <= set(init) | set(upd)):
        p.append("packed transfer: neither init_info nor update_info carries the packed geometry")
    # values the engine passes
    if vllm_api.LOGPROBS_MODE not in _literal_values(idx, "vllm.config.model.LogprobsMode"):
        p.append(f"logprobs_mode {vllm_api.LOGPROBS_MODE!r} is not a vllm.config.model.LogprobsMode")
    if llm_kw["distributed_executor_backend"] not in _literal_values(
            idx, "vllm.config.parallel.DistributedExecutorBackend"):
        p.append("distributed_executor_backend 'external_launcher' is not a DistributedExecutorBackend")
    if llm_kw["load_format"] not in _literal_values(idx, "vllm.model_executor.model_loader.LoadFormats"):
        p.append(f"load_format {llm_kw['load_format']!r} is not a vllm.model_executor.model_loader.LoadFormats")
    if vllm_api.SERVER_BACKEND not in _registered_backends(idx):
        p.append(f"weight-transfer backend {vllm_api.SERVER_BACKEND!r} is not registered in vLLM")
    wt = _class(idx, "vllm.config.weight_transfer.WeightTransferConfig")
    if wt is None or "str" not in ast.unparse(idx.member(wt, "backend").node.annotation):
        p.append("WeightTransferConfig.backend does not accept a registered name (fastcov_local)")
    return p


def check_server(idx: SourceIndex) -> list[str]:
    from fastcov.trainer.rollout import vllm_api, vllm_server
    p = [f"route {r} not served by vLLM" for r in vllm_api.ROUTES if r not in _routes(idx)]
    envs = idx.tree("vllm.envs")
    if envs is None or "VLLM_SERVER_DEV_MODE" not in ast.unparse(envs):
        p.append("vllm.envs has no VLLM_SERVER_DEV_MODE")
    cmd, _ = vllm_server.serve_command(["--model", "m"], python="python")
    mod = cmd[cmd.index("-m") + 1]
    main = idx.resolve(f"{mod}.main")
    if main is None or main.kind != "function":
        p.append(f"{mod}.main: not found")
    if idx.resolve("vllm.entrypoints.cli.serve") is None:
        p.append("vllm.entrypoints.cli.serve: not found")
    cmd2, _ = vllm_server.serve_command(["m"], python="python", backend=vllm_api.GLOO_BACKEND, cli=False)
    if idx.resolve(cmd2[cmd2.index("-m") + 1]) is None:  # the server module a build not named `vllm` runs
        p.append(f"{cmd2[cmd2.index('-m') + 1]}: not found")
    ea = _class(idx, "vllm.engine.arg_utils.EngineArgs")
    fields = idx.fields(ea) if ea else {}
    for flag in (a for a in cmd if a.startswith("--") and a != "--model"):
        if flag[2:].replace("-", "_") not in fields:
            p.append(f"vllm serve {flag}: EngineArgs has no field {flag[2:].replace('-', '_')}")
    return p


def check_local_backend(idx: SourceIndex, source: str) -> list[str]:
    """fastcov_local against vLLM's WeightTransferEngine: abstract methods implemented, used attributes set,
    the constructor the factory calls, the worker methods LLM's RL calls reach, layerwise reload helpers."""
    base = _class(idx, "vllm.distributed.weight_transfer.base.WeightTransferEngine")
    if base is None:
        return ["vllm.distributed.weight_transfer.base.WeightTransferEngine: not found"]
    ours = next(n for n in ast.walk(ast.parse(source))
                if isinstance(n, ast.ClassDef) and n.name == "FastcovLocalWeightTransferEngine")
    defined = {st.name for st in ours.body if isinstance(st, ast.FunctionDef)}
    p = [f"fastcov_local does not implement abstract {m}" for m in sorted(idx.abstract_methods(base) - defined)]
    p += [f"fastcov_local defines {m}, which WeightTransferEngine does not have"
          for m in sorted(defined - {"trainer_send_weights"}) if idx.member(base, m) is None]
    used = {n.attr for n in ast.walk(ours) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "self"} - defined
    p += [f"fastcov_local uses self.{a}, which WeightTransferEngine does not set" for a in sorted(used)
          if idx.member(base, a) is None]
    for cls_attr in ("init_info_cls", "update_info_cls"):
        if idx.member(base, cls_attr) is None:
            p.append(f"WeightTransferEngine.{cls_attr}: not found")
    init = idx.member(base, "__init__")
    if init is None or signature(init.node).positional != ["config", "vllm_config", "device", "model"]:
        p.append("WeightTransferEngine.__init__ is not (config, vllm_config, device, model)")
    parse = idx.member(base, "parse_update_info")
    if parse is None or "update_info_cls(**" not in ast.unparse(parse.node):
        p.append("WeightTransferEngine.parse_update_info no longer builds update_info_cls(**update_info)")
    worker = _class(idx, "vllm.v1.worker.gpu_worker.Worker")
    for m, params in (("init_weight_transfer_engine", {"init_info"}), ("start_weight_update", set()),
                      ("update_weights", {"update_info"}), ("finish_weight_update", set()),
                      ("sleep", {"level"}), ("wake_up", {"tags"})):
        d = idx.member(worker, m) if worker else None
        if d is None or d.kind != "function":
            p.append(f"vllm.v1.worker.gpu_worker.Worker.{m}: not found")
        elif not params <= signature(d.node).keyword:
            p.append(f"Worker.{m} does not take {sorted(params)}")
    for path in ("vllm.model_executor.model_loader.reload.initialize_layerwise_reload",
                 "vllm.model_executor.model_loader.reload.finalize_layerwise_reload"):
        if idx.resolve(path) is None:
            p.append(f"{path}: not found")
    return p


OUTPUT_ATTRS = {  # what request_outputs_to_batch reads (prompt_logprobs: bench/vllm_smoke.py's scoring)
    "vllm.outputs.RequestOutput": ("outputs", "prompt_logprobs"),
    "vllm.outputs.CompletionOutput": ("token_ids", "logprobs"),
    "vllm.logprobs.Logprob": ("logprob",),
}


def check_outputs(idx: SourceIndex) -> list[str]:
    p = [] if idx.resolve("vllm.__version__") is not None else ["vllm.__version__: not found"]
    sp = _class(idx, "vllm.SamplingParams")
    if sp is None or "prompt_logprobs" not in idx.fields(sp):  # bench/vllm_smoke.py scores fixed tokens
        p.append("vllm.SamplingParams.prompt_logprobs: not found")
    q = idx.resolve("vllm.model_executor.models.qwen2.Qwen2ForCausalLM.load_weights")  # fastcov_local loads
    if q is None or q.kind != "function" or len(signature(q.node).positional) != 1:
        p.append("Qwen2ForCausalLM.load_weights(weights): not found")
    for path, attrs in OUTPUT_ATTRS.items():
        cls = _class(idx, path)
        for a in attrs:
            if cls is None or idx.member(cls, a) is None:
                p.append(f"{path}.{a}: not found")
    return p


def check_fakes(idx: SourceIndex, source: str) -> list[str]:
    """The CPU tests' fakes (classes named in FAKE_OF) have the real methods, signatures and attributes."""
    tree = ast.parse(source)
    fake_of = next(ast.literal_eval(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
                   and any(isinstance(t, ast.Name) and t.id == "FAKE_OF" for t in n.targets))
    classes = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    p = []
    for fake, real_path in fake_of.items():
        real = _class(idx, real_path)
        if fake not in classes:
            p.append(f"fake {fake}: not in {FAKES.name}")
            continue
        if real is None:
            p.append(f"fake {fake}: {real_path} not found")
            continue
        for st in classes[fake].body:
            if not isinstance(st, ast.FunctionDef) or (st.name.startswith("_") and st.name != "__init__"):
                continue
            if st.name == "__init__":  # a data fake: its constructor's parameters are the real attributes
                for a in signature(st).keyword:
                    if idx.member(real, a) is None:
                        p.append(f"fake {fake}: {real_path} has no attribute {a!r}")
                continue
            m = idx.member(real, st.name)
            if m is None or m.kind != "function":
                p.append(f"fake {fake}.{st.name}: {real_path} has no method {st.name}")
                continue
            fs, rs = signature(st), signature(m.node)
            extra = sorted(fs.keyword - rs.keyword) if not rs.var_kw else []
            if extra:
                p.append(f"fake {fake}.{st.name}: {real_path}.{st.name} has no parameter {', '.join(extra)}")
            if fs.positional != rs.positional[: len(fs.positional)]:
                p.append(f"fake {fake}.{st.name}{tuple(fs.positional)}: real {tuple(rs.positional)}")
            missing = sorted(rs.required - fs.keyword)
            if missing:
                p.append(f"fake {fake}.{st.name}: lacks required {', '.join(missing)}")
    return p


def engine_source() -> str:
    """The vLLM engine's modules as one source text (each file parses alone; the checks walk the whole)."""
    files = sorted(ENGINE_DIR.glob("vllm_*.py"))
    assert files, f"no vllm_*.py under {ENGINE_DIR}"
    return "\n".join(p.read_text() for p in files)


def check_all(idx: SourceIndex, version: str) -> list[str]:
    src = engine_source()
    return (check_engine_calls(idx, src) + check_engine_calls(idx, SMOKE.read_text())
            + check_builders(idx, version) + check_server(idx)
            + check_local_backend(idx, src) + check_outputs(idx) + check_fakes(idx, FAKES.read_text()))


# ----------------------------------------------------------------------------------------- tests

import pytest  # noqa: E402

torch = pytest.importorskip("torch")


def _src(version: str) -> Path:
    root = SRC_DIR / version
    if not (root / "vllm" / "__init__.py").is_file():
        pytest.skip(f"vLLM {version} source not cached in {SRC_DIR} (make test-vllm-api downloads it)")
    return root


def test_tested_versions_match_the_engine():
    from fastcov.trainer.rollout import vllm_api
    assert tuple(vllm_api.TESTED_VERSIONS) == DEFAULT_VERSIONS
    for v in VERSIONS:  # every tested version is in the supported range; the defaults are its ends
        vllm_api.check_vllm_version(v)
    make = next(line for line in (ROOT / "Makefile").read_text().splitlines() if line.startswith("VLLM_VERSIONS"))
    assert tuple(make.split(":=")[1].split()) == DEFAULT_VERSIONS  # what make test-vllm-api downloads


@pytest.mark.parametrize("version", VERSIONS)
def test_engine_matches_vllm_source(version):
    idx = SourceIndex(_src(version))
    problems = check_all(idx, version)
    assert not problems, f"vLLM {version} API drift:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_call_into_vllm_is_seen(version):
    """The scan really finds the engine's vLLM calls (a check that sees nothing would pass anything)."""
    idx = SourceIndex(_src(version))
    tree = ast.parse(engine_source())
    imports = _vllm_imports(tree)
    seen = {what for n in ast.walk(tree) if isinstance(n, ast.Call)
            for what, _ in [_call_target(idx, n.func, imports) or (None, None)] if what}
    for name in ("vllm.LLM.sleep", "vllm.LLM.wake_up", "vllm.LLM.generate", "vllm.LLM.start_weight_update",
                 "vllm.LLM.update_weights", "vllm.LLM.finish_weight_update", "vllm.LLM.reset_prefix_cache",
                 "vllm.LLM.init_weight_transfer_engine", "vllm.LLM", "vllm.SamplingParams",
                 "vllm.distributed.weight_transfer.nccl_common.trainer_init",
                 "vllm.distributed.device_communicators.pynccl.PyNcclCommunicator.broadcast",
                 "vllm.model_executor.model_loader.reload.initialize_layerwise_reload",
                 "vllm.distributed.weight_transfer.factory.WeightTransferEngineFactory.register_engine"):
        assert name in seen, name


def test_version_adapter_is_needed():
    """Each version's NCCL info is refused by the other's source: the adapter is load-bearing."""
    from fastcov.trainer.rollout import vllm_api
    old, new = SourceIndex(_src("0.26.0")), SourceIndex(_src("0.33.0"))
    assert check_builders(old, "0.26.0", api=vllm_api.VLLMApi("0.33.0"))
    assert check_builders(new, "0.33.0", api=vllm_api.VLLMApi("0.26.0"))


def _load_packed_tensor(root: Path):
    path = root / "vllm" / "distributed" / "weight_transfer" / "packed_tensor.py"
    spec = importlib.util.spec_from_file_location(f"_vllm_packed_{root.name.replace('.', '_')}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # torch only: no vllm import
    return mod


@pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes")  # vLLM's, for the small buffers
@pytest.mark.parametrize("version", VERSIONS)
def test_flat_layout_and_chunks_equal_vllm_pack_tensors(version):
    """pack_flat/chunk_runs produce exactly what vLLM's own producer sends and its consumer expects."""
    from fastcov.trainer.rollout import vllm_wire
    pt = _load_packed_tensor(_src(version))
    g = torch.Generator().manual_seed(0)
    pairs = [("a", torch.randn(3, 5, generator=g)), ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
             ("c", torch.randn(2, 3, generator=g).double()), ("d", torch.randn(40, 4, generator=g)),
             ("e", torch.randn(1, generator=g)), ("f", torch.randn(9, 9, generator=g))]
    dt = torch.bfloat16

    def post(item):
        t = item[1]
        return t.to(vllm_wire.wire_dtype(t, dt))

    for buffer in (1, 64, 200, 330, 10_000):
        it, ref = iter(pairs), []
        while (chunk := pt.pack_tensors(it, post, buffer)) is not None:
            ref.append(chunk)
        sizes = [t.numel() * vllm_wire.wire_dtype(t, dt).itemsize for _, t in pairs]
        runs = vllm_wire.chunk_runs(sizes, buffer)
        assert [list(r) for r in runs] == [[i for i, _ in enumerate(pairs) if pairs[i][0] in c.names]
                                           for c in ref], buffer
        for run, c in zip(runs, ref, strict=True):
            ours = vllm_wire.pack_flat([pairs[i] for i in run], dt)
            assert torch.equal(ours.flat, c.packed_tensor) and ours.names == c.names
            assert ours.sizes == c.tensor_sizes and ours.shapes == c.shapes
            back = pt.unpack_tensor(ours.flat, ours.names, ours.shapes,
                                    [getattr(torch, d) for d in ours.dtype_names], ours.sizes)
            for (n, t), (n2, v) in zip(ours.views(), back, strict=True):
                assert n == n2 and torch.equal(t, v)


def _drifted(tmp_path: Path, version: str, rel: str, old: str, new: str) -> SourceIndex:
    """The version's source with one file replaced by a modified copy written under tmp_path."""
    src = _src(version)
    text = (src / rel).read_text()
    assert old in text, f"{rel} no longer contains {old!r}: update this test"
    copy = tmp_path / version / rel
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_text(text.replace(old, new))
    return SourceIndex(src, overlay={rel: copy})


@pytest.mark.parametrize("version", VERSIONS)
def test_drift_check_fails_when_a_used_name_is_removed(tmp_path, version):
    """A copy of the source with a method the engine calls renamed, a field it sets removed, a route gone:
    the check names each one."""
    idx = _drifted(tmp_path, version, "vllm/entrypoints/llm.py", "def wake_up(", "def resume_engine(")
    problems = check_all(idx, version)
    assert any("vllm.LLM.wake_up: not found" in p for p in problems), problems
    assert any("fake FakeLLM.wake_up" in p for p in problems), problems  # the fake is checked too

    idx = _drifted(tmp_path / "2", version, "vllm/engine/arg_utils.py",
                   "    enable_sleep_mode: bool", "    enable_sleep: bool")
    assert any("no field/parameter 'enable_sleep_mode'" in p for p in check_all(idx, version))

    rel = "vllm/distributed/weight_transfer/base.py"
    idx = _drifted(tmp_path / "3", version, rel, "    def receive_weights(", "    def receive(")
    problems = check_all(idx, version)
    assert any("defines receive_weights, which WeightTransferEngine does not have" in p for p in problems), \
        problems


def test_drift_check_fails_when_a_route_or_signature_changes(tmp_path):
    v = "0.33.0"
    idx = _drifted(tmp_path, v, "vllm/entrypoints/rl/online/api_router.py",
                   '@router.post("/update_weights")', '@router.post("/v2/update_weights")')
    assert "route /update_weights not served by vLLM" in check_all(idx, v)
    idx = _drifted(tmp_path / "2", v, "vllm/entrypoints/llm.py", "def sleep(self, level: int = 1,",
                   "def sleep(self, depth: int = 1,")
    problems = check_all(idx, v)
    assert any("vllm.LLM.sleep" in p and "no parameter level" in p for p in problems), problems


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "fetch":
        fetch(Path(sys.argv[2]), sys.argv[3:] or VERSIONS)
    else:
        sys.exit("usage: python tests/trainer/rollout/test_vllm_api.py fetch DIR [VERSION ...]")

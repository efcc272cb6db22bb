"""Reading a config: YAML files and ``key=value`` overrides onto the section dataclasses, each value checked
against its field's annotation, moved keys mapped (with a one-line FutureWarning naming the new key).

    cfg = load_config("configs/demo.yaml", ["algo.mode=kl_cov", "trainer.max_steps=50"])
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
import warnings
from pathlib import Path
from typing import Any, Literal

from fastcov.errors import ConfigError
from fastcov.trainer.config.base import check as _check
from fastcov.trainer.config.base import config_key, without_name
from fastcov.trainer.config.checks import validate
from fastcov.trainer.config.root import Config

# Keys that moved: old dotted key -> its new one. Both are read; the old one with a one-line FutureWarning naming
# the new, and an error when both are set.
MOVED_KEYS = {
    # 0.4.0: Jin et al.'s schedule got its own section
    **{f"algo.pos_weight_{old}": f"algo.pos_weight.{new}" for old, new in (
        ("schedule", "enabled"), ("kind", "kind"), ("init", "init"), ("target_entropy", "target_entropy"),
        ("delta", "delta"), ("stages", "stages"), ("values", "values"), ("steps_per_epoch", "steps_per_epoch"))},
    # after 0.5.0: the loss's hyperparameters are fastcov.losses.LossConfig itself, nested as algo.loss
    **{f"algo.{name}": f"algo.loss.{name}" for name in (
        "clip_low", "clip_high", "dual_clip_c", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio",
        "kl_cov_coef", "cispo_clip_max", "cispo_clip_min", "sapo_tau_pos", "sapo_tau_neg", "vespo_k_pos",
        "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "entropy_coef", "pos_adv_weight", "neg_adv_weight",
        "high_entropy_fraction", "cov_score")},
}

# ----------------------------------------------------------------------------------------------- typing

def _coerce(value: Any, tp: Any, key: str, start: Any = None) -> Any:
    """Check ``value`` against the annotation ``tp`` and return it converted (int -> float, list -> tuple); a section
    (a dataclass) is built from ``start``, its field's default, with the keys ``value`` sets."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as exc:
                errors.append(exc)
        if len(errors) == 1:  # Optional[X]: X's own message says more
            raise errors[0]
        raise ConfigError(f"{key}: {value!r} does not match {_type_name(tp)}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return _build(tp, value, key, start)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        if origin is tuple:
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
            if len(value) != len(args):
                raise ConfigError(f"{key}: expected {len(args)} items, got {len(value)}")
            return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True)))
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)] if args else list(value)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            # PyYAML reads "1e-4" (no dot) as a string.
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{key}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            value = float(value)
        except OverflowError:  # an int too large for a float
            raise ConfigError(f"{key}: {value!r} is too large") from None
        if not math.isfinite(value):
            raise ConfigError(f"{key}: must be a finite number, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported annotation {tp!r}")  # pragma: no cover


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _build(cls: type, data: dict[str, Any], prefix: str, start: Any = None) -> Any:
    """The section ``cls`` from the mapping ``data`` (keys checked, values coerced), on top of ``start`` (its
    field's default instance; None: the class's defaults). A section that checks its own values when built
    (fastcov.losses.LossConfig) has its refusal named by key."""
    hints = typing.get_type_hints(cls)
    fields = {config_key(f): f for f in dataclasses.fields(cls)}  # YAML key -> field
    for k in data:
        if k not in fields:
            full = f"{prefix}.{k}" if prefix else str(k)
            near = difflib.get_close_matches(str(k), sorted(fields), n=1, cutoff=0.6)
            hint = (f"did you mean {(f'{prefix}.' if prefix else '') + near[0]!r}?" if near
                    else f"known keys{(' of ' + prefix) if prefix else ''}: {', '.join(sorted(fields))}")
            raise ConfigError(f"unknown config key {full!r}; {hint}")
    kwargs = {}
    for k, v in data.items():
        f = fields[k]
        kwargs[f.name] = _coerce(v, hints[f.name], f"{prefix}.{k}" if prefix else k, _default_section(f))
    try:
        return cls(**kwargs) if start is None else dataclasses.replace(start, **kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(_refusal(exc, prefix, [f.name for f in fields.values()], set(kwargs))) from None


def _default_section(f: dataclasses.Field) -> Any:
    """A section field's default instance (``algo.loss``: the trainer's LossConfig), else None."""
    factory = f.default_factory
    return None if factory is dataclasses.MISSING else factory()


def _refusal(exc: Exception, prefix: str, names: list[str], given: set[str]) -> str:
    """A section's own refusal as ``<prefix>.<key>: why``: the key is the first field the message names that the
    config sets, else the first it names (its leading name dropped when it is that key)."""
    msg = str(exc)
    named = [w for w in dict.fromkeys(re.findall(r"[A-Za-z_]\w*", msg)) if w in names]
    key = next((n for n in named if n in given), named[0] if named else None)
    if key is None:
        return f"{prefix}: {msg}"
    return f"{prefix}.{key}: {without_name(exc, key)}"


# ----------------------------------------------------------------------------------------------- loading

def _parse_scalar(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (value parsed as YAML) to a nested dict, in place."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value")
        key, text = item.split("=", 1)
        key = key.strip()
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r}: bad key {key!r}")
        node = data
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(parts[: i + 1])} is not a section")
            node = child
        node[parts[-1]] = _parse_scalar(text)
    return data


def _model_source_from_overrides(data: dict[str, Any], overrides: list[str]) -> None:
    """An override ``model.path=...`` replaces the file's model source, in place: its ``model.arch`` goes, and so
    does its ``model.tokenizer`` (the fresh model's, e.g. builtin:arith) unless an override sets one. Overrides
    that set both ``model.path`` and ``model.arch`` stay an error."""
    pairs = [item.split("=", 1) for item in overrides if "=" in item]
    keys = {k.strip() for k, _ in pairs}
    model = data.get("model")
    if not isinstance(model, dict) or model.get("arch") is None or any(
            k == "model.arch" or k.startswith("model.arch.") for k in keys):
        return
    if any(k.strip() == "model.path" and _parse_scalar(v) is not None for k, v in pairs):
        del model["arch"]
        if "model.tokenizer" not in keys:
            model.pop("tokenizer", None)


def _section(data: dict[str, Any], dotted: str, create: bool = False) -> dict[str, Any] | None:
    """The mapping at ``dotted`` in ``data`` (created when ``create``), or None where there is none."""
    node: Any = data
    for part in dotted.split("."):
        child = node.get(part) if isinstance(node, dict) else None
        if child is None and create and isinstance(node, dict):
            child = node[part] = {}
        node = child
    return node if isinstance(node, dict) else None


def _move_keys(data: dict[str, Any]) -> None:
    """Each moved key of a config mapping to its new place, in place, with a one-line warning naming the new key;
    the old and the new key both set is an error."""
    for old, new in MOVED_KEYS.items():
        old_parent, _, old_name = old.rpartition(".")
        parent = _section(data, old_parent)
        if parent is None or old_name not in parent:
            continue
        new_parent, _, new_name = new.rpartition(".")
        section = _section(data, new_parent, create=True)
        if section is None:
            return  # _build says what is wrong with the section
        if new_name in section:
            raise ConfigError(f"{old}: renamed {new}, which is set too; keep only the new key")
        warnings.warn(f"{old} is deprecated: use {new}", FutureWarning, stacklevel=4)
        section[new_name] = parent.pop(old_name)


def _move_override_keys(overrides: list[str]) -> list[str]:
    """The overrides with each moved key renamed, with a one-line warning naming the new key (so that an old
    override still wins over the file's new key); the old and the new key both given is an error."""
    given = {item.split("=", 1)[0].strip() for item in overrides if "=" in item}
    out = []
    for item in overrides:
        key, sep, text = item.partition("=")
        new = MOVED_KEYS.get(key.strip()) if sep else None
        if new is not None:
            if new in given:
                raise ConfigError(f"{key.strip()}: renamed {new}, which is set too; keep only the new key")
            warnings.warn(f"{key.strip()} is deprecated: use {new}", FutureWarning, stacklevel=3)
            item = f"{new}={text}"
        out.append(item)
    return out


def _map_tracker_keys(data: dict[str, Any]) -> None:
    """trainer.tensorboard / trainer.wandb (booleans) -> names in trainer.report_to, trainer.wandb_project ->
    trainer.project, in place, each with a one-line warning naming the new key."""
    t = data.get("trainer")
    if not isinstance(t, dict):
        return
    for old in ("tensorboard", "wandb"):
        if old in t:
            value = t.pop(old)
            _check(isinstance(value, bool), f"trainer.{old}", f"expected true/false, got {value!r}")
            warnings.warn(f"trainer.{old} is deprecated: use trainer.report_to: [{old}]", FutureWarning, stacklevel=3)
            if value:
                names = t.get("report_to") or []
                names = [names] if isinstance(names, str) else list(names)
                t["report_to"] = names if old in names else names + [old]
    if "wandb_project" in t:
        if "project" in t:
            raise ConfigError("trainer.wandb_project: renamed trainer.project, which is set too; keep only the new key")
        warnings.warn("trainer.wandb_project is deprecated: use trainer.project", FutureWarning, stacklevel=3)
        t["project"] = t.pop("wandb_project")


def config_from_dict(data: dict[str, Any]) -> Config:
    """A mapping of sections (as a YAML file holds), checked and validated; moved keys are mapped first."""
    if not isinstance(data, dict):
        raise ConfigError(f"config: expected a mapping at the top level, got {type(data).__name__}")
    _move_keys(data)
    _map_tracker_keys(data)
    return validate(_build(Config, data, ""))


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read a YAML file (or start from defaults when ``path`` is None), apply overrides, validate."""
    import yaml

    from fastcov.configs import resolve_config, shipped_names

    data: dict[str, Any] = {}
    if path is not None:
        p = resolve_config(path)  # a file on disk, else the shipped config of that name
        if p.is_dir():
            raise ConfigError(f"config file {str(p)!r} is a directory; give a YAML file (see configs/)")
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist; give a YAML file (see configs/) or a shipped "
                              f"config's name: {', '.join(shipped_names())}")
        try:
            with open(p, encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except OSError as exc:
            raise ConfigError(f"config file {str(p)!r}: cannot read it ({exc.strerror or exc})") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config file {str(p)!r}: not a UTF-8 text file; give a YAML file") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            what = getattr(exc, "problem", None) or "invalid YAML"
            raise ConfigError(f"config file {str(p)!r}:{where}: YAML syntax error ({what}); fix the file") from None
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(p)!r}: expected a mapping (key: value) at the top level, "
                              f"got {type(data).__name__}")
        _check_file_sections(data, Config, "", str(p))
    _move_keys(data)  # the file's own moved keys, before the overrides land on it
    overrides = _move_override_keys(list(overrides or []))
    _model_source_from_overrides(data, overrides)
    apply_overrides(data, overrides)
    return config_from_dict(data)


def _check_file_sections(data: dict[str, Any], cls: type, prefix: str, path: str) -> None:
    """A section of the config file that holds a value instead of keys (``trainer: 5``), named against the file:
    an override into it (``trainer.run_dir=...``) would otherwise report the file's mistake as its own."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        value, tp = data.get(f.name), hints[f.name]
        if value is None or not (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
            continue
        if not isinstance(value, dict):
            raise ConfigError(f"config file {path!r}: {prefix}{f.name}: expected a section (key: value lines), "
                              f"got {value!r}")
        _check_file_sections(value, tp, f"{prefix}{f.name}.", path)

"""GGUF files as a model source: ``model.path`` (and ``fastcov eval --model``, ``fastcov plan``) may name a
``.gguf`` file or a directory holding one.

The file is read by transformers' GGUF reader (the ``gguf`` package, extra ``fastcov[gguf]``): the weights are
dequantized to the run's dtype, the tokenizer and its chat template come from the same file. A model loaded
that way refuses ``save_pretrained``, and checkpoints, resume and vLLM all want a Hugging Face directory, so a
run converts the file once: a plain model of the same class, built from the GGUF model's config, takes its
state dict and is saved with the tokenizer to ``<run>/gguf-model`` (``convert_gguf``). That directory is then the
run's ``model.path``; a resumed run (or a second run into the same directory) reuses it when it was made from
the same file in the same dtype (``gguf-source.json``).

    path = gguf_file("SmolLM2-135M-Instruct.Q4_1.gguf")       # Path, or None for a Hugging Face directory
    check_gguf(path, "model.path")                            # ConfigError: no gguf package / architecture
    convert_gguf(path, Path("runs/x/gguf-model"), torch.float32)
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from fastcov.errors import ConfigError
from fastcov.trainer.runtime.run_dir import GGUF_MODEL as CONVERTED

if TYPE_CHECKING:
    import torch
    from torch import nn

SUFFIX = ".gguf"
# what a run's converted directory (<run>/gguf-model) was made from
SOURCE_FILE = "gguf-source.json"
INSTALL_HINT = "pip install 'fastcov[gguf]' (the gguf package)"
# llama.cpp's architecture names that transformers' GGUF reader renames (modeling_gguf_pytorch_utils)
_RENAMED = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}


def gguf_file(path: str | Path | None) -> Path | None:
    """The GGUF file ``path`` names: ``path`` itself when it ends in ``.gguf``, or the one ``.gguf`` file of a
    directory that has no ``config.json`` (a Hugging Face directory stays one). None when ``path`` is not a
    GGUF source (None, a hub id, a Hugging Face directory). Raises ConfigError for a directory with several."""
    if path is None:
        return None
    p = Path(path).expanduser()
    if p.suffix.lower() == SUFFIX:
        return p
    if not p.is_dir() or (p / "config.json").is_file():
        return None
    found = sorted(f for f in p.iterdir() if f.suffix.lower() == SUFFIX and f.is_file())
    if len(found) > 1:
        raise ConfigError(f"model.path: {str(p)!r} holds {len(found)} GGUF files "
                          f"({', '.join(f.name for f in found[:4])}); name the one to load")
    return found[0] if found else None


def gguf_available() -> bool:
    return importlib.util.find_spec("gguf") is not None


def gguf_architecture(path: Path) -> str:
    """``general.architecture`` of a GGUF file (llama.cpp's name: llama, qwen2, ...), read from its header."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError("no general.architecture key in its header")
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def supported_architectures() -> set[str]:
    """The llama.cpp architecture names the installed transformers can read from a GGUF file."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"}


def check_gguf(path: Path, key: str = "model.path") -> str:
    """Everything that can be checked before loading: the file exists, the ``gguf`` package is installed, the
    header reads, transformers knows the architecture. Returns the architecture; raises ConfigError naming
    ``key`` (one line) otherwise."""
    if not path.is_file():
        raise ConfigError(f"{key}: {str(path)!r} does not exist; give a .gguf file, a directory holding one, or "
                          "a Hugging Face model directory")
    if not gguf_available():
        raise ConfigError(f"{key}: {str(path)!r} is a GGUF file, and reading one needs the gguf package: "
                          f"{INSTALL_HINT}")
    try:
        arch = gguf_architecture(path)
    except (ValueError, OSError, KeyError, IndexError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{key}: {str(path)!r} is not a readable GGUF file ({exc})") from None
    known = supported_architectures()
    if arch not in known and _RENAMED.get(arch) not in known:
        import transformers

        raise ConfigError(f"{key}: {str(path)!r} holds a {arch!r} model, an architecture transformers "
                          f"{transformers.__version__} cannot read from GGUF (it reads: {', '.join(sorted(known))})")
    return arch


def load_gguf_tokenizer(path: Path):
    """The tokenizer (with its chat template) stored in the GGUF file ``path``."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (OSError, ValueError, KeyError, NotImplementedError) as exc:
        raise ValueError(f"model.tokenizer: cannot read the tokenizer of {str(path)!r}: {exc}") from exc


def load_gguf_model(path: Path, dtype: torch.dtype, attn: str | None = None) -> nn.Module:
    """The causal LM of the GGUF file ``path``, dequantized to ``dtype``, as a plain model of its class (one that
    ``save_pretrained`` accepts): transformers' GGUF-loaded model hands its state dict to a fresh model built
    from its config, every key matching."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    except (OSError, ValueError, KeyError, NotImplementedError) as exc:
        raise ValueError(f"model.path: cannot load {str(path)!r}: {exc}") from exc
    config = loaded.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    plain = AutoModelForCausalLM.from_config(config, dtype=dtype, **({"attn_implementation": attn} if attn else {}))
    with torch.no_grad():
        plain.load_state_dict(loaded.state_dict(), strict=True)
    if getattr(config, "tie_word_embeddings", False):
        plain.tie_weights()
    del loaded
    return plain.eval()


def _source_record(path: Path, dtype: torch.dtype) -> dict:
    st = path.stat()
    return {"gguf": str(path.resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "dtype": str(dtype)}


def convert_gguf(path: Path, out_dir: Path, dtype: torch.dtype) -> Path:
    """Write the GGUF file ``path`` as a Hugging Face directory ``out_dir`` (model in ``dtype``, tokenizer, chat
    template, ``gguf-source.json``), atomically (a temporary directory renamed into place). An ``out_dir`` already
    converted from the same file in the same dtype is kept as it is. Returns ``out_dir``."""
    from fastcov.trainer.runtime.checkpoint import fsync_path, fsync_tree

    out_dir = Path(out_dir)
    record = _source_record(path, dtype)
    if is_converted(out_dir, path, dtype):
        return out_dir
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    for p in (tmp, out_dir):
        if p.exists():
            shutil.rmtree(p)
    tokenizer = load_gguf_tokenizer(path)
    model = load_gguf_model(path, dtype)
    model.config.use_cache = True  # type: ignore[union-attr]  # a Hugging Face model
    model.save_pretrained(tmp)  # type: ignore[operator]
    tokenizer.save_pretrained(tmp)
    (tmp / SOURCE_FILE).write_text(json.dumps(record, indent=1) + "\n")
    fsync_tree(tmp)
    tmp.rename(out_dir)
    fsync_path(out_dir.parent)
    return out_dir


def is_converted(out_dir: Path, path: Path, dtype: torch.dtype) -> bool:
    """Whether ``out_dir`` is a finished conversion of the GGUF file ``path`` to ``dtype``."""
    try:
        return json.loads((Path(out_dir) / SOURCE_FILE).read_text()) == _source_record(path, dtype)
    except (OSError, ValueError):
        return False


def convert_for_run(mcfg, run_dir: Path, dtype: torch.dtype, rank: int) -> Path | None:
    """A run whose ``model.path`` is a GGUF source trains on ``<run_dir>/gguf-model``: rank 0 converts the file
    there (or keeps an earlier conversion of the same file and dtype), every rank waits for it, then
    ``mcfg.path`` names that directory (and so does the ``config.yaml`` the run writes). Every rank calls it,
    after the run directory exists. Returns the directory, or None when ``model.path`` is no GGUF source."""
    import time

    import torch.distributed as dist

    source = gguf_file(mcfg.path)
    if source is None:
        return None
    out = Path(run_dir) / CONVERTED
    if rank == 0:
        t0 = time.perf_counter()
        kept = is_converted(out, source, dtype)
        try:
            convert_gguf(source, out, dtype)
        except ValueError as exc:
            raise ConfigError(str(exc).splitlines()[0]) from None
        what = "kept" if kept else f"converted in {time.perf_counter() - t0:.1f}s"
        print(f"[fastcov] model.path: {source} as a Hugging Face directory {out} ({str(dtype)[6:]}, {what})",
              flush=True)
    if dist.is_initialized():
        dist.barrier()
    mcfg.path = str(out)
    return out

"""A GGUF file as the model of a whole run (trainer/runtime/gguf.py): the run converts it once into a Hugging Face
directory that trains, checkpoints and resumes (the loading and its errors: tests/trainer/runtime/test_gguf.py)."""

import json

import pytest

pytest.importorskip("gguf")
pytest.importorskip("transformers")

from _fixtures import ROOT, stable
from _gguf import tiny_hf_model, write_gguf

from fastcov.trainer.runtime import gguf as gguf_mod


@pytest.mark.slow
def test_a_gguf_file_trains_checkpoints_and_resumes(tmp_path):
    """The shipped SmolLM2 config with one override, model.path=<a .gguf file>: the run converts the file into
    <run>/gguf-model once, trains on it, exports final/, and a resume continues from its checkpoint with the
    same metrics as an uninterrupted run (the tiny model and task instead of SmolLM2's, for time)."""
    from fastcov.trainer import train as train_mod
    from fastcov.trainer.config import load_config
    from fastcov.trainer.runtime.run_dir import read_metrics

    ref = tiny_hf_model("llama", tied=True)
    write_gguf(ref, tmp_path / "tiny.gguf")
    from fastcov.trainer.data.chat_arith import Level, write_task

    write_task(str(tmp_path / "train.parquet"), str(tmp_path / "val.parquet"), 16, 4, Level(1, 1))
    small = [f"data.train_files=[{tmp_path / 'train.parquet'}]", f"data.val_files=[{tmp_path / 'val.parquet'}]",
             "trainer.max_steps=2", "trainer.save_every=1", "trainer.prompts_per_step=2", "rollout.n=2",
             "rollout.max_new_tokens=6", "trainer.eval_every=0", "algo.mini_batches=1", "reward.sandbox=inline",
             "trainer.progress=false"]

    def cfg(name):
        return load_config(ROOT / "configs" / "smollm2.yaml", [f"model.path={tmp_path / 'tiny.gguf'}",
                                                                f"trainer.run_dir={tmp_path / name}", *small])

    full = train_mod.train(cfg("full"))
    assert (full / "gguf-model" / "config.json").is_file() and (full / "final" / "config.json").is_file()
    written = json.loads((full / "gguf-model" / gguf_mod.SOURCE_FILE).read_text())
    assert written["gguf"] == str((tmp_path / "tiny.gguf").resolve()) and written["dtype"] == "torch.float32"
    assert "gguf-model" in (full / "config.yaml").read_text()
    cut = cfg("cut")
    train_mod.train(cut, stop_at=1)
    stamp = (tmp_path / "cut" / "gguf-model" / "config.json").stat().st_mtime_ns
    train_mod.train(cfg("cut"), resume=True)
    assert (tmp_path / "cut" / "gguf-model" / "config.json").stat().st_mtime_ns == stamp  # converted once

    assert stable(read_metrics(full / "metrics.jsonl")) == stable(read_metrics(tmp_path / "cut" / "metrics.jsonl"))

"""The trainer bench's real-vocabulary model: Qwen2.5's 151,936-token vocabulary and head on the demo's task.

    python -m bench.real_vocab --work runs/bench-trainer      # build it alone (bench.trainer builds it when needed)

``bench.trainer``'s cases a-c run on the demo's ~126-token vocabulary, where the LM head is a rounding error and
fastcov's fused head has nothing to save. Cases e-g run here instead: a Qwen2 built from config with Qwen2.5's
vocabulary (151,936) and, on CPU, Qwen2.5-0.5B's tied head (151,936 × 896) over a 2-layer body (``ARCHS``), so
that the head is most of each token's work, as it is in the 0.5B model's RL at short answers. It is built once into
``<work>/real-vocab-<preset>/`` (reused while ``stamp.json`` matches):

1. the demo's supervised warm start of the body (``fastcov.trainer.experiments.demo.warm_start``) with the demo's
   own word-level tokenizer (126 tokens), tied embeddings;
2. a tokenizer whose ids cover the vocabulary (``build_tokenizer``): the demo's 126 entries, then filler tokens
   ``<|v126|>`` ... ``<|v151935|>`` that encoding text never produces and that decode to their own names (an answer
   holding one scores 0);
3. the model rebuilt from config at the full vocabulary: the warm start's body and its 126 embedding rows, and
   filler rows ``r = −β·u + ε`` (``filler_rows``): u a direction on which the warm start's final hidden states at
   the positions of its own sampled answers project positively, ε Gaussian with ``h·ε`` of unit standard
   deviation, and β set so that the fillers together carry ``FILLER_MASS`` of the probability at those positions
   on average. Sampling and log-probs
   then run over all 151,936 entries (each filler has a probability of its own), while the task still works.

``build.json`` beside the model records what the build measured (the fillers' mass, the smallest projection on u).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

VOCAB = 151_936  # Qwen2.5's (config.vocab_size of 0.5B to 7B)
# the fillers' summed probability at the warm start's answer positions, on average: one 15-token answer in ~70
# holds a filler at the start of RL
FILLER_MASS = 1e-3
# The body per bench.trainer preset; the vocabulary is VOCAB and the embeddings tied in all of them.
ARCHS: dict[str, dict] = {
    # Qwen2.5-0.5B's head (hidden 896, 14 heads / 2 KV heads, tied) over 2 layers with a narrow MLP: the body is
    # 9.2M parameters, the head 136M (272 MFLOP of a token's ~290 MFLOP forward)
    "cpu": dict(hidden_size=896, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=14,
                num_key_value_heads=2),
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1),
    # Qwen2.5-1.5B itself (its decoder at its own vocabulary and tied head)
    "gpu-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                     num_key_value_heads=2),
}
COMMON = dict(model_type="qwen2", tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
              max_position_embeddings=32768)
# The warm start of the body, per preset: supervised steps, lr, batch
SFT: dict[str, dict] = {"cpu": dict(steps=150, lr=1e-3, batch_size=32), "tiny": dict(steps=10, lr=3e-3, batch_size=8),
                        "gpu-1.5b": dict(steps=150, lr=1e-4, batch_size=32)}
# answers sampled from the warm start to place the filler rows: prompts, new tokens, rows per head chunk
PROBE = dict(prompts=64, max_new=32, seed=0, chunk=64)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def arch(preset: str, vocab: int | None = None) -> dict:
    """The preset's Qwen2 config (model_type first), at ``vocab`` entries when given (else the tokenizer's)."""
    out = {**COMMON, **ARCHS[preset]}
    if vocab is not None:
        out["vocab_size"] = vocab
    return out


def filler_name(i: int) -> str:
    return f"<|v{i}|>"


def build_tokenizer(vocab: int = VOCAB):
    """The demo's word-level tokenizer (``fastcov.trainer.data.synthetic.build_tokenizer``) extended to ``vocab``
    entries with filler tokens ``<|v{id}|>``: the same ids, encodings and chat template for the demo's text, and
    every id in [0, vocab) decodable."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from fastcov.trainer.data.synthetic import build_tokenizer as demo_tokenizer

    small = demo_tokenizer()
    spec = json.loads(small.backend_tokenizer.to_str())
    words = spec["model"]["vocab"]
    if vocab < len(words):
        raise ValueError(f"vocab must be at least the demo's {len(words)} tokens, got {vocab}")
    words.update({filler_name(i): i for i in range(len(words), vocab)})
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token=small.eos_token,
                                   pad_token=small.pad_token, unk_token=small.unk_token,
                                   chat_template=small.chat_template, clean_up_tokenization_spaces=False)


def answer_states(model, tok, data: Path, probe: dict) -> torch.Tensor:  # noqa: F821 - torch imported inside
    """Final hidden states fp32 [M, D] at the positions that predict the tokens of the warm start's own answers
    (one sampled answer, T = 1, to each of the first ``probe["prompts"]`` training prompts)."""
    import torch

    from fastcov.trainer.data.loading import load_examples
    from fastcov.trainer.rollout import HFRolloutEngine, SamplingParams

    examples, _ = load_examples([str(data / "train.parquet")], tok, max_prompt_len=512)
    prompts = [list(ex.prompt_ids) for ex in examples[: probe["prompts"]]]
    model.config.use_cache = True
    engine = HFRolloutEngine(model, [tok.eos_token_id], tok.pad_token_id, shares_policy=True)
    out = engine.generate(prompts, SamplingParams(1.0, 1.0, probe["max_new"]),
                          torch.Generator().manual_seed(probe["seed"]))
    states = []
    with torch.no_grad():
        for prompt, answer in zip(prompts, out.token_ids, strict=True):
            ids = torch.tensor([prompt + answer])
            hidden = model.get_decoder()(input_ids=ids).last_hidden_state[0]
            states.append(hidden[len(prompt) - 1: len(prompt) + len(answer) - 1])
    return torch.cat(states).float()


def margin_direction(states, steps: int = 300):
    """A unit vector u [D] with the largest smallest projection min_i states_i·u that a few hundred Adam steps on a
    soft minimum find, starting from the states' unit mean (their mean direction is usually close already)."""
    import torch

    u = states.mean(0).clone()
    u = (u / u.norm()).requires_grad_(True)
    opt = torch.optim.Adam([u], lr=0.01)
    temperature = float(states.norm(dim=1).mean()) / 50  # a soft minimum within ~2% of the states' norm
    for _ in range(steps):
        proj = states @ (u / u.norm())
        loss = temperature * torch.logsumexp(-proj / temperature, dim=0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    u = u.detach()
    return u / u.norm()


def filler_rows(states, head, n_fillers: int, mass: float, seed: int, chunk: int = 64):
    """(rows fp32 [n_fillers, D], stats): filler rows r = −β·u + ε for the head ``head`` [V0, D] of the warm start,
    with ``states`` [M, D] its final hidden states at answer positions. u: ``margin_direction``, on which every
    state projects positively when it can; ε: Gaussian, scaled so that h·ε has unit standard deviation at the
    states' mean norm; β: the smallest value at which the fillers' summed probability, averaged over the states,
    is ``mass`` (``stats["reached"]`` False, and the β of the lowest mass, where no β gets there: some state then
    projects negatively on u). The log-sum-exp over the fillers is c(h) − β·(h·u) with c(h) = logsumexp_e h·ε_e,
    so β is found from [M] vectors (the [M, n] products are formed ``chunk`` rows at a time)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    d = states.shape[1]
    u = margin_direction(states)
    proj = states @ u  # [M]
    scale = 1.0 / float(states.norm(dim=1).mean())
    eps = torch.randn(n_fillers, d, generator=g) * scale
    c = torch.cat([torch.logsumexp(states[i: i + chunk] @ eps.T, dim=1) for i in range(0, len(states), chunk)])
    real = torch.logsumexp(states @ head.float().T, dim=1)

    def share(beta: float) -> float:
        return float(torch.sigmoid(c - beta * proj - real).mean())

    grid = [0.0] + [10 ** (k / 20) for k in range(-40, 61)]  # 0, then 0.01 ... 1000
    shares = [share(b) for b in grid]
    below = [i for i, x in enumerate(shares) if x <= mass]
    if below and below[0] > 0:
        lo, hi = grid[below[0] - 1], grid[below[0]]
        for _ in range(50):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if share(mid) > mass else (lo, mid)
        beta = hi
    else:
        beta = grid[below[0]] if below else grid[min(range(len(grid)), key=shares.__getitem__)]
    per_position = torch.sigmoid(c - beta * proj - real)
    stats = {"beta": beta, "filler_mass_mean": float(per_position.mean()), "filler_mass_max": float(per_position.max()),
             "reached": bool(below), "min_projection": float(proj.min()), "positions": len(states),
             "eps_scale": scale}
    return -beta * u[None, :] + eps, stats


def expand(small_dir: Path, out_dir: Path, preset: str, data: Path, mass: float = FILLER_MASS,
           vocab: int = VOCAB, probe: dict | None = None) -> dict:
    """The warm start in ``small_dir`` (demo tokenizer, tied) rebuilt at ``vocab`` entries into ``out_dir`` (model
    and tokenizer, a Hugging Face directory); returns the filler statistics."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from fastcov.trainer.runtime.model import load_tokenizer

    probe = {**PROBE, **(probe or {})}
    from fastcov.trainer.config import ModelConfig

    small_tok = load_tokenizer(ModelConfig(path=str(small_dir)))
    small = AutoModelForCausalLM.from_pretrained(str(small_dir), dtype=torch.float32, attn_implementation="sdpa")
    small.eval()
    head = small.get_output_embeddings().weight.detach()
    states = answer_states(small, small_tok, data, probe)
    rows, stats = filler_rows(states, head, vocab - head.shape[0], mass, probe["seed"], probe["chunk"])
    tok = build_tokenizer(vocab)
    cfg = dict(arch(preset, vocab))
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                  bos_token_id=None)
    big = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    body = {k: v for k, v in small.model.state_dict().items() if k != "embed_tokens.weight"}
    missing, unexpected = big.model.load_state_dict(body, strict=False)
    if unexpected or missing != ["embed_tokens.weight"]:
        raise RuntimeError(f"expand: body weights do not match (missing {missing}, unexpected {unexpected})")
    with torch.no_grad():
        big.model.embed_tokens.weight.copy_(torch.cat([head, rows]))
    if big.get_output_embeddings().weight.data_ptr() != big.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("expand: the head is not tied to the embeddings")
    big.config.use_cache = True
    big.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return stats


def prepare(work: Path, preset: str, data: Path, sft_threads: int = 0) -> tuple[Path, dict]:
    """(the model directory, what its build measured) in ``<work>/real-vocab-<preset>``: built as the module
    docstring says, or reused when ``stamp.json`` matches. ``data``: the demo task's directory (bench.trainer's)."""
    from fastcov.trainer.experiments import demo

    root = work / f"real-vocab-{preset}"
    model, stamp_path, build_path = root / "model", root / "stamp.json", root / "build.json"
    stamp = json.dumps({"arch": arch(preset, VOCAB), "sft": SFT[preset], "mass": FILLER_MASS, "probe": PROBE,
                        "version": 1}, sort_keys=True)
    if (model / "config.json").is_file() and stamp_path.is_file() and stamp_path.read_text() == stamp \
            and build_path.is_file():
        log(f"[bench.real_vocab] reusing {model}")
        return model, json.loads(build_path.read_text())
    t0 = time.perf_counter()
    sft = SFT[preset]
    log(f"[bench.real_vocab] warm start of the body ({sft['steps']} supervised steps, hidden "
        f"{ARCHS[preset]['hidden_size']}, {ARCHS[preset]['num_hidden_layers']} layers, tied, demo tokenizer)")
    small_arch = {k: v for k, v in arch(preset).items() if k != "vocab_size"}
    scfg = demo.SFTConfig(steps=sft["steps"], lr=sft["lr"], batch_size=sft["batch_size"], threads=sft_threads)
    res = demo.warm_start(root / "sft", data, scfg, demo.MAX_OPS, demo.MAX_VALUE, arch=small_arch,
                          device="cuda" if preset.startswith("gpu") else "cpu")
    log(f"[bench.real_vocab] warm start done: loss {res['sft_loss']:.3f} in {res['sft_seconds']:.0f}s; rebuilding at "
        f"{VOCAB:,} entries")
    stats = expand(root / "sft" / "model", model, preset, data)
    build = {"sft_loss": res["sft_loss"], "sft_seconds": res["sft_seconds"], **stats, "vocab_size": VOCAB,
             "filler_mass_target": FILLER_MASS, "seconds": time.perf_counter() - t0}
    build_path.write_text(json.dumps(build, indent=1))
    stamp_path.write_text(stamp)
    log(f"[bench.real_vocab] {model}: fillers carry {stats['filler_mass_mean']:.2e} of the probability on average "
        f"(max {stats['filler_mass_max']:.2e}, β {stats['beta']:.2f}), built in {build['seconds']:.0f}s")
    return model, build


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.real_vocab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(ARCHS), default="cpu")
    ap.add_argument("--work", default="runs/bench-trainer", help="bench.trainer's work directory")
    ap.add_argument("--sft-threads", type=int, default=1, help="torch threads of the warm start (0: all; "
                    "bench.trainer's CPU preset: 1)")
    args = ap.parse_args(argv)
    from bench.trainer import task_data

    work = Path(args.work).resolve()
    data = task_data(work)
    model, build = prepare(work, args.preset, data, args.sft_threads)
    print(json.dumps({"model": str(model), **build}))
    return 0 if math.isfinite(build["filler_mass_mean"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())

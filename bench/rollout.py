"""Rollout benchmark: fastcov's HF engine against plain ``model.generate``, or against vLLM, on the same prompts.

    python -m bench.rollout                                   # CPU: a small Qwen2-shaped model
    python -m bench.rollout --hidden 896 --layers 24 --device cuda --dtype bfloat16   # Qwen2.5-0.5B shape
    python -m bench.rollout --engine vllm --threads 2         # HF engine and vLLM (its CPU build: .venv-vllm)

Two batches of the same size: "all-short" (every answer 16 tokens) and "one-long" (one answer 8× longer,
the rest 16). Answer lengths are forced (eos exactly when a row reaches its length, through hooks
that both engines share; see ``ForcedLength``), so the comparison is about how the engines spend decode
steps, not about what a
random model happens to say. Per case (engine × batch): wall seconds, generated tokens, tokens/s, peak
memory increment; one JSON line per case appended to ``<out>/<device>/rollout-<date>.jsonl`` as it
finishes, and the ratio one-long ÷ all-short per engine at the end.

``--engine vllm``: fastcov's HF engine and vLLM (the colocated engine as the trainer builds it, weights synced
from the same model; bf16, vLLM's model dtype) on the same prompts. vLLM gets the same answer lengths through
per-request ``max_tokens`` with ``ignore_eos`` (its sampler cannot be hooked the same way); it runs on every
core vLLM binds, so give the HF engine as many (``--threads``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import time
from pathlib import Path

import torch

from bench import _measure as M
from bench._common import log

SHORT = 16


def build_model(hidden: int, layers: int, vocab: int, device: torch.device, dtype: torch.dtype):
    """A randomly initialised Qwen2 causal LM (no download) with eos id 0."""
    from transformers import AutoConfig, AutoModelForCausalLM

    heads = max(1, hidden // 64)
    cfg = AutoConfig.for_model("qwen2", hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                               num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), vocab_size=vocab,
                               max_position_embeddings=4096, eos_token_id=0, pad_token_id=1, bos_token_id=None,
                               tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    model.config.use_cache = True
    return model


class ForcedLength:
    """Forces answer lengths: row 0's prompt is ``PAD_SHORTER`` tokens shorter than the others, so after
    left padding it is the only row whose attention mask starts with 0, whatever the engine does with
    the other rows. That row emits eos exactly at its ``long_answer``-th token, every other row at its
    ``SHORT``-th, and never before. A forward pre-hook reads the positions and the mask; a hook on the
    LM head edits the eos logit of the last position, so both engines see the same logits.
    """

    def __init__(self, model, prompt_len: int, long_answer: int, eos: int = 0):
        self.prompt_len, self.long_answer, self.eos = prompt_len, long_answer, eos
        self.state: tuple[torch.Tensor, torch.Tensor] | None = None
        self.handles = [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                        model.get_output_embeddings().register_forward_hook(self._post)]

    def remove(self):
        for h in self.handles:
            h.remove()

    def _pre(self, module, args, kwargs):
        mask = kwargs["attention_mask"].long()
        pos = kwargs.get("position_ids")
        last = (mask.cumsum(-1) - 1)[:, -1] if pos is None else pos[:, -1]
        is_long = mask[:, 0] == 0
        plen = torch.where(is_long, self.prompt_len - PAD_SHORTER, self.prompt_len)
        self.state = (last - plen + 2, torch.where(is_long, self.long_answer, SHORT))  # (k of the next token, n)

    def _post(self, module, inputs, output):
        k, n = self.state
        out = output.clone()
        big = torch.finfo(out.dtype).max / 4
        out[:, -1, self.eos] = torch.where(k >= n, big, torch.finfo(out.dtype).min).to(out.dtype)
        return out


PAD_SHORTER = 8


def make_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    """Random prompts (no eos/pad id); row 0 is PAD_SHORTER tokens shorter (see ForcedLength)."""
    g = torch.Generator().manual_seed(seed)
    body = torch.randint(2, vocab, (batch, prompt_len), generator=g).tolist()
    return [row[PAD_SHORTER:] if i == 0 else row for i, row in enumerate(body)]


def run_fastcov(model, prompts, lengths, max_new, device, seed):
    from fastcov.trainer.rollout import HFRolloutEngine, SamplingParams

    forced = ForcedLength(model, max(len(p) for p in prompts), lengths[0])
    engine = HFRolloutEngine(model, [0], 1, shares_policy=True)
    try:
        gen = torch.Generator(device=device).manual_seed(seed)
        M.sync(device)
        t0 = time.perf_counter()
        out = engine.generate(prompts, SamplingParams(1.0, 1.0, max_new), gen)
        M.sync(device)
        seconds = time.perf_counter() - t0
    finally:
        forced.remove()
    return [len(x) for x in out.token_ids], seconds


def run_generate(model, prompts, lengths, max_new, device, seed):
    L = max(len(p) for p in prompts)
    forced = ForcedLength(model, L, lengths[0])
    try:
        ids = torch.ones((len(prompts), L), dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, L - len(p):] = torch.tensor(p, device=device)
            mask[i, L - len(p):] = 1
        torch.manual_seed(seed)
        M.sync(device)
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                             top_k=0, max_new_tokens=max_new, eos_token_id=0, pad_token_id=1)
        M.sync(device)
        seconds = time.perf_counter() - t0
    finally:
        forced.remove()
    lens = []
    for row in out[:, L:].tolist():
        lens.append(row.index(0) + 1 if 0 in row else len(row))
    return lens, seconds


ENGINES = {"fastcov-hf": run_fastcov, "hf-generate": run_generate}


def vllm_runner(model, prompt_len: int, max_new: int, run_dir: str):
    """vLLM's colocated engine (``make_vllm_engine``) for ``model``, its weights synced from it; returns a
    runner with the signature of ``run_fastcov``."""
    from types import SimpleNamespace as NS

    from fastcov.trainer.config import load_config
    from fastcov.trainer.rollout.vllm_factory import make_vllm_engine
    from fastcov.trainer.runtime.distributed import init_distributed
    from fastcov.trainer.runtime.weight_buckets import iter_buckets

    cpu = torch.device("cpu")
    init_distributed(cpu)
    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml", [
        "rollout.engine=vllm", f"trainer.run_dir={run_dir}", f"rollout.max_new_tokens={max_new}",
        f"data.max_prompt_len={prompt_len}", "trainer.device=cpu"])
    eng = make_vllm_engine(cfg, model, NS(eos_token_id=0), device=cpu)
    eng.update_weights(iter_buckets(list(model.named_parameters()) + list(model.named_buffers()), 64 << 20))

    def run_vllm(model, prompts, lengths, max_new, device, seed):
        from fastcov.trainer.rollout import SamplingParams
        from fastcov.trainer.rollout.vllm_wire import sampling_kwargs

        params = [eng.vllm.SamplingParams(**{**sampling_kwargs(SamplingParams(1.0, 1.0, n), [0], seed * 100_003 + i),
                                             "ignore_eos": True}) for i, n in enumerate(lengths)]
        t0 = time.perf_counter()
        outs = eng.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        return [len(o.outputs[0].token_ids) for o in outs], seconds

    return run_vllm


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.rollout", description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--long-factor", type=int, default=8, help="the long answer is this many times SHORT")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="bench/results")
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf",
                   help="hf: fastcov's HF engine against model.generate; vllm: against vLLM")
    args = p.parse_args(argv)
    dev = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    device = torch.device(dev)
    dtype = getattr(torch, args.dtype or ("bfloat16" if dev == "cuda" else "float32"))
    if args.threads and dev == "cpu":
        torch.set_num_threads(args.threads)
    env = M.env_info(device)
    date = _dt.date.today().isoformat()
    out_path = Path(args.out) / env["device_slug"] / f"rollout-{date}.jsonl"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    model = build_model(args.hidden, args.layers, args.vocab, device, dtype)
    prompts = make_prompts(args.batch, args.prompt_len, args.vocab, seed=0)
    long_len = SHORT * args.long_factor
    batches = {"all-short": [SHORT] * args.batch, "one-long": [long_len] + [SHORT] * (args.batch - 1)}
    engines = dict(ENGINES)
    if args.engine == "vllm":
        import tempfile

        def run_vllm(*a):  # built on first use: the HF engine is measured before vLLM binds its threads
            if "fn" not in lazy:
                lazy["fn"] = vllm_runner(model, args.prompt_len, long_len, tempfile.mkdtemp(prefix="bench-vllm-"))
            return lazy["fn"](*a)

        lazy: dict = {}
        engines = {"fastcov-hf": run_fastcov, "vllm": run_vllm}
    log(f"rollout bench: {env['device_name']}; Qwen2 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
        f"{dtype}; batch {args.batch}, prompts {args.prompt_len} tokens, answers {SHORT} / {long_len}")
    results = {}
    for engine_name, fn in engines.items():
        for batch_name, lengths in batches.items():
            fn(model, prompts, lengths, long_len, device, 0)  # warm-up
            times, lens = [], None
            with M.PeakMemory(device) as pm:
                for rep in range(args.repeats):
                    lens, seconds = fn(model, prompts, lengths, long_len, device, rep)
                    times.append(seconds)
            if lens != lengths:
                raise RuntimeError(f"{engine_name}/{batch_name}: forced lengths not honoured: {lens} != {lengths}")
            seconds = M.median(times)
            row = {"engine": engine_name, "batch": batch_name, "rows": args.batch, "tokens": sum(lens),
                   "threads": torch.get_num_threads(),
                   "seconds": seconds, "tokens_per_s": sum(lens) / seconds, "peak_bytes": pm.peak_bytes,
                   "mem_method": pm.method, "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
                   "dtype": "bfloat16" if engine_name == "vllm" else str(dtype).removeprefix("torch."),
                   "prompt_len": args.prompt_len,
                   "device": env["device_name"], "torch": env["torch"], "date": date}
            results[(engine_name, batch_name)] = row
            with open(out_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            log(f"{engine_name:<12} {batch_name:<9} {seconds:8.3f} s  {row['tokens_per_s']:9.1f} tok/s  "
                f"peak {M.fmt_bytes(pm.peak_bytes)}")
    for engine_name in engines:
        ratio = results[(engine_name, "one-long")]["seconds"] / results[(engine_name, "all-short")]["seconds"]
        log(f"{engine_name}: one-long / all-short time = {ratio:.2f}")
        with open(out_path, "a") as f:
            f.write(json.dumps({"engine": engine_name, "summary": "one-long/all-short", "ratio": ratio,
                                "device": env["device_name"], "date": date}) + "\n")
    log(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

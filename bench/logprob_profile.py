"""Where the old-log-prob pass of a rollout batch spends its time: fastcov's trainer against TRL's, same tokens.

    python -m bench.logprob_profile                   # the trainer bench's CPU model and batch (16 x 8 answers)
    python -m bench.logprob_profile --profile         # and torch.profiler's top operators of the two main ways

``python -m bench.trainer`` measured fastcov's no-grad pass before the update (step 4, ``compute_old_logprobs``)
slower than TRL's (``_get_per_token_logps_and_entropies``) at similar answer lengths. This script times both on
one rollout batch of the bench's model (``bench.trainer``'s warm start, built into ``--work`` when missing): its
prompts from the demo's data and answers of the lengths the bench saw (8-24 tokens), and varies one thing at a
time: packing, the micro-batch token budget, entropy, the positions the LM head sees. Each way runs ``--reps``
times after one warm-up; the medians go to stdout as JSON lines and a table, ratios against fastcov's default.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def batch_sequences(model_dir: Path, data: Path, prompts: int, n: int, seed: int):
    """``prompts`` x ``n`` Sequences: the first prompts of the demo's train split (chat template, as the trainer
    tokenizes them), answers of uniform random length 8-24 drawn from the vocabulary (the pass's cost does not
    depend on which tokens they are)."""
    from bench.trainer import load_tok
    from fastcov.trainer.data.loading import load_examples
    from fastcov.trainer.runtime.batch import Sequence

    tok = load_tok(str(model_dir))
    examples, _ = load_examples([str(data / "train.parquet")], tok, max_prompt_len=512)
    rng = random.Random(seed)
    vocab = len(tok)
    seqs = []
    for g, ex in enumerate(examples[:prompts]):
        for _ in range(n):
            length = rng.randint(8, 24)
            seqs.append(Sequence(list(ex.prompt_ids), [rng.randrange(3, vocab) for _ in range(length)],
                                 [-1.0] * length, g))
    return seqs, tok.pad_token_id if tok.pad_token_id is not None else 0


def fastcov_pass(policy, seqs, pad_id: int, budget: int, packing: bool, entropy: bool) -> list[list[float]]:
    """The trainer's step 4 (``compute_old_logprobs``'s forward and per-sequence bookkeeping); returns each
    sequence's answer log-probs."""
    import torch

    from fastcov.trainer.runtime.batch import micro_batches

    with torch.no_grad():
        for mb in micro_batches(seqs, budget=budget, pad_id=pad_id, device=torch.device("cpu"), packing=packing):
            res = policy(**mb.model_inputs(), temperature=1.0, entropy=entropy)
            for si, (row, start, count) in zip(mb.seq_index, mb.spans, strict=True):
                seqs[si].old_logprob = res.logprob[row, start: start + count].float().tolist()
    return [s.old_logprob for s in seqs]


def trl_pass(lm, seqs, pad_id: int, batch_size: int, entropy: bool) -> list[list[float]]:
    """TRL 1.16's way: prompts left-padded, answers right-padded, one forward per ``batch_size`` rows with
    ``logits_to_keep`` = the longest answer, then log-softmax of the kept logits (``selective_log_softmax``);
    returns each sequence's answer log-probs."""
    import torch

    P = max(len(s.prompt) for s in seqs)
    C = max(len(s.response) for s in seqs)
    ids = torch.full((len(seqs), P + C), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, P - len(s.prompt): P] = torch.tensor(s.prompt)
        ids[i, P: P + len(s.response)] = torch.tensor(s.response)
        mask[i, P - len(s.prompt): P + len(s.response)] = 1
    out = []
    with torch.no_grad():
        for start in range(0, len(seqs), batch_size):
            b_ids, b_mask = ids[start: start + batch_size], mask[start: start + batch_size]
            logits = lm(input_ids=b_ids, attention_mask=b_mask, logits_to_keep=C + 1).logits[:, :-1]
            logp = torch.log_softmax(logits.float(), dim=-1)
            out.append(logp.gather(-1, b_ids[:, -C:, None]).squeeze(-1))
            if entropy:
                -(logp.exp() * logp).sum(-1)
    token = torch.cat(out)
    return [token[i, : len(s.response)].tolist() for i, s in enumerate(seqs)]


def timed(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ways(policy, lm, seqs, pad_id: int) -> dict:
    rows = len(seqs)
    return {
        "fastcov default (packed, budget 8192, entropy)": lambda: fastcov_pass(policy, seqs, pad_id, 8192, True, True),
        "fastcov, no entropy": lambda: fastcov_pass(policy, seqs, pad_id, 8192, True, False),
        "fastcov, padded rows": lambda: fastcov_pass(policy, seqs, pad_id, 8192, False, True),
        **{f"fastcov, packed, budget {b}": (lambda b=b: fastcov_pass(policy, seqs, pad_id, b, True, True))
           for b in (4096, 2048, 1024, 512)},
        "fastcov, padded, budget 1024": lambda: fastcov_pass(policy, seqs, pad_id, 1024, False, True),
        f"TRL, batches of {rows // 8}": lambda: trl_pass(lm, seqs, pad_id, rows // 8, False),
        f"TRL, batches of {rows // 8}, entropy": lambda: trl_pass(lm, seqs, pad_id, rows // 8, True),
        f"TRL, one batch of {rows}": lambda: trl_pass(lm, seqs, pad_id, rows, False),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.logprob_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="runs/bench-trainer", help="bench.trainer's work directory (its warm start)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (bench.trainer's CPU preset: 1)")
    ap.add_argument("--profile", action="store_true", help="also print torch.profiler's top operators")
    args = ap.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    from bench.trainer import PRESETS, prepare
    from fastcov.trainer.runtime.model import PolicyModel

    torch.set_num_threads(args.threads)
    p = PRESETS["cpu"]
    data, model_dir = prepare(Path(args.work).resolve(), p, "cpu")
    lm = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa").eval()
    policy = PolicyModel(lm).eval()
    seqs, pad_id = batch_sequences(model_dir, data, p["prompts"], p["n"], seed=0)
    tokens = sum(len(s) for s in seqs)
    log(f"[logprob_profile] {len(seqs)} sequences, {tokens} tokens, {args.threads} thread(s), {args.reps} reps")
    results = {}
    for name, fn in ways(policy, lm, seqs, pad_id).items():
        results[name] = timed(fn, args.reps)
        log(f"[logprob_profile] {name}: {results[name]:.3f} s")
    base = results["fastcov default (packed, budget 8192, entropy)"]
    print("| way | s per rollout batch | ÷ fastcov default |\n|---|---:|---:|")
    for name, s in results.items():
        print(f"| {name} | {s:.3f} | {s / base:.2f} |")
    print(json.dumps({"bench": "logprob_profile", "sequences": len(seqs), "tokens": tokens, "threads": args.threads,
                      "seconds": results}))
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        pick = ["fastcov default (packed, budget 8192, entropy)", f"TRL, batches of {len(seqs) // 8}"]
        all_ways = ways(policy, lm, seqs, pad_id)
        for name in pick:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                all_ways[name]()
            print(f"\n## {name}\n")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The fused head with a frozen LM head (LoRA, QLoRA): the backward skips dW = dZᵀ·H.

    python -m bench.lora_head                       # N 1024, D 1024, V 32768, fp32 on CPU (bf16 on CUDA)
    python -m bench.lora_head --n 4096 --d 3584 --v 152064 --repeats 5

Times ``fastcov.linear_logprob_entropy`` forward+backward (upstream: sum of log-prob + entropy) with the
head weight trainable (full fine-tuning: dH and dW) and frozen (LoRA with the head out of
``model.lora_targets``: dH only), medians of ``--repeats`` runs after one warm-up, and prints the ratio.
FLOPs: 8·N·D·V with dW, 6·N·D·V without.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def time_fwd_bwd(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, repeats: int
                 ) -> tuple[float, float]:
    """Median seconds of one forward+backward with a trainable and with a frozen head weight, the two
    runs interleaved (so that a machine whose load drifts slows both alike), after one warm-up each."""
    from fastcov import linear_logprob_entropy

    def once(train_head: bool) -> float:
        h = hidden.detach().requires_grad_(True)
        w = weight.detach().requires_grad_(train_head)
        if h.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = linear_logprob_entropy(h, w, labels)
        (out.logprob.sum() + out.entropy.sum()).backward()
        if h.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    once(True), once(False)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeats):
        for train_head in (True, False):
            times[train_head].append(once(train_head))
    return statistics.median(times[True]), statistics.median(times[False])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1024, help="tokens")
    ap.add_argument("--d", type=int, default=1024, help="hidden size")
    ap.add_argument("--v", type=int, default=32768, help="vocabulary")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device="cpu").manual_seed(0)
    hidden = (torch.randn(args.n, args.d, generator=gen) * 0.5).to(device, dtype)
    weight = (torch.randn(args.v, args.d, generator=gen) / args.d**0.5).to(device, dtype)
    labels = torch.randint(0, args.v, (args.n,), generator=gen).to(device)
    full, frozen = time_fwd_bwd(hidden, weight, labels, args.repeats)
    result = {"device": device.type, "dtype": str(dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
              "n": args.n, "d": args.d, "v": args.v, "repeats": args.repeats,
              "fwd_bwd_s_trainable_head": full, "fwd_bwd_s_frozen_head": frozen, "ratio": frozen / full}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"{device.type} {result['dtype']}, {result['threads']} threads, N {args.n}, D {args.d}, V {args.v}: "
              f"fwd+bwd {full * 1e3:.1f} ms with dW, {frozen * 1e3:.1f} ms frozen head ({frozen / full:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

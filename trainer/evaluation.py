"""Evaluation: avg@k on the validation prompts during training (``evaluate``; ``evaluate_run`` is the loop's step
8) and of a saved model (``evaluate_model``, behind `fastcov eval`), and from the same samples pass@k / mean@k,
diversity and calibration.

``EvalStats`` collects, per validation prompt, its samples' correctness, token ids, token log-probs and
final answers, as fixed-length sums that data-parallel ranks add up (``vector`` → all-reduce →
``finalize``). The metric definitions are those of ``fastcov.metrics``:

* ``val_pass@k`` / ``val_mean@k`` for k = 1, 2, 4, ..., eval_k (unbiased estimator over the n samples of
  each prompt; a prompt evaluated greedily has one sample and counts for k = 1 only);
* ``val_distinct_2`` (distinct bigrams of the response tokens over a prompt's samples) and
  ``val_distinct_answers`` (distinct final answers per prompt), over prompts with ≥ 2 samples;
* ``val_confidence`` (mean sequence confidence: geometric-mean token probability under the distribution
  the sample was drawn from), ``val_ece`` (10 equal-width bins), ``val_brier``, and
  ``val_calibration_bins``: [[count, mean confidence, accuracy], ...] per bin (the report's reliability plot).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from fastcov.metrics import default_ks, distinct_answers, distinct_n, pass_at_k, sequence_confidence
from fastcov.trainer.config import Config
from fastcov.trainer.rewards import REWARD_TASKS
from fastcov.trainer.rollout import SamplingParams
from fastcov.trainer.rollout.base import sample_seed
from fastcov.trainer.rollout.engine_process import engine_failure
from fastcov.trainer.runtime.distributed import all_sum

if TYPE_CHECKING:
    from fastcov.trainer.start import Run

BINS = 10
SAMPLED_EVAL_SOURCES = ("aime", "aime25", "amc")  # evaluated at eval_temperature; others greedily


class EvalStats:
    def __init__(self, max_k: int, answer_fn: Callable[[str], str | None] | None = None, bins: int = BINS):
        self.ks = default_ks(max(1, max_k))
        self.bins = bins
        self.answer_fn = answer_fn
        self.pass_sums = [[0.0, 0.0, 0.0] for _ in self.ks]  # pass@k sum, mean@k sum, prompts
        self.div = [0.0, 0.0, 0.0]  # distinct-2 sum, distinct answers sum, prompts with >= 2 samples
        self.cal = [[0.0, 0.0, 0.0] for _ in range(bins)]  # count, confidence sum, correct sum
        self.brier = [0.0, 0.0, 0.0]  # Σ (conf - ok)², Σ conf, samples

    def add_prompt(self, oks: list[bool], token_ids: list[list[int]], logprobs: list[list[float]],
                   texts: list[str]) -> None:
        n, c = len(oks), sum(bool(x) for x in oks)
        for i, k in enumerate(self.ks):
            if n >= k:
                self.pass_sums[i][0] += pass_at_k(n, c, k)
                self.pass_sums[i][1] += c / n
                self.pass_sums[i][2] += 1
        if n >= 2:
            self.div[0] += distinct_n(token_ids, 2)
            if self.answer_fn is not None:
                self.div[1] += distinct_answers(self.answer_fn(t) for t in texts)
            self.div[2] += 1
        for ok, lps in zip(oks, logprobs, strict=True):
            conf = sequence_confidence(lps)
            b = min(self.bins - 1, int(conf * self.bins))
            self.cal[b][0] += 1
            self.cal[b][1] += conf
            self.cal[b][2] += float(bool(ok))
            self.brier[0] += (conf - float(bool(ok))) ** 2
            self.brier[1] += conf
            self.brier[2] += 1

    def vector(self) -> list[float]:
        return ([v for row in self.pass_sums for v in row] + list(self.div)
                + [v for row in self.cal for v in row] + list(self.brier))

    def finalize(self, vec: list[float]) -> dict:
        """Metrics from the (rank-summed) ``vector``."""
        vec = list(vec)
        out: dict = {}
        for k in self.ks:
            p, m, cnt = vec[:3]
            vec = vec[3:]
            if cnt:
                out[f"val_pass@{k}"] = p / cnt
                out[f"val_mean@{k}"] = m / cnt
        d2, ans, cnt = vec[:3]
        vec = vec[3:]
        if cnt:
            out["val_distinct_2"] = d2 / cnt
            if self.answer_fn is not None:
                out["val_distinct_answers"] = ans / cnt
        cal = [vec[3 * b : 3 * b + 3] for b in range(self.bins)]
        sq, conf_sum, total = vec[3 * self.bins : 3 * self.bins + 3]
        if total:
            out["val_confidence"] = conf_sum / total
            out["val_brier"] = sq / total
            out["val_ece"] = sum(abs(s_ok / cnt - s_conf / cnt) * cnt / total for cnt, s_conf, s_ok in cal if cnt)
            out["val_calibration_bins"] = [[int(cnt), (s_conf / cnt) if cnt else None, (s_ok / cnt) if cnt else None]
                                           for cnt, s_conf, s_ok in cal]
        return out


def eval_sampling(data_source: str, tcfg, max_new_tokens: int) -> tuple[SamplingParams, bool]:
    """(sampling params, sampled?) for one validation prompt: aime/aime25/amc sample, others greedy."""
    src = data_source.lower()
    sampled = any(src == s or src.startswith(s + "_") or src.endswith("/" + s) for s in SAMPLED_EVAL_SOURCES)
    sampled = sampled or getattr(tcfg, "eval_sample_all", False)  # pass@k, diversity on any data source
    temp = tcfg.eval_temperature if sampled else 0.0
    return SamplingParams(temperature=temp, top_p=1.0, max_new_tokens=max_new_tokens), sampled


def evaluate(rollout, val_set, reward_fn, tokenizer, cfg: Config, rank: int, world: int,
             device: torch.device, step: int) -> dict[str, float]:
    """avg@k accuracy over the validation prompts (split across ranks); also per data source; and from the
    same samples pass@k, mean@k, diversity and calibration (``EvalStats``).
    ``reward_fn``: a ``RewardTask``; its ``final_answer`` (when it has one) feeds the distinct-answers metric."""
    t = cfg.trainer
    k = t.eval_k
    max_new = t.eval_max_new_tokens or cfg.rollout.max_new_tokens
    gen = torch.Generator(device=rollout.device).manual_seed(cfg.trainer.seed * 7919 + step)
    per_sample = cfg.rollout.seeding == "per_sample"  # sample j of prompt i: its own seed on any topology
    sources = sorted({e.data_source for e in val_set})
    per_source = {s: [0.0, 0.0] for s in sources}
    by_mode: dict[tuple[float, bool], list] = {}
    extra = EvalStats(k, getattr(reward_fn, "final_answer", None))
    mode_of = {}
    for s in sources:  # every rank walks the same modes: an engine shared by ranks generates collectively
        sp, sampled = eval_sampling(s, t, max_new)
        mode_of[s] = (sp.temperature, sampled)
        by_mode.setdefault(mode_of[s], [])
    for i in range(rank, len(val_set), world):  # this rank's prompts, by their index in the whole set
        by_mode[mode_of[val_set[i].data_source]].append((i, val_set[i]))
    for (temp, sampled), indexed in sorted(by_mode.items()):
        reps = k if sampled else 1  # greedy decoding gives k identical samples
        exs = [e for _, e in indexed]
        prompts = [e.prompt_ids for e in exs for _ in range(reps)]
        sampling = SamplingParams(temp, 1.0, max_new)
        if per_sample and temp > 0:  # evaluation's steps are negative: never a training step's seeds
            sampling.seeds = [sample_seed(t.seed, -1 - step, i, j) for i, _ in indexed for j in range(reps)]
        out = rollout.generate(prompts, sampling, gen)
        texts = tokenizer.batch_decode(out.token_ids, skip_special_tokens=True)
        oks = reward_fn.check_batch(texts, [e.ground_truth for e in exs for _ in range(reps)])
        for i, e in enumerate(exs):
            acc = sum(oks[i * reps : (i + 1) * reps]) / reps
            per_source[e.data_source][0] += acc
            per_source[e.data_source][1] += 1
            sl = slice(i * reps, (i + 1) * reps)
            extra.add_prompt(oks[sl], out.token_ids[sl], out.logprobs[sl], texts[sl])
    flat = all_sum([v for s in sources for v in per_source[s]], device)
    res = {}
    tot_acc = tot_n = 0.0
    for i, s in enumerate(sources):
        acc, n = flat[2 * i], flat[2 * i + 1]
        tot_acc += acc
        tot_n += n
        if len(sources) > 1 and n:
            res[f"val_acc/{s}"] = acc / n
    res["val_acc"] = tot_acc / max(tot_n, 1.0)
    res.update(extra.finalize(all_sum(extra.vector(), device)))
    return res


def evaluate_run(run: Run, step: int) -> dict:
    """The loop's step 8: ``evaluate`` with the run's rollout engine, validation set and reward (an asynchronous
    run's engine process that dies meanwhile stops the run in one line)."""
    with engine_failure(step, run.ckpt_root):
        return evaluate(run.rollout, run.val_set, run.reward_fn, run.tokenizer, run.cfg, run.rank, run.world,
                        run.device, step)


def evaluate_model(model: str, data: list[str], *, k: int = 1, temperature: float = 0.6, max_new_tokens: int = 256,
                   max_prompt_len: int = 2048, max_prompts: int = 0, batch_size: int = 64, device: str = "auto",
                   seed: int = 0, sample_all: bool = False, task: str = "math") -> dict:
    """The trainer's evaluation (``evaluate``) of a saved model (or a LoRA run's adapter directory, merged into
    the base it names) on parquet files: a dict
    with ``prompts``, ``k``, ``val_acc``, ``val_pass@k`` / ``val_mean@k``, diversity and calibration. Raises
    ValueError (or FileNotFoundError) when the model, tokenizer or data cannot be loaded. ``task``: a name in
    ``REWARD_TASKS`` (its default ``reward`` settings score the answers)."""
    from fastcov.trainer.config import Config, ModelConfig
    from fastcov.trainer.data.loading import load_examples
    from fastcov.trainer.rollout import HFRolloutEngine
    from fastcov.trainer.runtime.distributed import pick_device
    from fastcov.trainer.runtime.lora import is_adapter_dir, load_merged_adapter
    from fastcov.trainer.runtime.model import build_model, load_tokenizer
    from fastcov.trainer.runtime.precision import param_dtype

    mcfg = ModelConfig(path=model)
    dev = pick_device(device)
    tok = load_tokenizer(mcfg)
    if is_adapter_dir(model):  # a LoRA run's final/: its base with the adapter merged in
        net = load_merged_adapter(model, dev, param_dtype(mcfg, dev))
    else:
        net = build_model(mcfg, dev, param_dtype(mcfg, dev))
    examples, _ = load_examples(data, tok, max_prompt_len)
    if max_prompts:
        examples = examples[:max_prompts]
    net.config.use_cache = True  # type: ignore[union-attr]  # a Hugging Face model's config (nn.Module types it)
    engine = HFRolloutEngine(net, [tok.eos_token_id], tok.pad_token_id, batch_size)
    cfg = Config(model=mcfg)
    cfg.trainer.eval_k = k
    cfg.trainer.eval_temperature = temperature
    cfg.trainer.eval_max_new_tokens = max_new_tokens
    cfg.trainer.seed = seed
    cfg.trainer.eval_sample_all = sample_all
    cfg.reward.task = task
    reward_fn = REWARD_TASKS.get(task)(cfg.reward)
    try:
        res = evaluate(engine, examples, reward_fn, tok, cfg, 0, 1, dev, 0)
    finally:
        reward_fn.close()
    return {"prompts": len(examples), "k": k, **res}

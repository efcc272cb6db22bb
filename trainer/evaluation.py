"""Evaluation beyond avg@k, from the same samples: pass@k / mean@k, diversity, calibration.

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

from typing import Callable

from fastcov.metrics import default_ks, distinct_answers, distinct_n, pass_at_k, sequence_confidence

BINS = 10


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
        for ok, lps in zip(oks, logprobs):
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


def answer_fn_for(task: str) -> Callable[[str], str | None]:
    """The final answer of a response: the last \\boxed{} (math) or the last code block (code)."""
    if task == "code":
        from fastcov.trainer.code_tasks import extract_code

        return extract_code
    from fastcov.trainer.rewards import extract_boxed

    return extract_boxed

"""Raw metric values onto one scale, and the two role scores a sweep judges by.

Every metric becomes a number in [0, 1], higher better, so that a tolerance τ ∈ [0, 1]
on the ``old`` role's score means the same thing whatever the tasks measure:

- exact, contains, choice and accuracy-like lm-eval metrics are shares in [0, 1]: as they are.
- nll (mean per-token negative log-likelihood of the answer, lower better): exp(−nll), the
  geometric-mean probability per answer token, in (0, 1].
- lm-eval perplexities (perplexity, word_perplexity, byte_perplexity): 1/value, the
  geometric-mean probability per token, word or byte, the same scale as exp(−nll);
  bits_per_byte: 2^−value, that same probability per byte.
- any other lower-is-better lm-eval metric with a value in [0, 1] (an error rate): 1 − value.
Anything else (a higher-is-better value outside [0, 1], an unknown lower-is-better metric
outside it) is refused: no mapping would mean the same as the others.
"""

from __future__ import annotations

import math
from fractions import Fraction

from graftmerge.errors import GraftError
from graftmerge.evaluation.tasks import Task, TaskSuite

PERPLEXITIES = ("perplexity", "word_perplexity", "byte_perplexity")


def normalised(task: Task, value: float) -> float:
    """``value`` of ``task`` on [0, 1], higher better (NaN stays NaN); GraftError where no mapping fits."""
    if math.isnan(value):
        return math.nan
    if task.metric == "nll":
        return min(1.0, math.exp(-value))  # NLL ≥ 0; rounding may leave it a hair below
    metric = task.lm_eval.metric if task.lm_eval is not None else task.metric
    if task.higher_is_better:
        if 0 <= value <= 1:
            return float(value)
        raise GraftError(f"task {task.name!r}: metric {metric} is {value}, outside [0, 1]; "
                         "graftmerge cannot put it on the [0, 1] scale of the other tasks")
    if metric in PERPLEXITIES and value >= 1:
        return 1.0 / value
    if metric == "bits_per_byte" and value >= 0:
        return 2.0 ** -value
    if 0 <= value <= 1:
        return 1.0 - value
    raise GraftError(f"task {task.name!r}: lower-is-better metric {metric} is {value}, outside [0, 1]; "
                     "graftmerge cannot put it on the [0, 1] scale of the other tasks")


def role_scores(suite: TaskSuite, scores: dict[str, dict[str, float]], split: str) -> dict[str, float]:
    """{role: weighted mean of its tasks' normalised scores on ``split``}; NaN if any of them is NaN.

    Tasks without a score on ``split`` are left out; a role with no scored task is left out.
    """
    terms: dict[str, list[tuple[float, float]]] = {}
    for task in suite.tasks:
        value = scores.get(task.name, {}).get(split)
        if value is not None:
            terms.setdefault(task.role, []).append((task.weight, normalised(task, value)))
    return {role: weighted_mean(terms[role]) for role in ("old", "new") if role in terms}


def weighted_mean(terms: list[tuple[float, float]]) -> float:
    """Σ weight·value / Σ weight of (weight, value) pairs, correctly rounded; NaN if a value is NaN.

    Computed in exact rational arithmetic and rounded once: any positive finite weights
    (1e308 twice, whose float sum overflows; denormals like 5e-324, whose float products
    vanish) give the mean the weights mean, never inf, NaN or 0.
    """
    if any(math.isnan(value) for _, value in terms):
        return math.nan
    total = sum(Fraction(weight) for weight, _ in terms)
    return float(sum(Fraction(weight) * Fraction(value) for weight, value in terms) / total)

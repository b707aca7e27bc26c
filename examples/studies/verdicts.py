"""The studies' statistics: mean ± sample sd over seeds, every seed's value, and two kinds of
verdict on a difference between two arms, worded apart.

- *beyond spread*: |mean difference| > 2 x the pooled sd sqrt((sd_a^2 + sd_b^2) / 2): the arms
  differ, at the seeds run;
- *equivalent within ±m*: only for a margin m stated before the run, and only when the 90%
  confidence interval of the difference (Welch's, so two one-sided t tests at 5%) lies inside
  (-m, m);
- anything else is *not distinguishable at n seeds*: neither a difference nor an equality is
  shown. A wide spread (seeds that split) can hide any difference, so it never reads as the same.
"""

from __future__ import annotations

import math
from typing import Optional

VERDICT_RULE = ("a difference is *beyond spread* when |mean difference| > 2 x the pooled "
                "standard deviation sqrt((sd_a^2 + sd_b^2) / 2) of the two arms' seeds (sample "
                "sd); *equivalent within ±m* only where a margin m was stated before the run and "
                "the 90% confidence interval of the difference (Welch) lies inside (-m, m), i.e. "
                "two one-sided t tests at 5%; otherwise *not distinguishable at n seeds*, which "
                "shows neither a difference nor an equality; with one seed per arm there is no "
                "verdict. Cells list every seed's value after mean ± sd; *split* marks an arm "
                "whose sorted seed values (accuracies) leave a gap over 0.5: some seeds learned "
                "what others did not")

# One-sided 95% quantiles of Student's t for 1..30 degrees of freedom (a standard table). A
# fractional Welch df takes the entry below it, which widens the interval (conservative); past 30
# the entry for 30.
T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782,
       1.771, 1.761, 1.753, 1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708,
       1.706, 1.703, 1.701, 1.699, 1.697)

# Seeds of an accuracy-like value (in [0, 1]) whose sorted values leave a gap over this have split.
SPLIT_GAP = 0.5


def mean_sd(values: list) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1; NaN for one value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def t95(df: float) -> float:
    """The one-sided 95% t quantile for ``df`` degrees of freedom (``T95``, rounded down)."""
    return T95[min(max(int(math.floor(df)), 1), len(T95)) - 1]


def difference_interval(a: list, b: list) -> tuple[float, float]:
    """The 90% confidence interval of mean(a) - mean(b) (Welch: unequal variances, the
    Welch-Satterthwaite degrees of freedom); both arms need two seeds or more."""
    (ma, sa), (mb, sb) = mean_sd(a), mean_sd(b)
    va, vb = sa ** 2 / len(a), sb ** 2 / len(b)
    se = math.sqrt(va + vb)
    if se == 0.0:
        return ma - mb, ma - mb
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    half = t95(df) * se
    return ma - mb - half, ma - mb + half


def compare(a: list, b: list, margin: Optional[float] = None) -> tuple[float, str]:
    """(mean(a) - mean(b), the verdict): ``beyond spread``, ``equivalent within ±m`` (with
    ``margin`` m), ``not distinguishable at n seeds`` or ``one seed: no verdict``."""
    (ma, sa), (mb, sb) = mean_sd(a), mean_sd(b)
    if len(a) < 2 or len(b) < 2:
        return ma - mb, "one seed: no verdict"
    pooled = math.sqrt((sa ** 2 + sb ** 2) / 2)
    if abs(ma - mb) > 2 * pooled:
        return ma - mb, "beyond spread"
    if margin is not None:
        low, high = difference_interval(a, b)
        if -margin < low and high < margin:
            return ma - mb, f"equivalent within ±{margin:g}"
    seeds = str(len(a)) if len(a) == len(b) else f"{len(a)} and {len(b)}"
    return ma - mb, f"not distinguishable at {seeds} seeds"


def split(values: list) -> bool:
    """Whether accuracy-like seeds split: all in [0, 1] and a gap over ``SPLIT_GAP`` between two
    of them in sorted order."""
    ordered = sorted(values)
    return len(ordered) > 1 and 0.0 <= ordered[0] and ordered[-1] <= 1.0 and \
        max(b - a for a, b in zip(ordered, ordered[1:])) > SPLIT_GAP


def spread(values: list, digits: int = 3) -> str:
    """``mean ± sd (v1 / v2 / ...)``, every seed in seed order, ``, split`` when they split;
    the value alone for one seed."""
    mean, sd = mean_sd(values)
    if len(values) < 2:
        return f"{mean:.{digits}f}"
    seeds = " / ".join(f"{v:.{digits}f}" for v in values)
    return f"{mean:.{digits}f} ± {sd:.{digits}f} ({seeds}{', split' if split(values) else ''})"


def verdict_cell(a: list, b: list, digits: int = 3, margin: Optional[float] = None) -> str:
    diff, word = compare(a, b, margin)
    return f"{diff:+.{digits}f}, {word}"

"""The two-sample test of `dspark bench audit`'s T > 0 check: are two histograms of sampled token ids draws from
one distribution? Pure Python (no numpy, no scipy), pure functions.

    result = homogeneity_test(speculative_ids, plain_ids)     # HistogramTest: chi2, df, p, tv, bins
    result.p < alpha                                          # the two servers sample differently

Pearson's chi-square test of homogeneity on the 2 x K table of counts. A token whose pooled count (both samples)
is under MIN_POOLED (so its expected count per sample is under 5, where the chi-square approximation fails) goes
into one "rare" bin; a rare bin still under MIN_POOLED is merged into the smallest kept bin. Degrees of freedom:
K' - 1 over the K' bins left. The p-value is the chi-square survival function (the regularized upper incomplete
gamma Q(df / 2, chi2 / 2), by its series below a + 1 and its continued fraction above). The total-variation
distance of the two empirical histograms (before pooling) is reported beside it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

MIN_POOLED = 10  # pooled count of a bin: 5 expected per sample with equal sample sizes
GAMMA_EPS = 1e-14
GAMMA_ITERATIONS = 10_000


@dataclass(frozen=True)
class HistogramTest:
    chi2: float
    df: int
    p: float
    tv: float  # total-variation distance of the empirical histograms, 0..1
    bins: int  # after pooling
    n_a: int
    n_b: int

    def to_dict(self) -> dict:
        return {"chi2": self.chi2, "df": self.df, "p": self.p, "tv": self.tv, "bins": self.bins, "n_a": self.n_a,
                "n_b": self.n_b}


def total_variation(a: Counter, b: Counter) -> float:
    n_a, n_b = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a[k] / n_a - b[k] / n_b) for k in set(a) | set(b))


def pooled_bins(a: Counter, b: Counter) -> list[tuple[int, int]]:
    """(count in a, count in b) per bin: the common tokens, then one rare bin (module docstring)."""
    kept, rare = [], [0, 0]
    for key in sorted(set(a) | set(b)):
        if a[key] + b[key] >= MIN_POOLED:
            kept.append((a[key], b[key]))
        else:
            rare[0], rare[1] = rare[0] + a[key], rare[1] + b[key]
    if sum(rare) >= MIN_POOLED or not kept:
        kept.append((rare[0], rare[1]))
    elif sum(rare):
        smallest = min(range(len(kept)), key=lambda i: sum(kept[i]))
        kept[smallest] = (kept[smallest][0] + rare[0], kept[smallest][1] + rare[1])
    return [bin_ for bin_ in kept if sum(bin_)]


def homogeneity_test(sample_a: Sequence[int], sample_b: Sequence[int]) -> HistogramTest:
    """Pearson's chi-square test that two samples of token ids come from one distribution (module docstring)."""
    if not sample_a or not sample_b:
        raise ValueError("both samples need at least one token")
    a, b = Counter(sample_a), Counter(sample_b)
    n_a, n_b = len(sample_a), len(sample_b)
    bins = pooled_bins(a, b)
    total = n_a + n_b
    chi2 = 0.0
    for count_a, count_b in bins:
        pooled = count_a + count_b
        for count, n in ((count_a, n_a), (count_b, n_b)):
            expected = pooled * n / total
            chi2 += (count - expected) ** 2 / expected
    df = len(bins) - 1
    return HistogramTest(chi2, df, chi2_survival(chi2, df), total_variation(a, b), len(bins), n_a, n_b)


def chi2_survival(x: float, df: int) -> float:
    """P(X >= x) for X chi-square with df degrees of freedom (1.0 for df 0: no test)."""
    if df <= 0 or x <= 0:
        return 1.0
    return upper_gamma_q(df / 2.0, x / 2.0)


def upper_gamma_q(a: float, x: float) -> float:
    """The regularized upper incomplete gamma function Q(a, x) = Γ(a, x) / Γ(a), for a > 0, x >= 0."""
    if x < a + 1.0:
        return max(0.0, 1.0 - _lower_series(a, x))
    return min(1.0, _upper_fraction(a, x))


def _prefactor(a: float, x: float) -> float:
    return math.exp(a * math.log(x) - x - math.lgamma(a))


def _lower_series(a: float, x: float) -> float:
    """P(a, x) by its power series: x^a e^-x / Γ(a + 1) Σ x^n / ((a + 1) ... (a + n))."""
    term = total = 1.0 / a
    denominator = a
    for _ in range(GAMMA_ITERATIONS):
        denominator += 1.0
        term *= x / denominator
        total += term
        if abs(term) < abs(total) * GAMMA_EPS:
            break
    return total * _prefactor(a, x)


def _upper_fraction(a: float, x: float) -> float:
    """Q(a, x) by its continued fraction (modified Lentz), for x >= a + 1."""
    tiny = 1e-300
    b = x + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, GAMMA_ITERATIONS):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        step = d * c
        h *= step
        if abs(step - 1.0) < GAMMA_EPS:
            break
    return h * _prefactor(a, x)

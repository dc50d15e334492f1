"""Statistical checks shared by the distribution tests: chi-square and total variation bounds.

Thresholds are set far in the tail (false-alarm probability around 1e-9 to 1e-12), so a fixed
seed that passes once passes for good, and a real bias of the size the tests look for fails.
"""

from __future__ import annotations

import math

import numpy as np


def chi2_threshold(dof: int, z: float = 7.0) -> float:
    """Wilson-Hilferty chi-square quantile at ``z`` standard deviations (6: ~1e-9, 7: ~1e-12)."""
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + z * math.sqrt(c)) ** 3


def chi2_stat(counts: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom, pooling cells expected below 5 into one."""
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return float(((obs - exp) ** 2 / exp).sum()), int(keep.sum()) - 1


def tv_bound(p: np.ndarray, n: int, false_alarm: float = 1e-12) -> float:
    """A bound total variation of ``n`` i.i.d. draws from ``p`` exceeds with tiny probability.

    E[TV] <= sum sqrt(p(1-p)/n) / 2, and TV moves by at most 1/n per draw (McDiarmid).
    """
    return 0.5 * np.sqrt(p * (1 - p) / n).sum() + math.sqrt(math.log(1 / false_alarm) / (2 * n))


def assert_matches_distribution(tokens: np.ndarray, p: np.ndarray, z: float = 7.0) -> None:
    """Tokens drawn i.i.d. from ``p``: no mass off the support, chi-square and TV within bounds."""
    n = len(tokens)
    counts = np.bincount(tokens, minlength=len(p)).astype(np.float64)
    assert counts[p == 0].sum() == 0, f"drew zero-probability tokens: {counts}, p={p}"
    stat, dof = chi2_stat(counts, n * p)
    if dof > 0:
        assert stat < chi2_threshold(dof, z), f"chi2={stat:.1f} dof={dof} counts={counts} p={p}"
    tv = 0.5 * np.abs(counts / n - p).sum()
    bound = tv_bound(p, n)
    assert tv < bound, f"TV {tv:.4f} >= {bound:.4f}; counts={counts} p={p}"

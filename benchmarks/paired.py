"""Paired ratios of two configs measured round by round, with a 95 % confidence interval.

Each round runs both configs within seconds of each other, so their per-round ratio removes
the machine's drift. The geometric mean of those ratios, and Student's t interval on their
logarithms, say what a run (or several runs' rounds pooled) can tell: a ratio whose interval
holds 1 is no difference this many rounds resolve. The rounds of one run share two servers,
so a speed that one server keeps for its life is in every round of it: pool rounds of
several runs (new servers each) for an interval that covers that too.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

# Student's t, two-sided 95 % (0.975 quantile), for 1..30 degrees of freedom.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201,
         2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069,
         2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
_Z975 = 1.959964


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (beyond 30: the
    normal quantile with two terms of its expansion in ``1/df``, within 0.001)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, not {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def paired_ratio(mine: Sequence[float], ref: Sequence[float]) -> dict[str, Any]:
    """Geometric mean of ``mine[i] / ref[i]`` over the rounds where both are positive, and
    its 95 % confidence interval (t on the logarithms); ``None`` bounds under two rounds."""
    logs = [math.log(m / r) for m, r in zip(mine, ref, strict=True)
            if m > 0 and r > 0 and m == m and r == r]
    n = len(logs)
    if n == 0:
        return {"rounds": 0, "geo_mean": None, "ci95": [None, None]}
    mean = statistics.fmean(logs)
    if n < 2:
        return {"rounds": n, "geo_mean": math.exp(mean), "ci95": [None, None]}
    half = t975(n - 1) * statistics.stdev(logs) / math.sqrt(n)
    return {"rounds": n, "geo_mean": math.exp(mean),
            "ci95": [math.exp(mean - half), math.exp(mean + half)]}

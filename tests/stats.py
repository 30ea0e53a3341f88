"""Chi-square goodness of fit for sampled tokens against exact probabilities."""

from collections import Counter

import numpy as np
from scipy.stats import chisquare


def chi_square_pvalue(samples, probs: dict) -> float:
    """p-value that ``samples`` were drawn from ``probs`` (outcome -> probability).

    Outcomes with an expected count below 5 are pooled into one bin, as the test requires.
    A sample outside the support makes the p-value 0.
    """
    n = len(samples)
    counts = Counter(samples)
    if any(probs.get(k, 0.0) <= 0.0 for k in counts):
        return 0.0
    support = {k: p for k, p in probs.items() if p > 0.0}
    big = [k for k, p in support.items() if p * n >= 5]
    small = [k for k, p in support.items() if p * n < 5]
    obs = [counts.get(k, 0) for k in big]
    exp = [probs[k] * n for k in big]
    if small:
        obs.append(sum(counts.get(k, 0) for k in small))
        exp.append(sum(probs[k] for k in small) * n)
    exp = np.array(exp, dtype=float)
    exp *= n / exp.sum()
    return float(chisquare(obs, exp).pvalue)

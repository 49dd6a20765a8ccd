"""The unbiased pass@k estimator (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1).

Pure Python: counts in, probabilities out.
"""

from __future__ import annotations

from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of ``k`` samples drawn without replacement from ``n`` is correct, given
    that ``c`` of the ``n`` are: ``1 - C(n - c, k) / C(n, k)`` (Chen et al. 2021, eq. 1).

    Unbiased for the pass@k of the model when the ``n`` samples are i.i.d. Needs ``0 <= c <= n`` and
    ``1 <= k <= n``; exact integer binomials, so no cancellation for large ``n``.
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n correct samples, got c={c}, n={n}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def powers_of_two_up_to(n: int) -> list[int]:
    """The k reported for ``n`` samples per prompt: 1, 2, 4, ... <= n (n itself only if a power of two)."""
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return ks

"""Compiled kernels of the rank law: pure functions of ``(rank, n, alpha)``.

``P(rank r) = f(r) / H(n)`` with ``f(r) = r**-alpha`` and
``H(m) = f(1) + ... + f(m)``. ``H`` is exact (a summed table) up to ``R0``
and the Euler-Maclaurin expansion beyond it, ``H(m) = C + I(m) + E(m)``, good
to rounding. A draw inverts ``H`` in O(1): a closed-form guess from the
midpoint rule, and exact checks against ``H`` only when the guess lies
within its error of a rank boundary. Nothing here validates input.
"""

import numpy as np

from ..common.kernels import kernel

# Ranks up to R0 use the summed table; beyond it the Euler-Maclaurin remainder
# is below 1e-13 of f(R0) for alpha <= 3.
R0 = 64


@kernel
def rank_table(alpha):
    """Per-alpha constants, ``R0 + 4`` float64: ``H(0..R0)`` summed exactly,
    the Euler-Maclaurin constant ``C`` (``H(m) = C + I(m) + E(m)`` for
    ``m >= R0``), ``R0**(1 - alpha)`` and ``log(R0)``."""
    t = np.empty(R0 + 4, dtype=np.float64)
    t[0] = 0.0
    for r in range(1, R0 + 1):
        t[r] = t[r - 1] + float(r) ** -alpha
    t[R0 + 1] = t[R0] - _em_tail(float(R0), alpha)
    t[R0 + 2] = float(R0) ** (1.0 - alpha)
    t[R0 + 3] = np.log(float(R0))
    return t


@kernel
def _em_tail(x, alpha):
    """``E(x) = f/2 + f'/12 - f'''/720 + f'''''/30240`` at ``x``."""
    f = x ** -alpha
    ix2 = 1.0 / (x * x)
    d1 = -alpha * f / x
    d3 = d1 * (alpha + 1.0) * (alpha + 2.0) * ix2
    d5 = d3 * (alpha + 3.0) * (alpha + 4.0) * ix2
    return 0.5 * f + d1 / 12.0 - d3 / 720.0 + d5 / 30240.0


@kernel
def _integral(x, alpha):
    """``I(x)``: the integral of ``t**-alpha`` from ``R0`` to ``x``, without
    cancellation near ``alpha = 1``."""
    lg = np.log(x / R0)
    e = 1.0 - alpha
    if e == 0.0:
        return lg
    return float(R0) ** e * np.expm1(e * lg) / e


@kernel
def cum_weight(m, alpha, table):
    """``H(m) = 1**-alpha + ... + m**-alpha`` (``m >= 0``)."""
    if m <= R0:
        return table[m]
    x = float(m)
    return table[R0 + 1] + _integral(x, alpha) + _em_tail(x, alpha)


@kernel
def _first_above(t, lo, hi, alpha, table):
    """Smallest ``m`` in ``[lo, hi]`` with ``H(m) > t`` (``hi`` if none)."""
    while lo < hi:
        mid = (lo + hi) >> 1
        if cum_weight(mid, alpha, table) > t:
            hi = mid
        else:
            lo = mid + 1
    return lo


@kernel
def rank_of(t, n, alpha, table):
    """The rank ``r`` in ``1..n`` with ``H(r - 1) <= t < H(r)`` (``n`` if none)."""
    if t < table[R0] or n <= R0:
        lo = 1
        hi = min(n, R0)
        while lo < hi:  # few candidates: binary search in the table
            mid = (lo + hi) >> 1
            if table[mid] > t:
                hi = mid
            else:
                lo = mid + 1
        return lo
    # The continuous solution x of C + I(x) = t. By the midpoint rule
    # H(m) ~ C + I(m + 1/2), off by about alpha f(m) / (24 m), so x - 1/2
    # lies in (r - 1, r) up to that much plus t's rounding in units of f(x).
    # Only when x is that close to a boundary do exact checks against H
    # decide (a few draws in a thousand).
    e = 1.0 - alpha
    y = t - table[R0 + 1]
    if e == 0.0:
        lx = table[R0 + 3] + y
    else:
        # R0**(1 - alpha) is 0 for a huge alpha: no guess, the exact path decides.
        z = e * y / table[R0 + 2] if table[R0 + 2] > 0.0 else -np.inf
        lx = table[R0 + 3] + np.log1p(z) / e if z > -1.0 else np.inf
    g = np.exp(lx) - 0.5
    lo = R0 + 1
    if g >= n:
        r = n
    elif g < lo:
        r = lo
    else:
        r = int(np.ceil(g))
        fx = max(np.exp(-alpha * lx), 1e-300)  # f underflows for a huge alpha: exact path
        # x = exp(lx) carries lx's rounding times |lx|.
        tol = (alpha / (6.0 * g) + 1e-15 * (abs(t) + abs(table[R0 + 1])) / fx
               + 1e-15 * g * (abs(lx) + 2.0) + 1e-9)
        if r - g > tol and g - (r - 1) > tol:
            return r
    # Bracket the answer around r by growing steps, then bisect.
    d = 1
    while True:
        a = max(lo, r - d)
        b = min(n, r + d)
        if (a == lo or cum_weight(a - 1, alpha, table) <= t) and (
                b == n or cum_weight(b, alpha, table) > t):
            return _first_above(t, a, b, alpha, table)
        d *= 4


@kernel
def draw_ranks(n, alpha, beta, table, uniforms, stratified, batch_norm):
    """Ranks in ``1..n`` by the rank law, one per uniform in ``[0, 1)``.

    Stratified: draw ``b`` falls in the ``b``-th of ``k`` segments of equal
    probability (``k = len(uniforms)``), by the per-rank law inside it.
    Weights ``(n P)**-beta`` divided by the largest possible one (global: the
    last rank's) or the batch's largest; either way ``(r / r_ref)**(alpha * beta)``.
    Returns ranks (int64), probabilities (float64), weights (float32).
    """
    k = uniforms.shape[0]
    ranks = np.empty(k, dtype=np.int64)
    prob = np.empty(k, dtype=np.float64)
    weight = np.empty(k, dtype=np.float32)
    total = cum_weight(n, alpha, table)
    rmax = 0
    for b in range(k):
        if stratified:
            t = (b + uniforms[b]) * (total / k)
        else:
            t = uniforms[b] * total
        r = rank_of(t, n, alpha, table)
        ranks[b] = r
        rmax = max(rmax, r)
        prob[b] = float(r) ** -alpha / total
    ref = float(rmax) if batch_norm else float(n)
    ab = alpha * beta
    for b in range(k):
        weight[b] = (ranks[b] / ref) ** ab
    return ranks, prob, weight


@kernel
def rank_probabilities(ranks, n, alpha, table):
    """``P`` of ``ranks`` (int64, 1..n) among ``n``: ``f(r) / H(n)``."""
    total = cum_weight(n, alpha, table)
    out = np.empty(ranks.shape[0], dtype=np.float64)
    for i in range(ranks.shape[0]):
        out[i] = float(ranks[i]) ** -alpha / total
    return out

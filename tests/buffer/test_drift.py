"""Drift: after 10**7 random updates the root still equals math.fsum of the leaves.

Parents are recomputed from their children, never adjusted by deltas, so
the root's error stays at the rounding of one fresh sum however long the
tree lives. Run with ``pytest -m slow -s tests/buffer/test_drift.py`` to see the figure.
"""

import math

import numpy as np
import pytest

from bigper.prioritization.tree import PriorityTree

N = 2**16
BATCHES, BATCH = 10_000, 1_000


def uniform(rng, m):
    return rng.random(m)


def decades(rng, m):
    """Values over 17 decades, some zeros: where delta updates lose the most."""
    v = rng.random(m) * 10.0 ** rng.integers(-8, 9, m)
    v[rng.random(m) < 0.05] = 0.0
    return v


@pytest.mark.slow
@pytest.mark.parametrize("values", [uniform, decades])
def test_root_does_not_drift_after_ten_million_updates(values):
    rng = np.random.default_rng(2024)
    tree = PriorityTree(N)
    tree.set_all(rng.random(N))
    worst = 0.0
    for i in range(BATCHES):
        idx = rng.integers(0, N, BATCH)
        tree.set(idx, values(rng, BATCH))
        if i % 1000 == 999:
            leaves = tree.leaves.copy()
            worst = max(worst, abs(tree.total - math.fsum(leaves)) / math.fsum(leaves))
    leaves = tree.leaves.copy()
    exact = math.fsum(leaves)
    rel = abs(tree.total - exact) / exact
    nz = leaves[leaves > 0]
    print(f"\n{values.__name__}: drift after {BATCHES * BATCH:.0e} updates on {N} leaves: root={tree.total!r} "
          f"fsum={exact!r} relative error={rel:.3e} (worst checkpoint {max(worst, rel):.3e})")
    assert rel < 1e-12
    assert tree.min == nz.min()
    assert tree.check(rel=1e-12) == []

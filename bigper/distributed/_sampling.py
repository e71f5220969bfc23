"""The coordinator's arithmetic, without Ray: where each draw lands, and the
batch assembled from the shards' parts.

Shard totals laid end to end make one line of length ``T``::

    0          T_0          T_0+T_1                 T
    |--shard 0--|--shard 1---|-------shard 2---------|
      x     x      x     x      x     x     x     x      B stratified draws

Draw ``b`` is ``(b + u_b) * T / B`` (the same arithmetic and the same
uniforms as a local buffer), lands in the shard whose stretch holds it and
becomes a local target inside that shard, so ``P(i) = leaf_i / T`` exactly.
"""

from __future__ import annotations

import numpy as np

from ..batch import Batch
from ..prioritization._tree_kernels import W_MIN


def shard_capacities(capacity: int, num_shards: int) -> np.ndarray:
    """Capacity of each shard: as even as possible, the first shards one larger."""
    base, extra = divmod(capacity, num_shards)
    return np.array([base + (k < extra) for k in range(num_shards)], dtype=np.int64)


def lay_out(uniforms: np.ndarray, totals: np.ndarray, stratified: bool):
    """Shard and local target of each draw.

    Parameters
    ----------
    uniforms : (B,) float64 in [0, 1)
    totals : (S,) float64, the shard totals the draws are laid over (0 for a
        shard that is down or empty)

    Returns
    -------
    shard : (B,) int64
    local : (B,) float64, the target inside its shard, in ``[0, totals[shard]]``
        (the shard clamps the rounding at its upper end)
    total : float, ``T``
    """
    cum = np.cumsum(totals)
    total = float(cum[-1])
    n = uniforms.shape[0]
    if stratified:
        g = (np.arange(n) + uniforms) * (total / n)
    else:
        g = uniforms * total
    shard = np.searchsorted(cum, g, side="right")
    # Rounding can put a draw at T itself: it belongs to the last non-empty shard.
    np.minimum(shard, int(np.flatnonzero(totals > 0)[-1]), out=shard)
    starts = cum - totals
    return shard.astype(np.int64), g - starts[shard], total


def assemble(n: int, parts: dict, positions: dict, offsets: np.ndarray, total: float,
             floor: float, beta: float, batch_norm: bool) -> Batch:
    """One batch from the shards' parts.

    Parameters
    ----------
    parts : shard -> the dict ``Shard.sample`` returned
    positions : shard -> (m,) int64, the draws (positions in the batch) it served
    offsets : (S + 1,) int64, first global index of each shard
    total : ``T`` the draws were laid over
    floor : smallest ``leaf * scale`` over every live shard (for global weights)
    """
    order = [s for s in sorted(parts)]
    pos = np.concatenate([positions[s] for s in order])
    identity = bool((pos == np.arange(n)).all())

    def cat(arrays):
        if len(arrays) == 1 and identity:
            return arrays[0]
        joined = np.concatenate(arrays)
        if identity:
            return joined
        out = np.empty_like(joined)
        out[pos] = joined
        return out

    names = parts[order[0]]["data"].keys()
    data = {name: cat([parts[s]["data"][name] for s in order]) for name in names}
    indices = cat([parts[s]["slots"] + offsets[s] for s in order])
    gens = cat([parts[s]["gens"] for s in order])
    # P = (T_s as seen / T) * (leaf / T_s now) = leaf * scale / T; scale is 1.0
    # unless the shard's total moved between the look at it and the draw.
    eff = cat([parts[s]["leaves"] if parts[s]["scale"] == 1.0 else parts[s]["leaves"] * parts[s]["scale"]
               for s in order])
    prob = eff / total
    lo = eff.min() if batch_norm else floor
    with np.errstate(under="ignore", over="ignore"):
        weights = np.maximum((eff / lo) ** (-float(beta)), W_MIN).astype(np.float32)  # (as is_weight)
    return Batch(data, indices, weights, prob, gens)

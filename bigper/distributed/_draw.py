"""One ``sample`` call of the coordinator: totals, draws laid out, parts gathered.

The arithmetic lives in ``_sampling``; this module makes the round trips
(through ``ShardSet``) and retries when a shard dies or empties mid-call.
"""

from __future__ import annotations

import numpy as np

from ..batch import Batch
from ..errors import InvalidArgumentError, ShardUnavailableError
from ._sampling import assemble, lay_out
from ._shardset import ShardSet


def draw(sh: ShardSet, rng: np.random.Generator, offsets: np.ndarray, n: int, beta: float,
         stratified: bool, *, fresh: bool, batch_norm: bool) -> Batch:
    """``n`` transitions over the live shards, ``P(i) = leaf_i / T_live``.

    Tries again (at most ``num_shards + 2`` times) when a shard dies or empties
    between the look at the totals and the draw.
    """
    num_shards = sh.n
    sh.reap(sh.max_in_flight)
    for _ in range(num_shards + 2):
        live = sh.live()
        if not live:
            raise ShardUnavailableError(f"cannot sample: none of the {num_shards} shard(s) answered "
                                        f"within shard_timeout_s={sh.timeout:g} s")
        if len(live) == 1:
            batch = _one(sh, rng, offsets, live[0], n, beta, stratified, batch_norm)
            if batch is None:
                continue
            return batch
        if fresh:
            stats = sh.probe()
        else:
            sh.reap(0)
            stats = sh.cached()
        totals = np.array([stats[s][0] if s in stats else 0.0 for s in range(num_shards)])
        if not totals.sum() > 0:
            raise InvalidArgumentError(
                f"cannot sample: no sampleable transition (len={sum(st[2] for st in stats.values())} "
                f"on {len(stats)} live shard(s) of {num_shards})")
        shard, local, total = lay_out(rng.random(n), totals, stratified)
        positions, calls = {}, {}
        for s in stats:
            pos = np.flatnonzero(shard == s)
            # Pipelined: every live shard answers, so its cached total stays fresh.
            if pos.shape[0] or not fresh:
                positions[s] = pos
                calls[s] = sh.call(s, "sample", local[pos], totals[s], beta)
        replies = sh.collect(calls)
        parts = {s: r[0] for s, r in replies.items() if r[0] is not None}
        if len(replies) < len(calls) or any(p.get("empty") for p in parts.values()):
            continue  # a shard died or emptied mid-call: draw again over the live ones
        for s, r in replies.items():
            stats[s] = r[1]
        floor = min([st[1] * (parts[s]["scale"] if s in parts else 1.0) for s, st in stats.items()
                     if st[1] < np.inf] or [np.inf])
        return assemble(n, parts, {s: positions[s] for s in parts}, offsets, total, floor,
                        beta, batch_norm)
    raise ShardUnavailableError(f"sampling failed {num_shards + 2} times in a row: shards keep dying")


def _one(sh: ShardSet, rng, offsets, s: int, n: int, beta: float, stratified: bool, batch_norm: bool):
    """The only live shard lays the draws out itself: one round trip."""
    state = rng.bit_generator.state
    calls = {s: sh.call(s, "sample", None, 0.0, beta, rng.random(n), stratified)}
    reply = sh.collect(calls).get(s)
    if reply is None:
        return None  # it went down: try again over what is live
    part, st = reply
    if part.get("empty"):
        rng.bit_generator.state = state  # as a local buffer: no draw when empty
        raise InvalidArgumentError(f"cannot sample: no sampleable transition (len={st[2]} on the one live "
                                   f"shard of {sh.n})")
    return assemble(n, {s: part}, {s: np.arange(n)}, offsets, st[0], st[1], beta, batch_norm)

"""n-step windows: which transitions are complete, and what a window returns.

Transitions are numbered in the order they were added (their global id
``g``); with ``K`` envs added in lockstep, env ``g % K``'s next step is
``g + K``, and ``g`` lives in slot ``g % capacity``. A window starts at ``g``
and takes up to ``n`` steps of the same env, stopping after the first step
that ended the episode (terminated or truncated). ``ends[slot]`` holds bit 0
terminated and bit 1 truncated of the transition in that slot.
"""

import numpy as np

from ..common.kernels import kernel
from ..common.status import PENDING

TERMINATED = 1
TRUNCATED = 2


@kernel
def complete(first, count, capacity, k, n, ends, gid, status, out):
    """Fill ``out`` with the slots of pending transitions in
    ``[first, count)`` whose windows are now complete; return how many."""
    m = 0
    for g in range(first, count):
        s = g % capacity
        if status[s] != PENDING or gid[s] != g:
            continue
        done = g + (n - 1) * k < count
        if not done:
            h = g
            while h < count:
                if ends[h % capacity] != 0:
                    done = True
                    break
                h += k
        if done:
            out[m] = s
            m += 1
    return m


@kernel
def windows(gids, capacity, k, n, ends, gamma, slots, discount, terminated, truncated):
    """For each start ``gids[b]``: the window's slots (``slots[b, j]``, -1
    past its end), ``gamma**m`` or 0 where it terminated, and its end flags."""
    for b in range(gids.shape[0]):
        g = gids[b]
        m = 0
        term = False
        trunc = False
        for j in range(n):
            s = (g + j * k) % capacity
            slots[b, j] = s
            m += 1
            e = ends[s]
            if e & TERMINATED:
                term = True
                break
            if e & TRUNCATED:
                trunc = True
                break
        for j in range(m, n):
            slots[b, j] = -1
        terminated[b] = term
        truncated[b] = trunc
        discount[b] = 0.0 if term else gamma ** m


def nstep_view(gids, capacity, k, n, ends, gamma):
    """Slots ``(B, n)``, discount ``(B,)`` float32, terminated and truncated ``(B,)`` bool."""
    b = gids.shape[0]
    slots = np.empty((b, n), dtype=np.int64)
    discount = np.empty(b, dtype=np.float32)
    term = np.empty(b, dtype=np.bool_)
    trunc = np.empty(b, dtype=np.bool_)
    windows(gids, capacity, k, n, ends, gamma, slots, discount, term, trunc)
    return slots, discount, term, trunc


def powers_of(gamma: float, n: int) -> np.ndarray:
    """``gamma**j`` for ``j < n`` (float64): the weights of a window's rewards."""
    return gamma ** np.arange(n, dtype=np.float64)


@kernel
def _sums(rewards, slots, powers, out):
    for b in range(slots.shape[0]):
        r = 0.0
        for j in range(slots.shape[1]):
            if slots[b, j] < 0:
                break
            r += powers[j] * rewards[b, j]
        out[b] = r


def discounted_sum(rewards, slots, gamma):
    """Sum of ``gamma**j * rewards[b, j]`` over the valid ``j`` of each row
    (float64, in order of ``j``: ``core/feed.draw_kernel`` sums a window the same way)."""
    out = np.empty(slots.shape[0], dtype=np.float64)
    _sums(np.ascontiguousarray(rewards, dtype=np.float64), slots, powers_of(gamma, slots.shape[1]), out)
    return out

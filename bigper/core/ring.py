"""The ring: the bookkeeping of a buffer's ``capacity`` slots, and its counters.

Transition ``g`` (the ``g``-th row ever written, over every env) lives in
slot ``g % capacity``; each slot records::

    gid      the transition it holds (-1: none yet)      int64
    status   EMPTY, LIVE, PENDING or DEAD (``common/status.py``)  uint8
    ends     bit 0 terminated, bit 1 truncated            uint8
    pending  the key of a PENDING transition (n_step > 1)  float64

``gid`` follows from ``count`` (``expected_gid``): it is kept in memory and
in ``state()``, but never on disk (``layout.for_disk``; issue 43: 8 bytes a
transition); ``restore`` derives it where a state read from disk lacks it.

The ring counts the rows written (``count``), remembers the largest key
given (``max_leaf``, what a new transition gets) and whether each env's last
row ended its episode (``env_ended``). The writer, the reader and the
sequence items change and read these in place; the ring alone records and
restores them (``state``/``restore``, checked before by ``core/statecheck.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..common.kernels import kernel
from ..common.status import DEAD


def gid_of(slots: np.ndarray, count: int, capacity: int) -> np.ndarray:
    """The transition number slots ``slots`` hold after ``count`` adds (-1: none)."""
    g = slots + ((count - 1 - slots) // capacity) * capacity
    return np.where(slots < count, g, -1)


def expected_gid(count: int, capacity: int, out: np.ndarray | None = None, chunk: int = 1 << 20) -> np.ndarray:
    """The transition number each slot holds after ``count`` adds (-1: none), into
    ``out`` when given; ``chunk`` slots at a time (a 50M ring's temporaries stay small)."""
    out = np.empty(capacity, dtype=np.int64) if out is None else out
    for a in range(0, capacity, chunk):
        out[a:a + chunk] = gid_of(np.arange(a, min(capacity, a + chunk), dtype=np.int64), count, capacity)
    return out


def first_wrong_gid(gid: np.ndarray, count: int, chunk: int = 1 << 20) -> int:
    """The first slot whose ``gid`` is not what ``count`` adds give it, or -1."""
    c = gid.shape[0]
    for a in range(0, c, chunk):
        b = min(c, a + chunk)
        bad = np.flatnonzero(gid[a:b] != gid_of(np.arange(a, b, dtype=np.int64), count, c))
        if bad.size:
            return a + int(bad[0])
    return -1


class Book(NamedTuple):
    """The ring's bookkeeping as the writer's kernel takes it (``Ring.book``):
    the same arrays every call (their values change, never the arrays)."""

    gid: np.ndarray
    ends: np.ndarray
    status: np.ndarray
    pending: np.ndarray
    env_ended: np.ndarray


class Ring:
    """The slots' bookkeeping of one buffer (see the module docstring)."""

    ARRAYS = ("gid", "status", "ends", "pending")

    def __init__(self, capacity: int, num_envs: int, n_step: int):
        self.capacity, self.num_envs = capacity, num_envs
        self.gid = np.full(capacity, -1, dtype=np.int64)
        self.status = np.zeros(capacity, dtype=np.uint8)
        self.ends = np.zeros(capacity, dtype=np.uint8)
        self.pending = np.zeros(capacity if n_step > 1 else 0, dtype=np.float64)
        self.count = 0
        self.max_leaf = 1.0
        self.env_ended = np.ones(num_envs, dtype=bool)  # no episode in progress
        self.book = Book(self.gid, self.ends, self.status, self.pending, self.env_ended)
        # Writes begun (``Writer.write``), writes that failed (rolled back) and states taken
        # (``restore``): a feed's gather without the lock checks what it raced.
        self.writes = self.failed = self.restores = 0

    def __len__(self) -> int:
        """Transitions held (written, at most ``capacity``)."""
        return min(self.count, self.capacity)

    def state(self) -> tuple[dict, dict]:
        """``(meta, arrays)``: the counters and the slot arrays (the live ones: copy before changing)."""
        meta = {"count": self.count, "max_leaf": self.max_leaf, "env_ended": self.env_ended.tolist()}
        return meta, {name: getattr(self, name) for name in self.ARRAYS}

    def restore(self, meta: dict, arrays: dict) -> None:
        """Take a recorded state (checked by ``core/statecheck.py`` first); arrays are copied in."""
        self.restores += 1
        # (one recorded was checked equal to what count gives; one read from disk is derived)
        if "gid" in arrays:
            self.gid[:] = arrays["gid"]
        else:
            expected_gid(int(meta["count"]), self.capacity, out=self.gid)
        self.status[:] = arrays["status"]
        self.ends[:] = arrays["ends"]
        self.pending[:] = arrays.get("pending", self.pending)  # (early format-1 writers did not record it)
        self.count = int(meta["count"])
        self.max_leaf = float(meta["max_leaf"])
        self.env_ended[:] = meta["env_ended"]


# -- kernels over the ring's arrays (the writer's and the reader's) ------------------------------

@kernel
def batch_meta(idx, ends, gid, discount1, gen_out, term_out, trunc_out, disc_out):
    """One-step batch bookkeeping: generations and end flags of slots ``idx``,
    and the discount (``discount1[ends]``: gamma, or 0 where terminated)."""
    for b in range(idx.shape[0]):
        s = idx[b]
        e = ends[s]
        gen_out[b] = gid[s]
        term_out[b] = (e & 1) != 0
        trunc_out[b] = (e & 2) != 0
        disc_out[b] = discount1[e]


@kernel
def commit_rows(g0, slots, ends, valid, state, gid, ends_arr, status):
    """Record rows ``g0 ..`` at ``slots``: generation, end bits and status
    (``state``, or 3 (dead) where ``valid`` is given and False)."""
    use_valid = valid.shape[0] > 0
    for r in range(slots.shape[0]):
        s = slots[r]
        gid[s] = g0 + r
        ends_arr[s] = ends[r]
        status[s] = DEAD if use_valid and not valid[r] else state

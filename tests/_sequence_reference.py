"""A plain Python model of sequence items, built only from what was added
(no bigper code): which start steps are items, which are live, and the
exact (T, ...) window of fields and mask each one must come back as.

Rows are numbered globally (``g``); row ``g`` belongs to env ``g % num_envs``.
Every row's data is made from ``g`` (and, with frame stacks, from frame ids
drawn per env), so a wrong step, a stale frame or a missed padding shows.
"""

from __future__ import annotations

import numpy as np

FRAME = (3, 4)  # small frames, 12 bytes: compared byte by byte


class Ref:
    def __init__(self, capacity, num_envs, length, burn_in, period, frame_stack=None, gamma=0.99, seed=0):
        self.c, self.k = capacity, num_envs
        self.length, self.burn_in, self.period = length, burn_in, period
        self.T = burn_in + length
        self.fs = frame_stack
        self.gamma = np.float32(gamma)
        self.rows = []  # per global row: dict(data=..., term, trunc, valid)
        self.rng = np.random.default_rng(seed)
        # Per env, the frames the next obs stack continues (None: an episode starts).
        self.stream = [None] * num_envs
        self.frames = {}  # frame id -> bytes array
        self.next_frame = 0

    # -- data -----------------------------------------------------------------
    def _new_frame(self):
        f = self.next_frame
        self.next_frame += 1
        self.frames[f] = self.rng.integers(0, 256, FRAME, dtype=np.uint8)
        return f

    def make_row(self, g, term, trunc, valid=True):
        """The data the env of row ``g`` produces at that step."""
        e = g % self.k
        d = {"action": np.int64(7 * g + 1), "reward": np.float32(0.5 * g - 3),
             "state": np.array([g, -g, g % 5], dtype=np.float32)}
        if self.fs:
            k = self.fs
            ids = self.stream[e]
            if ids is None:  # a reset: the first frame repeated, as Atari wrappers stack it
                first = self._new_frame()
                ids = [first] * k
            nxt = ids[1:] + [self._new_frame()]
            d["obs"] = np.stack([self.frames[i] for i in ids])
            d["next_obs"] = np.stack([self.frames[i] for i in nxt])
            ended = term or trunc or not valid
            self.stream[e] = None if ended else nxt
        else:
            d["obs"] = np.array([g, g + 0.5], dtype=np.float32)
            d["next_obs"] = np.array([g + 1, g + 1.5], dtype=np.float32)
        return {"data": d, "term": bool(term), "trunc": bool(trunc), "valid": bool(valid)}

    def fields(self):
        spec = {"action": ((), np.int64), "reward": ((), np.float32), "state": ((3,), np.float32)}
        spec["obs"] = ((self.fs, *FRAME), np.uint8) if self.fs else ((2,), np.float32)
        return spec

    def add(self, row):
        self.rows.append(row)

    @property
    def count(self):
        return len(self.rows)

    # -- items ------------------------------------------------------------------
    def positions(self):
        pos, nxt = [], [0] * self.k
        for g, r in enumerate(self.rows):
            e = g % self.k
            if not r["valid"]:
                pos.append(-1)
                nxt[e] = 0
                continue
            pos.append(nxt[e])
            nxt[e] = 0 if (r["term"] or r["trunc"]) else nxt[e] + 1
        return pos

    def items(self):
        """``{g: "live" | "pending" | "dead"}`` for every item whose start row is
        still in the ring (by the ring alone; frames are not modelled)."""
        pos = self.positions()
        n, first = self.count, self.count - self.c
        out = {}
        for g in range(max(first, 0), n):
            p = pos[g]
            if p < 0 or p % self.period:
                continue
            early = g - min(p, self.burn_in) * self.k
            if early < first:
                out[g] = "dead"
                continue
            done = False
            for j in range(self.length):
                h = g + j * self.k
                if h >= n:
                    break
                if self.rows[h]["term"] or self.rows[h]["trunc"] or j == self.length - 1:
                    done = True
                    break
            out[g] = "live" if done else "pending"
        return out

    def window(self, g):
        """``(data, mask)`` of the item starting at row ``g``: fields ``(T, ...)``."""
        pos = self.positions()[g]
        steps = [None] * self.T
        for j in range(1, min(pos, self.burn_in) + 1):
            steps[self.burn_in - j] = g - j * self.k
        for j in range(self.length):
            h = g + j * self.k
            steps[self.burn_in + j] = h
            r = self.rows[h]
            if r["term"] or r["trunc"]:
                break
        mask = np.array([h is not None for h in steps])
        proto = self.rows[g]["data"]
        data = {}
        for name, v in proto.items():
            data[name] = np.zeros((self.T, *np.shape(v)), dtype=np.asarray(v).dtype)
        data["terminated"] = np.zeros(self.T, bool)
        data["truncated"] = np.zeros(self.T, bool)
        data["discount"] = np.zeros(self.T, np.float32)
        for t, h in enumerate(steps):
            if h is None:
                continue
            r = self.rows[h]
            for name, v in r["data"].items():
                data[name][t] = v
            data["terminated"][t] = r["term"]
            data["truncated"][t] = r["trunc"]
            data["discount"][t] = 0.0 if r["term"] else self.gamma
        return data, mask


def assert_window(got: dict, mask, want: tuple, where=""):
    """``got`` (one row of a batch: name -> (T, ...)) and ``mask`` equal the
    reference ``want``, byte for byte."""
    wdata, wmask = want
    np.testing.assert_array_equal(mask, wmask, err_msg=f"mask {where}")
    assert set(got) == set(wdata), (sorted(got), sorted(wdata))
    for name, v in wdata.items():
        g = np.asarray(got[name])
        assert g.dtype == v.dtype and g.shape == v.shape, (name, g.dtype, g.shape, v.dtype, v.shape)
        assert g.tobytes() == v.tobytes(), f"{name} differs {where}: {g} != {v}"

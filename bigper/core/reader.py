"""The read path: a sampled batch's data gathered from the storage and the
frame ring (obs and next_obs stacks, n-step returns, end flags, discounts),
optionally straight into the caller's arrays (``sample(out=...)``)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from . import nstep
from .ring import batch_meta
from ..batch import Batch
from ..frames.distinct import distinct_frames
from ..errors import InvalidArgumentError, InvalidTypeError, UnknownFieldError

# Lookup by the ends bits (1 terminated, 2 truncated): a take() beats a kernel call for a batch.
_TERM = np.array([False, True, False, True])
_TRUNC = np.array([False, False, True, True])


def _into(data: dict, out: dict) -> dict:
    """Copy into the ``out`` arrays the fields not already gathered into them
    (``_pair``: the frame gather of ``obs``/``next_obs``, filled or not by ``pair``)."""
    for name, o in out.items():
        if name != ".pair" and data[name] is not o:
            np.copyto(o, data[name])
            data[name] = o
    return data


class Reader:
    """Reads batches of a buffer: its config, storage, frame ring (or None),
    the fields stored row by row, every stored field's (shape, dtype), and its
    ``ends`` and ``gid`` arrays (the buffer changes them in place; the reader
    only reads them). ``fused`` (True): the kernel paths, else the general
    ones that tests hold them to (``tests/core/test_fused.py``)."""

    def __init__(self, cfg, store, frames, plain: dict, stored: dict, ends: np.ndarray, gid: np.ndarray):
        self.cfg, self.store, self.frames, self.plain, self.stored = cfg, store, frames, plain, stored
        self.ends, self.gid = ends, gid
        self.gamma = cfg.gamma
        self.discount1 = np.array([cfg.gamma, 0.0, cfg.gamma, 0.0], dtype=np.float32)
        self.successors = {f"next_{n}" for n in cfg.next_of}
        self.fused = True

    def transitions(self, idx: np.ndarray, w: np.ndarray, prob: np.ndarray, out) -> Batch:
        """The batch of the transitions at ``idx``."""
        if self.cfg.n_step == 1 and self.fused:
            # Generations, end flags and discounts in one kernel call.
            b = idx.shape[0]
            gen, term, trunc = np.empty(b, np.int64), np.empty(b, np.bool_), np.empty(b, np.bool_)
            disc = np.empty(b, np.float32)
            batch_meta(idx, self.ends, self.gid, self.discount1, gen, term, trunc, disc)
            return Batch.make(self.gather(idx, (term, trunc, disc), out), idx, w, prob, gen)
        return Batch.make(self.gather(idx, None, out), idx, w, prob, self.gid[idx])

    def windows(self, slots: np.ndarray, mask: np.ndarray, stacks: bool = True) -> tuple[dict, np.ndarray, tuple | None]:
        """``(data, mask, once)`` of the steps at ``slots`` (``(B, T)``, real
        where ``mask``: the windows of sequence items, ``Items.window``). With
        frame stacks, ``once`` says how each row's distinct frames travel once:
        ``("refs", refs)``, the stacks' frame ids (``to_torch`` takes the
        distinct frames from the batch's own stacks), or with ``stacks=False``
        ``("frames", frames, index)`` (``frames_once``; ``obs``/``next_obs``
        are then left out of ``data``: a device rebuilds them)."""
        b, t = mask.shape
        flat_slots = slots.reshape(-1)
        framed = self.frames is not None
        # Compressed frames: decode each row's distinct frames once and build the stacks from them
        # (a row of T steps names about T + k frames, its stacks 2 T k).
        once_first = framed and b > 0 and (not stacks or self.frames.log is not None)
        flat = self.gather(flat_slots, None, None, stacks="refs" if once_first else True)
        pad = ~mask
        some = bool(pad.any())
        once = None
        if once_first:
            refs = {name: flat.pop(f".{name}_ref").reshape(b, t, self.frames.k) for name in ("obs", "next_obs")
                    if f".{name}_ref" in flat}
            once = ("frames", *self.frames_once(refs, mask))
            if stacks:  # the stacks where gather puts them: after the per-row fields
                rest = {n: flat.pop(n) for n in list(flat) if n not in self.plain}
                for name, ix in once[2].items():
                    flat[name] = self.frames.expand(once[1], ix).reshape(b * t, *ix.shape[2:], *once[1].shape[2:])
                flat.update(rest)
        elif framed and b > 0:
            k = self.frames.k
            refs = {"obs": self.frames.refs("obs_ref", flat_slots).reshape(b, t, k)}
            if "obs" in self.cfg.next_of:
                refs["next_obs"] = self.frames.refs("next_obs_ref", flat_slots).reshape(b, t, k)
            once = ("refs", refs)
        data = {}
        for name, v in flat.items():
            v = v.reshape((b, t, *v.shape[1:]))
            if some:
                # obs and next_obs may be two views of one gather: zeroing both
                # at the same padded steps zeroes the whole of those steps.
                if not v.flags.writeable:
                    v = v.copy()
                v[pad] = 0
            data[name] = v
        return data, mask, once

    def frames_once(self, refs: dict, mask: np.ndarray) -> tuple[np.ndarray, dict]:
        """Each row's distinct frames once, gathered from the frame store:
        ``(frames, index)`` with ``frames`` ``(B, n, *frame)`` (zero frames
        for padded steps) and, by stack name, the ``(B, T, k)`` positions of
        its frames in its row (``batch.distinct_frames``)."""
        ids, index, _ = distinct_frames(refs, mask)
        b, n = ids.shape
        frames = self.frames.rows_of(ids.reshape(-1)).reshape((b, n, *self.frames.frame_shape))
        return frames, index

    def gather(self, idx: np.ndarray, meta, out, stacks=True) -> dict:
        """The batch's data at slots ``idx``; ``out``: arrays (checked by
        ``check_out``) that large fields are gathered into directly and small
        ones copied into. ``stacks="refs"``: the frame ids of the ``obs`` and
        ``next_obs`` stacks (``_obs_ref``, ``_next_obs_ref``) instead of the stacks."""
        cfg = self.cfg
        out = out or {}
        if meta is not None and self.frames is None and self.store.in_memory and self.store.arrays is not None:
            # The common small-field case: one take per field, straight from the arrays.
            arrays = self.store.arrays
            # mode="clip": slots are in range, and "raise" would gather into a temporary first
            data = {name: arrays[name].take(idx, axis=0, out=out.get(name), mode="clip") for name in self.plain}
            data["terminated"], data["truncated"], data["discount"] = meta
            return _into(data, out)
        store = self.store
        arrays = store.arrays if self.fused else None

        def read(name, rows, o=None):
            if arrays is not None:  # take() beats fancy indexing for a batch of rows
                return arrays[name].take(rows, axis=0, out=o, mode="clip")
            v = store.read(name, rows)
            if o is None:
                return v
            np.copyto(o, v)
            return o

        last, ends = self.window_ends(idx, meta)
        data = {}
        for name in self.plain:
            data[name] = ends[name] if name in ends else \
                read(name, last if name in self.successors else idx, out.get(name))
        if self.frames is not None and stacks == "refs":
            data[".obs_ref"] = self.frames.refs("obs_ref", idx)
            if "obs" in cfg.next_of:
                data[".next_obs_ref"] = self.frames.refs("next_obs_ref", last)
        elif self.frames is not None:
            if "obs" not in cfg.next_of:
                data["obs"] = self.frames.stacks("obs_ref", idx, out.get("obs"))
            elif "obs" in out or "next_obs" in out:  # each straight into its own array
                data["obs"] = self.frames.stacks("obs_ref", idx, out.get("obs"))
                data["next_obs"] = self.frames.stacks("next_obs_ref", last, out.get("next_obs"))
            else:  # (n-step: next_obs at each window's last slot; compressed, one decode for both)
                data["obs"], data["next_obs"] = self.frames.pair(idx, out.get(".pair"), last)
        data.update(ends)
        return _into(data, out)

    def window_ends(self, idx: np.ndarray, meta=None) -> tuple[np.ndarray, dict]:
        """``(last, ends)`` of the transitions at slots ``idx``: the slot their
        successor fields read (the last of each n-step window) and, by name,
        their end flags, discount and, with n-step, discounted reward.
        ``meta``: ``(terminated, truncated, discount)`` already computed."""
        cfg = self.cfg
        if cfg.n_step == 1:
            if meta is None:
                e = self.ends.take(idx)
                meta = _TERM.take(e), _TRUNC.take(e), self.discount1.take(e)
            return idx, dict(zip(("terminated", "truncated", "discount"), meta))
        slots, disc, term, trunc = nstep.nstep_view(
            self.gid[idx], cfg.capacity, cfg.num_envs, cfg.n_step, self.ends, self.gamma)
        last = slots[np.arange(idx.shape[0]), (slots >= 0).sum(axis=1) - 1]
        rewards = self._read("reward", np.where(slots >= 0, slots, idx[:, None]).ravel()).reshape(slots.shape)
        rdt = cfg.dtype("reward")
        reward = nstep.discounted_sum(rewards, slots, self.gamma).astype(rdt if rdt.kind == "f" else np.float32)
        return last, {"reward": reward, "terminated": term, "truncated": trunc, "discount": disc}

    def plan(self, idx: np.ndarray, mask: np.ndarray | None = None) -> dict:
        """The host half of a batch whose data a device holds (``device.Mirror``).

        ``idx``: slots (``(B,)`` transitions, or ``(B, T)`` the steps of
        sequence items); ``mask``: which of them are real (padded steps read
        the zero row at the end of each device array). Returns

        - ``up``: the arrays that travel (frame ids, slots, end flags,
          discount, the n-step reward), by key;
        - ``take``: ``field -> key`` of the slots each stored field is
          gathered at on the device (``"indices"``: the batch's own);
        - ``stacks``: ``name -> (key, columns)``: the ``obs``/``next_obs``
          stacks gathered at those frame ids (``columns``: a slice of a
          ``(B, k + 1)`` pair gather, or None);
        - ``order``: the batch's keys in order.
        """
        cfg = self.cfg
        shape = idx.shape
        flat = idx.reshape(-1)
        last, up = self.window_ends(flat)
        pad = None if mask is None or mask.all() else ~mask.reshape(-1)
        if pad is not None:
            up = {n: np.where(pad, 0, v).astype(v.dtype) for n, v in up.items()}
        if len(shape) > 1:
            up = {n: v.reshape(shape) for n, v in up.items()}
        take = {}
        for name in self.plain:
            if name in up:
                continue
            if name in self.successors and last is not flat:
                take[name] = ".last"
            elif pad is not None:
                take[name] = ".slots"
            else:
                take[name] = "indices" if len(shape) == 1 else ".slots"
        if ".last" in take.values():
            up[".last"] = last if pad is None else np.where(pad, -1, last)
        if ".slots" in take.values():
            up[".slots"] = (flat if pad is None else np.where(pad, -1, flat)).reshape(shape)
        stacks = {}
        if self.frames is not None:
            ro = self.frames.refs("obs_ref", flat)
            rn = self.frames.refs("next_obs_ref", last) if "obs" in cfg.next_of else None
            if rn is not None and pad is None and len(shape) == 1 and (rn[:, :-1] == ro[:, 1:]).all():
                up[".pair"] = np.concatenate([ro, rn[:, -1:]], axis=1)  # obs, next_obs: one (B, k + 1) gather
                stacks = {"obs": (".pair", slice(None, -1)), "next_obs": (".pair", slice(1, None))}
            else:
                for name, r in (("obs", ro), ("next_obs", rn)):
                    if r is not None:
                        up[f".{name}"] = (r if pad is None else np.where(pad[:, None], -1, r)).reshape(*shape, -1)
                        stacks[name] = (f".{name}", None)
        order = list(self.plain) + list(stacks)
        order += [n for n in ("reward", "terminated", "truncated", "discount") if n not in order and n in up]
        return {"up": up, "take": take, "stacks": stacks, "order": order}

    def _read(self, name: str, rows: np.ndarray) -> np.ndarray:
        arrays = self.store.arrays
        if arrays is not None:
            return arrays[name].take(rows, axis=0, mode="clip")
        return self.store.read(name, rows)

    def staging_specs(self, b: int) -> dict:
        """``name -> (shape, dtype)`` of what a batch of ``b`` transitions is
        gathered into when it is bound for a device (``tensors.pinned.Staged``): every
        field, the frames of ``obs``/``next_obs`` as one ``(b, k + 1)`` gather
        where they pair (``FrameStore.pair``), and the bookkeeping."""
        specs = {name: ((b, *shape), np.dtype(dtype)) for name, (shape, dtype) in self.stored.items()}
        if self.cfg.n_step > 1:
            rdt = self.cfg.dtype("reward")
            specs["reward"] = ((b,), rdt if rdt.kind == "f" else np.dtype(np.float32))
        if self.frames is not None and "next_obs" in specs and self.cfg.n_step == 1:
            shape = specs.pop("obs")[0]
            del specs["next_obs"]
            specs[".pair"] = ((b, shape[1] + 1, *shape[2:]), self.frames.dtype)
        specs.update(terminated=((b,), np.dtype(bool)), truncated=((b,), np.dtype(bool)),
                     discount=((b,), np.dtype(np.float32)), weights=((b,), np.dtype(np.float32)),
                     indices=((b,), np.dtype(np.int64)), generations=((b,), np.dtype(np.int64)))
        return specs

    def check_out(self, out, b: int) -> dict:
        """``out`` for ``sample``: a dict of arrays, each one of the batch's keys,
        shape ``(b, ...)`` and dtype as ``sample`` returns it, C-contiguous and
        writable, no two sharing memory."""
        if out is None:
            return {}
        if not isinstance(out, Mapping):
            raise InvalidTypeError(f"out must be a dict name -> array, got {type(out).__name__}")
        specs = dict(self.stored)
        if self.cfg.n_step > 1:
            rdt = self.cfg.dtype("reward")
            specs["reward"] = ((), rdt if rdt.kind == "f" else np.dtype(np.float32))
        specs.update(terminated=((), np.dtype(bool)), truncated=((), np.dtype(bool)),
                     discount=((), np.dtype(np.float32)))
        checked = {}
        for name, arr in out.items():
            if name not in specs:
                raise UnknownFieldError(f"out[{name!r}]: not a field of the batch; expected some of {sorted(specs)}")
            shape, dtype = specs[name]
            want = (b, *shape)
            if not isinstance(arr, np.ndarray) or arr.shape != want or arr.dtype != dtype \
                    or not arr.flags.c_contiguous or not arr.flags.writeable:
                got = (f"{arr.dtype} {arr.shape}" + ("" if arr.flags.c_contiguous and arr.flags.writeable
                                                   else " (not C-contiguous and writable)")
                       if isinstance(arr, np.ndarray) else type(arr).__name__)
                raise InvalidArgumentError(f"out[{name!r}] must be a C-contiguous writable numpy array of "
                                           f"dtype {np.dtype(dtype)} and shape {want}, got {got}")
            for other, prev in checked.items():
                if np.shares_memory(arr, prev):
                    raise InvalidArgumentError(f"out[{name!r}] and out[{other!r}] share memory")
            checked[name] = arr
        return checked

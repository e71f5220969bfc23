"""A transition's frame references, stored as one frame id and small offsets.

A transition references the ``k`` frames of its ``obs`` stack and the ``k``
of its ``next_obs`` stack (``frames/store.py``). They were written within a
few steps of its env, so they lie close together::

    frame_ref  (capacity,)       int64   the newest frame id the transition references (-1: none)
    frame_off  (capacity, 2k)    uint8   frame_ref - id, for the obs stack then the next_obs stack
                                         (k columns without next_obs; uint16 or uint32 for many envs)

16 bytes a transition for k = 4, where the ids themselves took 64 (issue 43).
``assign_refs`` reuses a frame only within ``offset_reach`` of the frames it
writes, so every offset fits whatever the input. An older format stored the
ids whole (``obs_ref``, ``next_obs_ref``): ``refs_from_stacks`` converts them,
to wider offsets where an older writer reused a frame from further back than
the config's offsets reach (``OFFSET_DTYPES``); a buffer keeps the offsets it
was converted to (``check_offsets``: what a reader accepts).
"""

from __future__ import annotations

import numpy as np

from ..common.kernels import kernel


def offset_dtype(k: int, num_envs: int) -> np.dtype:
    """The dtype of ``frame_off``: the narrowest unsigned one whose range holds
    twice the frames a stack spans in a steady stream (each of ``num_envs``
    envs writes about one frame a step, so the oldest frame of a stack was
    written about ``k * num_envs`` ids before the newest), plus the ``2k``
    new frames one row may write. Only a frame the stream reuses from further
    back than that is written again (``offset_reach``)."""
    need = 2 * (k + 1) * num_envs + 2 * k
    for dt in (np.uint8, np.uint16):
        if need <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.uint32)


# The offsets a buffer may hold, narrowest first: its config's (``offset_dtype``), or a wider one
# its references were converted to (an older format's, ``refs_from_stacks``).
OFFSET_DTYPES = tuple(np.dtype(t) for t in (np.uint8, np.uint16, np.uint32, np.uint64))
_MOST_REACH = 1 << 62  # (uint64 offsets: a reach the kernels' int64 arithmetic holds)


def check_offsets(dtype, k: int, num_envs: int) -> np.dtype:
    """``dtype`` of stored offsets (read from disk: untrusted) when a buffer
    of ``k`` frames a stack and ``num_envs`` envs may hold it: native
    unsigned, no narrower than the config's ``offset_dtype``. Raises
    ``ValueError`` naming ``frame_off`` otherwise."""
    dt = np.dtype(dtype)
    least = offset_dtype(k, num_envs)
    if dt not in OFFSET_DTYPES or not dt.isnative or dt.itemsize < least.itemsize:
        ok = [str(t) for t in OFFSET_DTYPES if t.itemsize >= least.itemsize]
        raise ValueError(f"frame_off must be one of {ok} (native unsigned, at least the {least} of "
                         f"frame_stack={k}, num_envs={num_envs}), got {dt.str}")
    return dt


def offset_reach(k: int, dtype: np.dtype) -> int:
    """How far back (in frame ids, from the first frame a row may write) a
    reused frame may lie so that every offset of the row fits ``dtype``: the
    newest id of a row is at most ``2k - 1`` past its first new one."""
    return min(int(np.iinfo(dtype).max), _MOST_REACH) - 2 * k


@kernel
def pack_refs(obs_ref, next_ref, has_next, rows, fref, foff):
    """Row ``r`` of the ``(m, k)`` references ``obs_ref`` / ``next_ref`` as
    ``fref[rows[r]]`` (the newest id) and ``foff[rows[r]]`` (that id minus
    each reference: the obs stack's, then the next_obs stack's when
    ``has_next``). ``assign_refs`` keeps every offset within ``foff``'s dtype."""
    m, k = obs_ref.shape[0], obs_ref.shape[1]
    for r in range(m):
        base = obs_ref[r, 0]
        for j in range(k):
            base = max(base, obs_ref[r, j])
            if has_next:
                base = max(base, next_ref[r, j])
        s = rows[r]
        fref[s] = base
        for j in range(k):
            foff[s, j] = base - obs_ref[r, j]  # (in the dtype's range: assign_refs' reach)
            if has_next:
                foff[s, k + j] = base - next_ref[r, j]


def unpack_refs(fref: np.ndarray, foff: np.ndarray, k: int, stack: int) -> np.ndarray:
    """``(B, k)`` int64 frame ids of stack ``stack`` (0: obs, 1: next_obs) of
    the rows ``fref`` ``(B,)`` / ``foff`` ``(B, k or 2k)``."""
    return fref[:, None] - foff[:, stack * k:(stack + 1) * k].astype(np.int64)


def refs_from_stacks(stacks: list, k: int, num_envs: int, used: np.ndarray,
                     chunk: int = 1 << 20) -> tuple[np.ndarray, np.ndarray]:
    """``(frame_ref, frame_off)`` of the references an older format stored
    whole: ``stacks``, the ``(C, k)`` int64 arrays ``obs_ref`` (and
    ``next_obs_ref``), read from disk (anything sliced by rows: a mapped
    file, an HDF5 dataset; read ``chunk`` rows at a time, twice). ``used``:
    ``(C,)`` bool, the slots a sample may read (live or pending).

    The offsets are the config's (``offset_dtype``) when they hold every used
    slot's references, else the narrowest wider one of ``OFFSET_DTYPES`` that
    does: an older writer reused a frame however far back it lay. A slot no
    sample reads may hold anything (``-1`` for a row stored without frames):
    its offsets are clipped, never read. Whether the frames a used slot names
    are still stored is the caller's check (``refs_outside``).

    Raises ``ValueError`` naming the first used slot with a negative id.
    """
    c = int(used.shape[0])

    def blocks():
        for lo in range(0, c, chunk):
            hi = min(lo + chunk, c)
            refs = np.concatenate([np.asarray(a[lo:hi], dtype=np.int64) for a in stacks], axis=1)
            u = used[lo:hi]
            neg = np.flatnonzero(u & (refs.min(axis=1, initial=0) < 0))
            if neg.size:
                s = lo + int(neg[0])
                raise ValueError(f"slot {s} (sampleable) references frame ids {refs[s - lo].tolist()}, "
                                 "a negative one among them")
            fref = refs.max(axis=1, initial=np.iinfo(np.int64).min)
            with np.errstate(over="ignore"):
                off = fref[:, None] - refs  # >= 0 where used (ids >= 0, fref the row's largest); junk may wrap
            yield lo, hi, u, fref, off

    widest = 0
    for _, _, u, _, off in blocks():
        widest = max(widest, int(off[u].max(initial=0)))
    least = offset_dtype(k, num_envs)
    dt = next(t for t in OFFSET_DTYPES if t.itemsize >= least.itemsize and widest <= np.iinfo(t).max)
    top = np.iinfo(dt).max
    n_off = sum(int(a.shape[1]) for a in stacks)
    fref_all, foff = np.empty(c, np.int64), np.empty((c, n_off), dt)
    for lo, hi, _, fref, off in blocks():
        fref_all[lo:hi] = fref
        # (clipped only in slots no sample reads)
        foff[lo:hi] = np.where((off < 0) | (off > top), top, off) if dt.itemsize < 8 else np.where(off < 0, 0, off)
    return fref_all, foff


def derive_minref(fref: np.ndarray, foff: np.ndarray) -> np.ndarray:
    """Each row's oldest frame id: ``fref - max(foff)`` (``(n,)`` int64)."""
    return fref.astype(np.int64) - foff.max(axis=1, initial=0).astype(np.int64)


def refs_outside(fref: np.ndarray, foff: np.ndarray, used: np.ndarray, lo: int, fw: int) -> tuple[str, np.ndarray]:
    """Stored references (read from disk: untrusted) against the frames
    stored, ids ``lo .. fw - 1``: ``(what is wrong, each row's oldest id)``,
    the first an empty string when every ``used`` row (a live or pending
    transition) references only stored frames."""
    mins = derive_minref(fref, foff)
    bad = np.flatnonzero(used & ((mins < lo) | (fref >= fw)))
    if not bad.size:
        return "", mins
    s = int(bad[0])
    return (f"frame_ref / frame_off: sampleable slot {s} references frames {int(mins[s])}..{int(fref[s])}, "
            f"outside the frames stored [{lo}, {fw})"), mins

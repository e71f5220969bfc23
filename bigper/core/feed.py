"""The feed's host half: a batch as two compiled calls into one packed block.

A sampler bound for a torch device (``sampler(B, device=...)``) does not go
through ``sample`` → ``Batch`` → ``to_torch``: its thread fills reused
blocks (``device/feed.py``), each batch with

1. ``draw`` (under the buffer's lock, tens of µs): the stratified draw from
   the tree, the weights, the generations, the end flags and discounts (with
   ``n_step > 1`` each window's, its discounted reward and its last slot),
   and the frame ids of the ``obs``/``next_obs`` stacks, written into the block;
2. ``gather`` (without the lock and without the GIL): every stored field's
   rows and every frame, copied into the block from the storage's arrays (or
   the device tier's host arrays); with a CUDA tier the device gathers instead;
   compressed frames are decompressed into the block by ``decode``, under the
   lock right after the draw (without the GIL: no dictionary is dropped and
   the log does not grow meanwhile);
3. ``intact`` (under the lock again, one comparison): no write replaced a
   drawn transition or one of its frames while they were copied; if one did,
   the batch is drawn and gathered again under the lock.

Every array the kernels touch is bytes: a field is a ``(rows, bytes a row)``
uint8 view of its storage array, so one kernel serves every dtype and shape.
The batch is what ``sample(B).to_torch(device)`` would give for the same draw
(``tests/device/test_feed.py`` holds them equal, key by key).

Covered: transitions, proportional priorities, frames raw or compressed, a
storage with arrays (memory, memmap) or a device tier; n-step returns on the
host (not with a device tier). Anything else (sequences, rank, HDF5, n-step
with a tier) is served by the general path (``covered`` says why not).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..common.kernels import jit, kernel
from ..common.pool import workers
from ..prioritization._tree_kernels import sample_into
from .nstep import powers_of, windows
from .ring import batch_meta

# The short kernels keep the GIL: a thread that gives it up for a few microseconds must take
# it back from a launch-bound learner, which needs it at every op, and that handover costs the
# learner far more than the kernel (measured: hundreds of µs a batch). Only the gather, long
# enough to be worth it, runs without the GIL.
held = jit(cache=True)

# Offsets of the regions of a block: aligned for any dtype's view (and for fast copies).
ALIGN = 64
DECODE_CHUNK = 256  # compressed frames a pool thread decodes at least in a batch (``decode``)

# The bookkeeping a block holds before the data, in order: name, dtype.
# (".indices"/".generations": the host copies ``update_priorities`` reads, apart from the tensors a
# learner may change in place.)
META = (("indices", np.int64), ("generations", np.int64), ("probabilities", np.float64),
        ("weights", np.float32), ("terminated", np.bool_), ("truncated", np.bool_), ("discount", np.float32),
        (".indices", np.int64), (".generations", np.int64))



class BatchMeta(NamedTuple):
    """A block's ``META`` arrays, in order, as ``draw_kernel`` names them (a
    plain tuple at the call: ``common/kernels.py`` says why)."""

    indices: np.ndarray
    generations: np.ndarray
    probabilities: np.ndarray
    weights: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    discount: np.ndarray
    host_indices: np.ndarray  # (".indices": the host copies ``update_priorities`` reads)
    host_generations: np.ndarray


# What ``draw`` says of a batch's stacks: no frames, obs only, obs and next_obs as one (B, k + 1)
# gather, or as two (B, k) gathers (some next_obs stack is not its obs stack moved on by one frame).
NO_FRAMES, OBS_ONLY, PAIR, SPLIT = 0, 1, 2, 3

_NO_REFS = (np.zeros(0, dtype=np.int64), np.zeros((0, 0), dtype=np.uint8), 1, 0, False)
_NO_BYTES = np.zeros((0, 0), dtype=np.uint8)
# (n_step 1: no windows; the arrays stand for none, of the types a window's take)
_NO_LAST = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32))


def covered(parts, host: bool) -> str | None:
    """Why the feed does not serve a buffer (its ``core.parts.Parts``), or
    None; ``host``: the rows are gathered on the host (else a device tier gathers them)."""
    cfg = parts.config
    if not parts.unit.fed:
        return f"{parts.unit.noun}s"
    if cfg.n_step != 1:
        if not host:
            return "n-step returns with a device tier"
        rdt = np.dtype(cfg.dtype("reward"))
        if not (rdt.kind in "biu" or rdt in (np.dtype(np.float32), np.dtype(np.float64))):
            return f"n-step returns of a {rdt} reward"
    if parts.prio.tree is None:
        return "rank-based priorities"
    if parts.store.arrays is None and (host or parts.frames is not None):
        return f"a {parts.store.kind} storage without arrays"
    for name, (shape, dtype) in parts.stored.items():
        if not np.dtype(dtype).isnative:
            return f"field {name!r} of non-native byte order"
    return None


def _bytes2d(arr) -> np.ndarray:
    """A C-contiguous array as ``(rows, bytes a row)`` uint8, without a copy."""
    a = np.asarray(arr)
    return a.reshape(a.shape[0], -1).view(np.uint8)


class Layout:
    """Where each part of one batch lies in a block of bytes.

    Parameters
    ----------
    b : int
        Batch size.
    fields : dict
        ``name -> (shape, dtype)`` of the stored fields gathered row by row,
        in the batch's order (empty when a device gathers them).
    frames : tuple or None
        ``(k, frame shape, dtype, next)``: the stacks' depth, a frame, and
        whether there is a ``next_obs`` stack; None without frame stacks.
    gather : bool
        Whether the frames are gathered into the block (else only their ids travel).
    window : tuple or None
        With ``n_step > 1``: ``(n, reward dtype, names)``: the window's length,
        the dtype of its discounted ``reward`` (computed by ``draw``, not
        gathered: not in ``fields``) and the fields read at each window's last
        slot (``next_*``).
    """

    def __init__(self, b: int, fields: dict, frames: tuple | None, gather: bool, window: tuple | None = None):
        self.b = b
        self.regions: dict = {}  # name -> (offset, shape, dtype)
        off = 0

        def put(name, shape, dtype):
            nonlocal off
            dtype = np.dtype(dtype)
            self.regions[name] = (off, tuple(shape), dtype)
            off += -(-int(np.prod(shape, dtype=np.int64)) * dtype.itemsize // ALIGN) * ALIGN

        for name, dtype in META:
            put(name, (b,), dtype)
        self.k = 0
        if frames is not None:
            k, fshape, fdtype, nxt = frames
            self.k, self.frame_shape, self.frame_dtype, self.next = k, tuple(fshape), np.dtype(fdtype), nxt
            put(".ids", (b * (2 * k if nxt else k),), np.int64)
        for name, (shape, dtype) in fields.items():
            put(name, (b, *shape), dtype)
        self.window = window
        if window is not None:
            put("reward", (b,), window[1])
            put(".last", (b,), np.int64)  # each window's last slot
        if frames is not None and gather:
            put(".frames", (b * (2 * self.k if self.next else self.k), *self.frame_shape), self.frame_dtype)
        self.size = max(off, ALIGN)
        self.fields = list(fields)
        self.at_last = [window is not None and name in window[2] for name in self.fields]
        # Frames a batch reads, by ``draw``'s code of its stacks.
        k = self.k
        self.n_ids = {NO_FRAMES: 0, OBS_ONLY: b * k, PAIR: b * (k + 1), SPLIT: b * 2 * k}

    def views(self, block: np.ndarray) -> dict:
        """Numpy views of ``block`` (uint8, ``size`` bytes) by region."""
        out = {}
        for name, (off, shape, dtype) in self.regions.items():
            n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            out[name] = block[off:off + n].view(dtype).reshape(shape)
        return out

    def used(self, shape: int) -> int:
        """Bytes of a block a batch drawn with stacks ``shape`` (``draw``'s code) fills."""
        if ".frames" not in self.regions or shape == SPLIT:
            return self.size
        off, fshape, dtype = self.regions[".frames"]
        per = int(np.prod(fshape[1:], dtype=np.int64)) * dtype.itemsize
        return off + self.b * (self.k + 1 if shape == PAIR else self.k) * per


class Sources:
    """The arrays a batch is read from, as the kernels take them: the tree,
    the ring's bookkeeping, the frame refs (the storage's: ``covered`` asks
    for its arrays where there are frames), and the bytes of the fields and
    frames a host gather copies."""

    def __init__(self, parts, layout: Layout, field_arrays: dict | None, frame_ring):
        t = parts.prio.tree
        ring = parts.ring
        self.tree = tuple(t.arrays)  # (a plain tuple: common/kernels.py says why)
        self.book = (ring.ends, ring.gid, parts.reader.discount1)
        frames = parts.frames
        arrays = parts.store.arrays
        self.log = frames.log if frames is not None else None  # compressed frames: ``decode``, not the ring
        # (``decode`` on the pool's threads: where the machine has cores beside the learner's and the feed's)
        self.threads = workers() > 2
        # Frames ``gather_kernel`` copies from the ring, by ``draw``'s code (none when ``decode`` writes them).
        self.copied = dict.fromkeys(layout.n_ids, 0) if self.log is not None else layout.n_ids
        if frames is not None:  # (the refs are the storage's even with a tier: the host plans, the device gathers)
            # (frame_ref, frame_off, F, k, whether next_obs stacks are drawn): frames/store.py's layout
            self.refs = (np.asarray(arrays["frame_ref"]), np.asarray(arrays["frame_off"]), frames.F, frames.k,
                         bool(layout.next))
        else:
            self.refs = _NO_REFS
        # (an empty tuple has no type numba can index: one empty array stands for none)
        self.srcs = tuple(_bytes2d(field_arrays[name]) for name in layout.fields) if field_arrays else ()
        self.srcs = self.srcs or (_NO_BYTES,)
        cfg = parts.config
        if layout.window is not None:  # (n, envs, capacity, gamma, gamma**j, the stored rewards, scratch)
            n = layout.window[0]
            self.window = (n, cfg.num_envs, cfg.capacity, float(parts.reader.gamma), powers_of(parts.reader.gamma, n),
                           np.asarray(arrays["reward"]), np.empty((layout.b, n), dtype=np.int64))
        else:
            self.window = (1, 1, 1, 0.0, np.ones(1), _NO_LAST[1], np.zeros((0, 0), dtype=np.int64))
        self.ring = _bytes2d(frame_ring) if frame_ring is not None else _NO_BYTES


class Block:
    """One packed batch: its bytes (``data``, uint8) and the kernels' views of them."""

    def __init__(self, layout: Layout, data: np.ndarray):
        self.layout = layout
        self.data = data
        v = self.views = layout.views(data)
        self.meta = tuple(v[name] for name, _ in META)
        self.ids = v.get(".ids", np.zeros(0, dtype=np.int64))
        self.dsts = tuple(v[name].reshape(layout.b, -1).view(np.uint8) for name in layout.fields) or (_NO_BYTES,)
        # (the slots each field's rows are read at: the drawn ones, or each n-step window's last)
        self.rows = tuple(v[".last"] if at else v["indices"] for at in layout.at_last) or (v["indices"],)
        self.window = (v[".last"], v["reward"]) if layout.window is not None else _NO_LAST
        # (its own draw's uniforms and ``how``: a redraw after a write reuses them; the native feed
        # draws batches ahead, so the filler's newest would be another batch's)
        self.uniforms = np.empty(layout.b, dtype=np.float64)
        self.drawn = None
        self.fdst = v[".frames"].reshape(v[".frames"].shape[0], -1).view(np.uint8) if ".frames" in v else _NO_BYTES
        self.shape = NO_FRAMES  # draw's code of the batch it holds
        self.lowest = 0         # the oldest frame id it reads
        self.count = 0          # rows written to the buffer when it was drawn
        self.writes = 0         # the ring's writes begun then, and failed
        self.failed = 0
        self.restores = 0       # the ring's restores then


def draw(src: Sources, block: Block, uniforms: np.ndarray, how: tuple) -> None:
    """Draw into ``block`` (under the buffer's lock): ``how`` is ``(stratified, beta, batch_norm)``."""
    block.shape, block.lowest = draw_kernel(src.tree, uniforms, how, src.book, src.refs, block.meta, block.ids,
                                            src.window, block.window)


def gather(src: Sources, block: Block) -> None:
    """Copy the drawn rows and frames into ``block`` (no lock, no GIL);
    compressed frames are decompressed (``decode``: call it under the lock)."""
    decode(src, block)
    if block.layout.fields or src.copied[block.shape]:
        gather_kernel(block.rows, src.srcs, block.dsts, block.ids, src.copied[block.shape], src.ring, block.fdst)


def decode(src: Sources, block: Block) -> None:
    """Compressed frames: the drawn ones decompressed into ``block`` (under
    the buffer's lock, right after the draw; without the GIL). On the pool's
    threads where the machine has cores beside the learner's and the feed's
    (a GPU host: 1,280 frames a batch at B = 256 take one core 3.5 ms, longer
    than a learner's update), ``DECODE_CHUNK`` frames a thread at least (a
    thread's hand-off costs the learner Python calls); else in this thread."""
    if src.log is not None and block.fdst.shape[0]:
        src.log.decode(block.ids[:block.layout.n_ids[block.shape]], block.fdst, threads=src.threads,
                       chunk=DECODE_CHUNK)


@held
def draw_kernel(tree, uniforms, how, book, refs, meta, ids, window, wout):
    """One batch's draw and plan: indices, probabilities and weights
    (``sample_into``), generations, end flags and discount (``batch_meta``;
    with ``n_step > 1`` each window's, ``nstep.windows``, its discounted
    reward and its last slot into ``wout``), and the frame ids of its stacks
    (ring rows, ``id % F``) in ``ids``: a ``(B, k + 1)`` pair when every
    ``next_obs`` stack is its ``obs`` stack moved on by one frame, else
    ``(B, 2k)``. Returns ``(shape code, oldest frame id)``."""
    sums, mins, offsets = tree
    stratified, beta, batch_norm = how
    ends, gid, discount1 = book
    fref, foff, F, k, nxt = refs  # obs id j of slot s: fref[s] - foff[s, j]; next_obs id j: ... foff[s, k + j]
    n, envs, capacity, gamma, powers, rewards, slots = window
    last, reward = wout
    meta = BatchMeta(*meta)
    idx, gen, prob, w = meta.indices, meta.generations, meta.probabilities, meta.weights
    term, trunc, disc = meta.terminated, meta.truncated, meta.discount
    host_idx, host_gen = meta.host_indices, meta.host_generations
    sample_into(sums, mins, offsets, uniforms, stratified, beta, batch_norm, idx, prob, w)
    batch_meta(idx, ends, gid, discount1, gen, term, trunc, disc)
    host_idx[:] = idx
    host_gen[:] = gen
    b = idx.shape[0]
    if n > 1:  # (as ``core/reader.window_ends``: the same kernels, the same sums in the same order)
        windows(gen, capacity, envs, n, ends, gamma, slots, disc, term, trunc)
        for i in range(b):
            r = 0.0
            t = idx[i]
            for j in range(n):
                s = slots[i, j]
                if s < 0:
                    break
                r += powers[j] * rewards[s]
                t = s
            last[i] = t
            reward[i] = r
    if k == 0:
        return 0, 0
    lowest = np.int64(2 ** 62)
    for i in range(b):
        s = idx[i]
        for j in range(k):
            lowest = min(lowest, fref[s] - np.int64(foff[s, j]))
    if not nxt:
        for i in range(b):
            s = idx[i]
            for j in range(k):
                ids[i * k + j] = (fref[s] - np.int64(foff[s, j])) % F
        return 1, lowest
    # (next_obs: the stack of each window's last slot; with n_step 1, the drawn one)
    pair = True
    for i in range(b):
        s = idx[i]
        t = last[i] if n > 1 else s
        lowest = min(lowest, fref[t] - np.int64(foff[t, 2 * k - 1]))
        for j in range(k - 1):
            if fref[t] - np.int64(foff[t, k + j]) != fref[s] - np.int64(foff[s, j + 1]):
                pair = False
    if pair:
        for i in range(b):
            s = idx[i]
            t = last[i] if n > 1 else s
            for j in range(k):
                ids[i * (k + 1) + j] = (fref[s] - np.int64(foff[s, j])) % F
            ids[i * (k + 1) + k] = (fref[t] - np.int64(foff[t, 2 * k - 1])) % F
        return 2, lowest
    for i in range(b):
        s = idx[i]
        t = last[i] if n > 1 else s
        for j in range(k):
            lowest = min(lowest, fref[t] - np.int64(foff[t, k + j]))
            ids[i * 2 * k + j] = (fref[s] - np.int64(foff[s, j])) % F
            ids[i * 2 * k + k + j] = (fref[t] - np.int64(foff[t, k + j])) % F
    return 3, lowest


@kernel
def gather_kernel(rows, srcs, dsts, ids, n_ids, ring, fdst):
    """``dsts[f][i] = srcs[f][rows[f][i]]`` for every field ``f`` (bytes a row), and
    ``fdst[i] = ring[ids[i]]`` for the first ``n_ids`` frames."""
    # (plain loops: numba turns them into wide copies; a slice assignment was 4x slower, measured)
    for f in range(len(srcs)):
        src = srcs[f]
        dst = dsts[f]
        idx = rows[f]
        w = dst.shape[1]
        for i in range(idx.shape[0]):
            s = idx[i]
            for j in range(w):
                dst[i, j] = src[s, j]
    w = fdst.shape[1]
    for i in range(n_ids):
        r = ids[i]
        for j in range(w):
            fdst[i, j] = ring[r, j]


@held
def intact_kernel(idx, gen, gid):
    """Whether every drawn slot still holds the transition it held at the draw."""
    for i in range(idx.shape[0]):
        if gid[idx[i]] != gen[i]:
            return False
    return True


def intact(ring, frames, block: Block, restores: int) -> bool:
    """(Under the lock, after ``gather``.) Whether no write replaced what the
    batch in ``block`` read while it was gathered without the lock: none
    began, or every one that did completed (the count moved by the rows it
    wrote) and replaced no drawn slot and no frame the batch read. A write that
    failed was rolled back after its rows were in the storage: not intact."""
    if ring.restores != restores or ring.failed != block.failed:
        return False  # a failed write's rows were in the storage while the batch was read
    if ring.writes == block.writes:
        return True  # nothing was written since the draw
    if frames is not None and block.lowest < frames.fw - frames.F:
        return False
    return intact_kernel(block.meta[0], block.meta[1], ring.gid)


# -- the gathering thread on the CPU (``device/native.py``) ------------------------------------
# A thread that never takes the GIL: one compiled call runs its whole life, taking jobs from a ring
# of slots the learner's thread drew into, gathering each, and counting what it finished. The
# words of ``ctl``: stop, jobs posted, jobs done.
STOP, POSTED, DONE = 0, 1, 2


@intrinsic
def _fence(typingctx):
    """A full memory fence: what this thread stored is visible before what it stores next, and
    what it loads next is loaded after it (another thread's stores in between are seen)."""
    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def _sleep_us(typingctx, us):
    """``usleep(us)`` (POSIX; a call the compiler cannot see into, between two fences)."""
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), [ir.IntType(32)]),
                                            "usleep")
        builder.fence("seq_cst")
        out = builder.call(fn, args)
        builder.fence("seq_cst")
        return out
    return types.int32(types.int32), codegen


@kernel
def serve_kernel(ctl, jobs, pool, spec, fspec, srcs, ring):
    """Gather every posted job until told to stop: job ``n`` is ``jobs[n % len(jobs)] = (slot,
    frames)``, its batch drawn into ``pool[slot]`` (indices at ``spec[0]``, ``spec[1]`` of them;
    frame ids at ``spec[2]``); field ``f``'s rows go to ``fspec[f] = (offset, bytes a row, offset
    of the slots they are read at: the indices or each n-step window's last)``, the
    frames to ``spec[3]``, ``spec[4]`` bytes each. Idle, it looks every ~0.1 ms (every ms after
    ~0.2 s without work)."""
    o_idx, b, o_ids, o_frames, fw = spec[0], spec[1], spec[2], spec[3], spec[4]
    cap = jobs.shape[0]
    done = ctl[DONE]
    idle = 0
    while True:
        _fence()
        if ctl[STOP] != 0:
            return
        if ctl[POSTED] == done:
            idle += 1
            _sleep_us(20 if idle < 2000 else 1000)
            continue
        idle = 0
        s = jobs[done % cap, 0]
        n_ids = jobs[done % cap, 1]
        blk = pool[s]
        for f in range(fspec.shape[0]):
            src = srcs[f]
            off = fspec[f, 0]
            w = fspec[f, 1]
            idx = blk[fspec[f, 2]:fspec[f, 2] + 8 * b].view(np.int64)
            for i in range(b):
                row = src[idx[i]]
                dst = blk[off + i * w:off + (i + 1) * w]
                for j in range(w):  # (indexed by the loop's own variable: a wide copy)
                    dst[j] = row[j]
        if n_ids:
            ids = blk[o_ids:o_ids + 8 * n_ids].view(np.int64)
            for i in range(n_ids):
                row = ring[ids[i]]
                dst = blk[o_frames + i * fw:o_frames + (i + 1) * fw]
                for j in range(fw):
                    dst[j] = row[j]
        _fence()
        done += 1
        ctl[DONE] = done


@held
def post_kernel(ctl, jobs, slot, n_ids):
    """Post job ``ctl[POSTED]`` (``slot``'s batch, drawn: its bytes are stored before the job is)."""
    n = ctl[POSTED]
    _fence()
    jobs[n % jobs.shape[0], 0] = slot
    jobs[n % jobs.shape[0], 1] = n_ids
    _fence()
    ctl[POSTED] = n + 1
    return n


@kernel
def wait_kernel(ctl, job):
    """Wait (without the GIL) until job ``job`` is done (1), the thread is told
    to stop (0), or about 50 ms pass without it (-1: the caller looks whether
    the thread still runs)."""
    spins = 0
    while True:
        _fence()
        if ctl[DONE] > job:
            return 1
        if ctl[STOP] != 0:
            return 0
        spins += 1
        if spins > 100:
            if spins > 5100:
                return -1
            _sleep_us(10)

"""Pinned host blocks, reused between calls (pinning is slow): a pool per
(device, layout) of blocks that each carry the CUDA event recorded after their
copy, so that a block is filled again only once that copy is done; and a
``Staged`` block laid out for one batch, which the gathers write into and one
copy sends (``to_cuda``: arrays staged and sent).

CUDA: **one pinned staging block and one host-to-device copy a batch**. Every
field, the weights, indices, generations and mask are packed into one pinned
host block (each at a 64-byte aligned offset); one non-blocking copy moves it
to the device, and the device tensors are views of that one device block::

    call t    fill pinned[0] -> one copy to GPU (stream) -> record event[0]
    call t+1  event[0] busy? take pinned[1] (or wait on the oldest once the pool is full)
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque

import numpy as np

from .lazy import load_torch, torch_dtype

# Pinned blocks a layout keeps at most; beyond it the oldest one's event is waited on.
POOL_DEPTH = 6  # (a sampler's batches in flight: prefetch + the learner's + the one being made)
# Distinct (device, layout) keys kept; the least recently used pool goes first.
# Dropping a pool while its copy is in flight is safe: torch's pinned-memory allocator
# does not reuse a block until the copies recorded on it are done.
MAX_KEYS = 64
# Offsets of the fields in a staging block: aligned for any dtype's view (and for fast copies).
ALIGN = 64


class _Slot:
    __slots__ = ("host", "view", "event", "views")

    def __init__(self, host):
        self.host = host            # pinned torch tensor
        self.view = host.numpy()    # numpy view of the same pinned memory
        self.event = None           # CUDA event recorded after the last copy out of host
        self.views = None           # a staging layout's numpy views into it (the slot's key fixes the layout)


class PinnedPool:
    """Pinned host buffers reused between calls; thread-safe.

    ``acquire`` hands out a buffer no in-flight copy reads from; ``release``
    gives it back with the event recorded after the copy that reads it.
    """

    def __init__(self, depth: int = POOL_DEPTH, max_keys: int = MAX_KEYS):
        self.depth = depth
        self.max_keys = max_keys
        self._lock = threading.Lock()
        self._free: OrderedDict = OrderedDict()  # key -> deque of idle slots, oldest copy first
        self._count: dict = {}                   # key -> slots created (idle or handed out)

    def acquire(self, key, shape, torch_dtype) -> _Slot:
        """A buffer for ``key`` that no copy in flight reads from."""
        wait = None
        with self._lock:
            free = self._free.get(key)
            if free is None:
                free = self._free[key] = deque()
                self._count[key] = 0
                while len(self._free) > self.max_keys:
                    old, _ = self._free.popitem(last=False)
                    self._count.pop(old, None)
            self._free.move_to_end(key)
            for i, slot in enumerate(free):
                if slot.event is None or slot.event.query():
                    del free[i]
                    return slot
            if self._count[key] < self.depth or not free:
                self._count[key] += 1
            else:
                wait = free.popleft()
        if wait is not None:
            wait.event.synchronize()  # the oldest copy out of this buffer; never overwrite it in flight
            return wait
        try:
            return self._new_slot(shape, torch_dtype)
        except BaseException:
            with self._lock:
                if key in self._count:
                    self._count[key] -= 1
            raise

    def _new_slot(self, shape, torch_dtype) -> _Slot:
        torch = load_torch()
        host = torch.empty(shape, dtype=torch_dtype)
        return _Slot(host.pin_memory() if torch.cuda.is_available() else host)

    def release(self, key, slot: _Slot, event) -> None:
        slot.event = event
        with self._lock:
            free = self._free.get(key)
            if free is not None:  # else its key was evicted: let the slot go
                free.append(slot)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._count.clear()


POOL = PinnedPool()


_LAYOUTS: OrderedDict = OrderedDict()  # specs signature -> its _Layout (a sampler repeats one)


class _Layout:
    """One staging block's layout for ``specs`` (``key -> (shape, dtype)``, a
    key may be ``(key, sub-key)``): the arrays grouped by dtype, each group at
    an aligned offset, its arrays back to back. ``parts``: ``[(dtype, torch
    dtype, offset, elements, [(key, shape, elements)])]``."""

    __slots__ = ("sig", "parts", "size")

    def __init__(self, torch, sig: tuple, specs: dict):
        self.sig = sig
        groups: dict = {}
        for key, (shape, dtype) in specs.items():
            shape = tuple(shape)
            groups.setdefault(np.dtype(dtype).newbyteorder("=").str, []).append(
                (key, shape, int(np.prod(shape, dtype=np.int64))))
        self.parts, off = [], 0
        for dt, members in groups.items():
            dt = np.dtype(dt)
            n = sum(m[2] for m in members)
            key = members[0][0]
            self.parts.append((dt, torch_dtype(torch, dt, key if isinstance(key, str) else f"{key[0]}[{key[1]}]"),
                               off, n, members))
            off += -(-n * dt.itemsize // ALIGN) * ALIGN
        self.size = max(off, ALIGN)


def _layout(torch, specs: dict) -> _Layout:
    sig = tuple((key, tuple(shape), np.dtype(dtype).str) for key, (shape, dtype) in specs.items())
    got = _LAYOUTS.get(sig)
    if got is None:
        got = _LAYOUTS[sig] = _Layout(torch, sig, specs)
        while len(_LAYOUTS) > MAX_KEYS:
            _LAYOUTS.popitem(last=False)
    return got


def flat_arrays(arrays: dict) -> dict:
    """``arrays`` with a dict value (a sequence batch's frame indices) as ``(key, sub-key)`` entries."""
    out = {}
    for key, arr in arrays.items():
        if isinstance(arr, dict):
            out.update(((key, sub), np.asarray(a)) for sub, a in arr.items())
        else:
            out[key] = np.asarray(arr)
    return out


class Staged:
    """One pinned block laid out for a batch before it is gathered: the
    gathers write straight into ``views`` (numpy views of the block), and
    ``send`` moves the whole block with one copy (``sample``'s sampler, for a
    CUDA device: no copy from host arrays into pinned memory)."""

    def __init__(self, torch, dev, specs: dict):
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.torch, self.dev = torch, dev
        self.layout = lay = _layout(torch, specs)
        self.key = (dev.index, lay.sig)
        self.slot = POOL.acquire(self.key, (lay.size,), torch.uint8)
        if self.slot.views is None:
            views = {}
            for dt, _, off, _, members in lay.parts:
                for key, shape, n in members:
                    views[key] = self.slot.view[off:off + n * dt.itemsize].view(dt).reshape(shape)
                    off += n * dt.itemsize
            self.slot.views = views
        self.views = self.slot.views

    def send(self, non_blocking: bool = True) -> dict:
        """Tensors on the device, views of one block moved with one copy; the block goes back to the pool."""
        torch = self.torch
        if self.dev.type != "cuda":  # (the same layout on another device: a copy, no events)
            block = self.slot.host.to(self.dev, copy=True)
            POOL.release(self.key, self.slot, None)
            return _unpack(block, self.layout)
        stream = torch.cuda.current_stream(self.dev)
        try:
            block = self.slot.host.to(self.dev, non_blocking=non_blocking)
            event = torch.cuda.Event()
            event.record(stream)
        except BaseException:
            stream.synchronize()  # a copy may be in flight without its event: let it finish first
            POOL.release(self.key, self.slot, None)
            raise
        POOL.release(self.key, self.slot, event)
        return _unpack(block, self.layout)

    def drop(self) -> None:
        """Give the block back unused."""
        POOL.release(self.key, self.slot, None)


def _unpack(block, lay: _Layout) -> dict:
    out: dict = {}
    for dt, tdt, off, n, members in lay.parts:
        flat = block[off:off + n * dt.itemsize].view(tdt)
        pieces = flat.split([m[2] for m in members]) if len(members) > 1 else (flat,)
        for (key, shape, _), t in zip(members, pieces):
            if len(shape) != 1:
                t = t.view(shape)
            if isinstance(key, tuple):
                out.setdefault(key[0], {})[key[1]] = t
            else:
                out[key] = t
    return out


def to_cuda(torch, arrays: dict, dev, non_blocking: bool) -> dict:
    flat = flat_arrays(arrays)
    staged = Staged(torch, dev, {key: (a.shape, a.dtype) for key, a in flat.items()})
    try:
        for key, a in flat.items():
            np.copyto(staged.views[key], a, casting="no" if a.dtype.isnative else "equiv")
    except BaseException:
        staged.drop()
        raise
    return staged.send(non_blocking)

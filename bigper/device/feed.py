"""The feed: a sampler bound for a torch device, its thread almost free of the GIL.

An eager learner gives the GIL up at every op and needs it back at once:
whatever Python a sampler's thread runs is time the learner waits. The feed
runs a batch as a few calls (``core/feed.py``: a compiled draw under the
buffer's lock, a compiled gather without lock or GIL, a check) into one of a
few reused **slots**, each a packed block with the batch's tensors made once
as views of it::

    thread   free.get() -> draw (lock) -> gather (no GIL) -> [CUDA: one copy up] -> ready.put(slot)
    learner  next(it): ready.get() -> slot's dict     ...  update_priorities(dict, td)
             (the slot of the batch before the last goes back to the free queue)

- CPU: the tensors are the host block itself (``torch.from_numpy`` views).
- CUDA: the block is pinned; one host-to-device copy of what the batch
  filled, the tensors views of the slot's device block. With a device tier,
  only the plan goes up (indices, flags, frame ids) and the device gathers:
  one ``index_select`` of every per-transition field (the tier's packed rows)
  and one of the frames, into the slot's tensors (``out=``).

A slot is filled again only when nothing of its batch is held any more: its
dict and tensors are referenced by no one but the slot, and no tensor made
as a view of its memory is alive (the storage's use count); a batch the
learner keeps makes the feed take a new slot instead. On CUDA, the learner's
stream records an event when a slot is given back, and the refill waits for
it on the device (never on the host). Handing over between the threads takes
two C calls (``queue.SimpleQueue``).
"""

from __future__ import annotations

import queue
import sys
import threading
import weakref
from collections import deque

import numpy as np

from ..tensors.transport import TensorBatch
from ..tensors.lazy import load_torch, torch_dtype
from ..tensors.streams import current_stream
from ..core import feed as plan
from ..core.prefetch import Failure, Threaded, why_after
from ..errors import BufferClosedError, InvalidArgumentError
from ..schedules import ConstantSchedule

# How often a blocked thread or consumer looks whether it was told to stop.
_POLL_S = 0.05
# Slots handed to the learner and not yet given back, beyond the prefetched ones:
# the batch the learner works on and the one its loop variable still holds.
_HELD = 2


class FeedBatch(TensorBatch):
    """The dict a feed hands out: a ``TensorBatch`` whose tensors and host
    copies live in a slot that is refilled once nobody holds them."""

    __slots__ = ()


class Slot:
    """One reused block: the bytes of a batch and how its tensors lie in them, by stack layout."""

    def __init__(self, torch, layout: plan.Layout, dev, order: list, tier=None, host=None):
        self.layout = layout
        cuda = dev.type == "cuda"
        if host is None:  # (on the CPU, whatever the default device)
            host = torch.empty((layout.size,), dtype=torch.uint8, device="cpu")
        self.host = host.pin_memory() if cuda else host
        self.block = plan.Block(layout, self.host.numpy())
        self.dev_block = torch.empty((layout.size,), dtype=torch.uint8, device=dev) if cuda else self.host
        self.copied = torch.cuda.Event() if cuda else None  # recorded after the copy up out of ``host``
        self.released = torch.cuda.Event() if cuda else None  # recorded on the learner's stream at give-back
        self.ready = torch.cuda.Event() if cuda else None
        self.fresh = True
        t = _tensors(torch, layout, self.dev_block)
        b, k = layout.b, layout.k
        self.rows = self.frames = None
        if tier is not None:  # the device's gathers land here
            self.rows = torch.empty((b, tier.packed.shape[1]), dtype=torch.uint8, device=dev)
            if k:
                fshape = tuple(tier.frames.shape[1:])
                self.frames = torch.empty((b * (2 * k if layout.next else k), *fshape),
                                          dtype=tier.frames.dtype, device=dev)
            for name, (a, z, tdt, shape) in tier.columns.items():
                t[name] = self.rows[:, a:z].view(tdt).view(b, *shape)
            if k:
                t[".frames"] = self.frames
            # (the gathers' index views and outputs, by stack layout)
            self.ids = {code: (t[".ids"][:b * n], self.frames[:b * n])
                        for code, n in ((plan.PAIR, k + 1), (plan.SPLIT, 2 * k), (plan.OBS_ONLY, k))} if k else {}
        # A batch's tensors by stack layout, as prototypes: each batch gets tensors of its own made from
        # them (``detach``: the same bytes and strides, a new tensor; a third of ``as_strided``'s cost in
        # the learner's thread, where ten of them a batch cost it 5%), so whatever a learner does to its
        # tensors or its dict (``set_``, ``as_strided_``, ``unsqueeze_``, ``.grad``, attributes, keys)
        # never reaches a later batch. The prototypes are never handed out.
        self.protos = {}
        for code in _codes(layout):
            protos = [(name, _stack(t[".frames"], code, name, b, k) if k and name in ("obs", "next_obs") else t[name])
                      for name in order]
            protos += [(name, t[name]) for name in ("weights", "indices", "generations")]
            # (each a tensor of its own over the bytes, not a view: a view shares its base's version
            # counter, so an in-place op on one field would fail a backward that saved another)
            self.protos[code] = [(name, _own(torch, p)) for name, p in protos]
        host_np = self.block.views
        self.hosts = (host_np[".indices"], host_np[".generations"])
        self.indices = t["indices"]  # (a tier's gathers read the indices on the device)
        self.used = {code: (self.host[:layout.used(code)], self.dev_block[:layout.used(code)])
                     for code in self.protos} if cuda and tier is None else None
        # What a held batch shows in: the tensors over the slot's bytes (every view of them, a tensor's
        # ``_base``, a dlpack capsule) count in the storages' use counts; the slot's own roots, block and
        # storage objects (reached through ``untyped_storage()``, ``np.frombuffer``) in their
        # reference counts; a root changed in place (``_base.set_``) or a storage moved (``share_memory_``)
        # in their addresses and strides.
        self.roots = tuple({id(x): x for x in (self.host, self.dev_block, self.rows, self.frames)
                            if x is not None}.values())
        self.stores = tuple({st._cdata: st for st in (r.untyped_storage() for r in self.roots)}.values())
        self.storages = tuple(st._cdata for st in self.stores)
        protos = [p for protos in self.protos.values() for _, p in protos]
        bases = {id(p._base): p._base for p in protos if p._base is not None}  # (the prototypes' ``_base``)
        self.held = self.roots + self.stores + (self.block.data,) + tuple(protos) + tuple(bases.values())
        self.use_count = torch._C._storage_Use_Count
        self.base = None  # (taken by ``Filler.new_slot``, once the locals of this call are gone)
        self.code = None  # the stack layout of the batch it holds
        self.index = None  # its row in a NativeFeed's pool (None: a slot of its own)

    def batch(self) -> FeedBatch:
        """The batch this slot holds: tensors of its own over the slot's bytes,
        and host copies of its indices and generations."""
        tensors = {name: p.detach() for name, p in self.protos[self.code]}
        return FeedBatch(tensors, {"indices": self.hosts[0].copy(), "generations": self.hosts[1].copy(),
                                   "mask": None})

    def counts(self) -> tuple:
        """Who holds the slot's bytes: see ``held``."""
        return (tuple(map(sys.getrefcount, self.held)), tuple(map(self.use_count, self.storages)),
                [st.data_ptr() for st in self.stores],
                [(r.data_ptr(), r.shape, r.stride(), r.dtype) for r in self.roots])

    def unheld(self) -> bool:
        """Whether nothing of the batch this slot gave is held any more: only
        then may its bytes be filled again."""
        return self.counts() == self.base


def _own(torch, p):
    """A tensor over ``p``'s bytes, shape and strides that is not a view (a version counter of its own)."""
    return torch.empty(0, dtype=p.dtype, device=p.device).set_(p.untyped_storage(), p.storage_offset(),
                                                                tuple(p.shape), p.stride())


def _codes(layout: plan.Layout) -> tuple:
    if not layout.k:
        return (plan.NO_FRAMES,)
    return (plan.PAIR, plan.SPLIT) if layout.next else (plan.OBS_ONLY,)


def _stack(frames, code: int, name: str, b: int, k: int):
    fshape = tuple(frames.shape[1:])
    if code == plan.PAIR:
        pair = frames[:b * (k + 1)].view(b, k + 1, *fshape)
        return pair[:, :k] if name == "obs" else pair[:, 1:]
    if code == plan.SPLIT:
        both = frames.view(b, 2 * k, *fshape)
        return both[:, :k] if name == "obs" else both[:, k:]
    return frames[:b * k].view(b, k, *fshape)


def _tensors(torch, layout: plan.Layout, block) -> dict:
    """Tensor views of ``block`` by region (the layout's numpy dtypes)."""
    out = {}
    for name, (off, shape, dtype) in layout.regions.items():
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        out[name] = block[off:off + n].view(torch_dtype(torch, dtype, name)).view(shape)
    return out


class Filler:
    """Fills slots with batches of one buffer (its ``core.parts.Parts``, held
    weakly: the thread keeps no buffer alive between two batches)."""

    def __init__(self, parts, b: int, dev, beta, stratified: bool):
        torch = self.torch = load_torch()
        self.ref = weakref.ref(parts)
        self.guard = parts.guard  # (the buffer's lock, open or closed, its updates in flight: core.lifecycle.Guard)
        self.dev, self.cuda = dev, dev.type == "cuda"
        mirror = parts.mirror
        self.tier = mirror if mirror is not None and self.cuda and mirror.device == dev else None
        cfg = parts.config
        frames = None
        if parts.frames is not None:
            shape = cfg.shape("obs")
            frames = (shape[0], tuple(shape[1:]), cfg.dtype("obs"), "obs" in cfg.next_of)
        fields = {name: ((*shape,), np.dtype(dt)) for name, (shape, dt) in parts.plain.items()}
        window = None
        if cfg.n_step > 1:  # (the discounted reward is drawn, not gathered; ``next_*`` read at each window's end)
            rdt = np.dtype(cfg.dtype("reward"))
            window = (cfg.n_step, rdt if rdt.kind == "f" else np.dtype(np.float32),
                      {name for name in fields if name in parts.reader.successors})
            del fields["reward"]
        self.layout = plan.Layout(b, {} if self.tier is not None else fields, frames, self.tier is None, window)
        self.order = list(parts.plain) + (["obs", "next_obs"] if frames and frames[3] else ["obs"] if frames else [])
        self.order += [n for n in ("terminated", "truncated", "discount") if n not in self.order]
        schedule = parts.draws.schedule
        self.how = None if beta is None and not isinstance(schedule, ConstantSchedule) else \
            (bool(stratified), float(beta if beta is not None else schedule.value), parts.prio.batch_norm)
        self.stratified = bool(stratified)
        self.beta = beta
        self.own_thread = False  # set by the sampler that runs it in a thread of its own
        self._stream = None
        # The C methods of torch's CUDA events: their Python wrappers look the current stream up each time.
        self.event = torch._C._CudaEventBase if self.cuda else None
        self.src = None
        self.src_of = None  # (restores, storage arrays) the sources were made for
        self.gathers = self.tier is None and (bool(self.layout.fields) or ".frames" in self.layout.regions)
        self.n_ids = self.layout.n_ids
        # (a tier holds the frames raw on the device: nothing to decode on the host)
        self.compressed = parts.frames is not None and parts.frames.log is not None and self.tier is None

    def new_slot(self, row=None) -> Slot:
        """A slot (its bytes those of the numpy ``row`` where given). Never of
        inference tensors: a slot made under the caller's ``inference_mode``
        would give them to every later batch of the slot, which autograd then refuses."""
        with self.torch.inference_mode(False):
            host = None if row is None else self.torch.from_numpy(row)
            slot = Slot(self.torch, self.layout, self.dev, self.order, self.tier, host)
        del host  # (a reference of this frame's would count in the slot's base)
        slot.base = slot.counts()
        return slot

    def sources(self, parts) -> plan.Sources:
        """The kernels' arrays, made anew after a restore (or new storage arrays)."""
        arrays = parts.store.arrays
        fields = None if self.tier is not None else {n: arrays[n] for n in self.layout.fields}
        ring = arrays["frames"] if parts.frames is not None and parts.frames.log is None and self.tier is None \
            else None
        self.src = plan.Sources(parts, self.layout, fields, ring)
        self.src_of = (parts.ring.restores, arrays)
        return self.src

    def fill(self, slot: Slot, stop) -> Slot | None:
        """Draw a batch into ``slot`` and gather it; None when told to stop
        while waiting for the lock. (Each Python call here is one a
        launch-bound learner waits for: about ten a batch, whatever its size.)"""
        parts = self.ref()
        if parts is None:
            raise BufferClosedError("the buffer of this sampler was dropped")
        if self.cuda:
            self._reuse(slot)
        if not self.draw_into(parts, slot, stop):
            return None
        if self.tier is not None:
            return slot
        block = slot.block
        if self.gathers:
            plan.gather_kernel(block.rows, self.src.srcs, block.dsts, block.ids, self.src.copied[block.shape],
                               self.src.ring, block.fdst)
        if not self.check(parts, block, stop):
            return None
        if self.cuda:
            host, dev = slot.used[block.shape]
            dev.copy_(host, non_blocking=True)
            stream = self.stream()
            self.event.record(slot.copied, stream)
            self.event.record(slot.ready, stream)
        return slot

    def draw_into(self, parts, slot: Slot, stop) -> bool:
        """Draw a batch into ``slot`` under the buffer's lock (with a device
        tier, its gathers too); False when told to stop while waiting for the lock."""
        lock = self.guard.lock
        block = slot.block
        if not lock.acquire(timeout=_POLL_S):
            while not lock.acquire(timeout=_POLL_S):
                if stop():
                    return False
        try:
            src = self.src
            if src is None or self.how is None or self.tier is not None or self.guard.closed or self.guard.deferred.items \
                    or self.src_of[0] != parts.ring.restores or self.src_of[1] is not parts.store.arrays \
                    or not src.tree[0][0] > 0:
                self._draw(parts, block)  # every case
            else:  # the common one, inline: one call to the compiled draw
                parts.draws.rng.random(out=block.uniforms)
                block.shape, block.lowest = plan.draw_kernel(src.tree, block.uniforms, self.how, src.book,
                                                             src.refs, block.meta, block.ids, src.window,
                                                             block.window)
                block.drawn = self.how
                parts.draws.step += 1
            if self.compressed:  # (the frames read now, under the lock: the gather below takes the fields)
                plan.decode(self.src, block)
            ring = parts.ring
            block.count, block.writes, block.failed, block.restores = ring.count, ring.writes, ring.failed, \
                ring.restores
            if self.tier is not None:  # everything on the device, in order, under the lock
                self._tier_gather(slot)
        finally:
            lock.release()
        return True

    def check(self, parts, block, stop) -> bool:
        """After a gather without the lock: under it, whether a write or a
        restore raced the gather, and if one did, the batch drawn (and
        gathered) again; False when told to stop while waiting for the lock."""
        lock = self.guard.lock
        while not lock.acquire(timeout=_POLL_S):  # (polled: a close under the lock must not wait on us)
            if stop():
                return False
        try:
            ring = parts.ring
            if ring.restores != block.restores:  # a state taken under the gather: as if taken before this draw
                self._draw(parts, block)
                plan.gather(self.src, block)
            elif ring.writes != block.writes and not plan.intact(ring, parts.frames, block, block.restores):
                self._redraw(parts, block)  # a write replaced what was read: again, under the lock
        finally:
            lock.release()
        return True

    def stream(self):
        """The CUDA stream the slots are filled on: the feed thread's current
        stream, taken once; in the caller's thread (``prefetch=0``), its current one."""
        if self.own_thread:
            if self._stream is None:
                self._stream = current_stream(self.torch, self.dev)
            return self._stream
        return current_stream(self.torch, self.dev)

    def _reuse(self, slot: Slot) -> None:
        """CUDA: before a slot is filled again, its last copy out of the host
        block is done and the device waits for the learner's use of it."""
        self.event.synchronize(slot.copied)  # (an event never recorded is complete)
        if not slot.fresh:
            self.event.wait(slot.released, self.stream())

    def _draw(self, parts, block) -> plan.Sources:
        """The draw under the lock, every case (``fill`` inlines the common one)."""
        guard = self.guard
        if guard.closed:
            guard.refuse_closed("the sampler")
        if guard.deferred.items:  # priorities from the device whose copies arrived; never a wait for the
            guard.settle(keep=True, arrived=True)  # learner's step (a later draw applies the others)
        src = self.src
        if self.src_of is None or self.src_of[0] != parts.ring.restores or self.src_of[1] is not parts.store.arrays:
            src = self.sources(parts)
        if self.tier is not None and (self.tier.count != parts.ring.count or
                                      (parts.frames is not None and self.tier.fw != parts.frames.fw)):
            self.tier.sync(parts.store, parts.frames, parts.ring.count)
        if not parts.prio.sampleable:
            raise InvalidArgumentError(parts.unit.unsampleable(len(parts)))
        how = self.how
        if how is None:
            beta = parts.draws.beta() if self.beta is None else self.beta
            how = (self.stratified, float(beta), parts.prio.batch_norm)
        parts.draws.rng.random(out=block.uniforms)
        plan.draw(src, block, block.uniforms, how)
        block.drawn = how
        parts.draws.step += 1
        return src

    def _redraw(self, parts, block) -> None:
        """The batch drawn again under the lock with the same uniforms and beta
        (the random stream and the schedule moved once, as for a draw made
        after the write that raced the gather), and gathered there."""
        plan.draw(self.src, block, block.uniforms, block.drawn)
        plan.gather(self.src, block)

    def _tier_gather(self, slot: Slot) -> None:
        torch = self.torch
        code = slot.block.shape
        slot.dev_block.copy_(slot.host, non_blocking=True)  # the plan: one copy up
        stream = self.stream()
        self.event.record(slot.copied, stream)
        torch.index_select(self.tier.packed, 0, slot.indices, out=slot.rows)
        if code != plan.NO_FRAMES:
            ids, out = slot.ids[code]
            torch.index_select(self.tier.frames, 0, ids, out=out)
        self.event.record(slot.ready, stream)


def _run(filler: Filler, free: "queue.SimpleQueue", ready: "queue.SimpleQueue", flags: list) -> None:
    stop = (lambda: flags[0])
    while not flags[0]:
        try:
            slot = free.get(timeout=_POLL_S)
        except queue.Empty:
            continue
        if flags[0]:
            return
        try:
            if slot is None:
                slot = filler.new_slot()
            item = filler.fill(slot, stop)
            if item is None:
                return
        except BaseException as exc:  # noqa: BLE001 (handed to the consumer, who re-raises it)
            ready.put(Failure(exc))
            return
        ready.put(item)


class FeedSampler(Threaded):
    """The iterator ``sampler(B, prefetch, device=...)`` gives where the feed
    covers the buffer: the contract of ``core.prefetch.Prefetcher`` (errors,
    ``close``, ``ready``), batches as ``FeedBatch`` dicts. ``depth`` 0: no
    thread, each batch filled in the caller's thread."""

    def __init__(self, parts, b: int, dev, depth: int, beta=None, stratified: bool = True):
        self._filler = Filler(parts, b, dev, beta, stratified)
        self._torch = self._filler.torch
        self._cuda = self._filler.cuda
        self._dev = dev
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        self._out: deque = deque()
        self._flags = [False]
        self._depth = depth
        # Slots the thread may fill: ``depth`` at first (at most ``depth`` batches ready, as
        # ``Prefetcher``), one more for each batch the learner holds (``_HELD``), given as it takes them.
        self._extra = 0
        for _ in range(depth if depth else _HELD + 1):
            self._free.put(None)
        self._thread = None
        self._filler.own_thread = bool(depth)
        if depth:
            self._thread = threading.Thread(target=_run, args=(self._filler, self._free, self._ready, self._flags),
                                            name="bigper-prefetch", daemon=True)
            self._thread.start()

    def __next__(self):
        if self._done:
            self._stop_iteration()
        out = self._out
        while len(out) >= _HELD:  # the batch before the last: back to the thread, or let go
            self._give_back(out.popleft())
        item = self._fill_here() if self._thread is None else self._take()
        out.append(item)
        if self._extra < _HELD and self._thread is not None:
            self._extra += 1
            self._free.put(None)
        item.fresh = False
        item.code = item.block.shape
        batch = item.batch()
        if self._cuda:  # (the C method: torch's wrappers look the stream up again)
            self._filler.event.wait(item.ready, current_stream(self._torch, self._dev))
        return batch

    def _fill_here(self):
        """``prefetch=0``: the batch filled in the caller's thread (an error ends the iteration as a thread's does)."""
        slot = self._free.get_nowait()
        try:
            return self._filler.fill(slot if slot is not None else self._filler.new_slot(), lambda: False)
        except KeyboardInterrupt:  # (the learner's to catch: the iteration goes on with a new slot)
            self._free.put(None)
            raise
        except BaseException as e:
            self._free.put(None)
            self._done, self._why = True, why_after(self._why, e)
            self.close()
            raise

    def _give_back(self, slot: Slot) -> None:
        if slot.unheld():
            if self._cuda:
                self._filler.event.record(slot.released, current_stream(self._torch, self._dev))
            self._free.put(slot)
        else:  # the learner keeps it: a new slot takes its place
            self._free.put(None)

    def _signal_stop(self) -> None:
        self._flags[0] = True
        self._free.put(None)  # wakes a thread waiting for a slot


def covered(parts, dev) -> str | None:
    """Why the feed does not serve a buffer (its ``core.parts.Parts``) for device ``dev``, or None."""
    mirror = parts.mirror
    tier = mirror is not None and dev.type == "cuda" and mirror.device == dev
    if mirror is not None and not tier and dev.type == "cuda":
        return f"a device tier on {mirror.device}, batches for {dev}"
    return plan.covered(parts, host=not tier)

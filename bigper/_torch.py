"""Torch conversion, imported only when asked for.

``batch_to_torch`` turns a ``Batch`` into tensors; ``as_numpy`` turns what a
learner hands back (a tensor on any device, with or without grad) into numpy.

CPU: a field whose array is writable, in native byte order and has no
negative strides is shared with ``torch.from_numpy`` (no copy, also for the
strided ``obs``/``next_obs`` views of one frame gather); any other array is
copied once, into a host array reused from earlier calls once no tensor holds
it any more (``_reuse.ReusedArrays``).

CUDA: **one pinned staging block and one host-to-device copy a batch**. Every
field, the weights, indices, generations and mask are packed into one pinned
host block (each at a 64-byte aligned offset); one non-blocking copy moves it
to the device, and the device tensors are views of that one device block.
``obs`` and ``next_obs`` of a batch gathered as ``k + 1`` frames a row
(``FrameStore.pair``) travel once, as that gather; a batch of sequences
carries each row's distinct frames once, and its stacks are rebuilt on the
device by one gather there. Pinned blocks are kept between calls (pinning is
slow) in a small pool per (device, layout); each carries the CUDA event
recorded after its copy, and a block is filled again only once its event has
completed, so the host never overwrites bytes a copy still in flight reads::

    call t    fill pinned[0] -> one copy to GPU (stream) -> record event[0]
    call t+1  event[0] busy? take pinned[1] (or wait on the oldest once the pool is full)
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict, deque
from typing import Any

import numpy as np

from ._reuse import ReusedArrays
from .frames.distinct import distinct_frames, frames_of_stacks
from .errors import InvalidArgumentError, InvalidTypeError

# Pinned blocks a layout keeps at most; beyond it the oldest one's event is waited on.
POOL_DEPTH = 6  # (a sampler's batches in flight: prefetch + the learner's + the one being made)
# Distinct (device, layout) keys kept; the least recently used pool goes first.
# Dropping a pool while its copy is in flight is safe: torch's pinned-memory allocator
# does not reuse a block until the copies recorded on it are done.
MAX_KEYS = 64
# Offsets of the fields in a staging block: aligned for any dtype's view (and for fast copies).
ALIGN = 64


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("Batch.to_torch needs PyTorch: pip install torch (or pip install -e '.[torch]' "
                          "from a checkout)") from e
    return torch


class Transport:
    """How a batch's draw prepared its trip to a device, read by ``to_torch``
    and ``to_jax`` (``Batch.transport``; None for a batch made by hand).

    Parameters
    ----------
    staged : Staged, optional
        A pinned block that already holds the batch as its device takes it,
        sent by the first ``to_torch`` to that device (``take_staged``).
    tensors : TensorBatch, optional
        A device tier's batch: its tensors already on the device.
    frames : tuple, optional
        A sequence batch's frames once: ``("refs", refs)`` or ``("frames",
        frames, index)``.
    """

    __slots__ = ("staged", "tensors", "frames")
    staged: Any
    tensors: Any
    frames: Any

    def __init__(self, staged: Any = None, tensors: Any = None, frames: Any = None) -> None:
        self.staged, self.tensors, self.frames = staged, tensors, frames

    def take_staged(self) -> Any:
        """The staged block, once (a second ``to_torch`` takes the general path)."""
        staged, self.staged = self.staged, None
        return staged


_NOTHING = Transport()  # (a batch made by hand carries nothing; never written: take_staged finds None)


def carried(batch) -> Transport:
    """What ``batch`` (a ``Batch``) carries for its trip to a device (an empty ``Transport`` for none)."""
    return batch.transport or _NOTHING


class TensorBatch(dict):
    """What ``Batch.to_torch`` returns: a plain ``dict`` of tensors that also
    keeps the host copies of the bookkeeping (``indices``, ``generations``,
    ``mask``), so that ``update_priorities(tensors, td)`` reads no tensor back
    from the device (which would wait for the learner's stream)."""

    __slots__ = ("host",)

    def __init__(self, tensors: dict, host: dict):
        super().__init__(tensors)
        # The host copies stand for these very tensors: a key the caller replaced is read as given.
        host.setdefault("of", (tensors.get("indices"), tensors.get("generations")))
        self.host = host

    def host_target(self):
        """``(indices, generations, mask)`` as host arrays while the dict holds
        the tensors they were made with (a key deleted keeps its host copy);
        None once the caller replaced one (the dict is then read as it is)."""
        host = getattr(self, "host", None)
        if not isinstance(host, dict) or not isinstance(host.get("of"), tuple) or len(host["of"]) != 2:
            return None  # (host copies the caller changed: the dict is read as it is)
        idx, gen = host["of"]
        if idx is None or self.get("indices") is not idx or self.get("generations", gen) is not gen:
            return None
        return host.get("indices"), host.get("generations"), host.get("mask")


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
        torch = _torch()
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


_POOL = PinnedPool()


# The CPU copies' arrays (a batch's fields, a few batches held at once).
_HOST = ReusedArrays(depth=POOL_DEPTH + 1, max_keys=MAX_KEYS)


def _shareable(arr: np.ndarray) -> bool:
    """Whether ``torch.from_numpy`` can share ``arr`` as it is."""
    return arr.dtype.isnative and arr.flags.writeable and all(s >= 0 for s in arr.strides)


def _host_array(arr: np.ndarray) -> np.ndarray:
    """``arr`` as an array torch can share: writable, native byte order, no
    negative strides. A copy (one) only where ``arr`` is not already that."""
    arr = np.asarray(arr)
    if not arr.dtype.isnative:
        return arr.astype(arr.dtype.newbyteorder("="), order="C")
    if _shareable(arr):
        return arr
    out = _HOST.take(arr.shape, arr.dtype)
    np.copyto(out, arr)
    return out


def pair_base(obs: np.ndarray, nxt: np.ndarray) -> np.ndarray | None:
    """The ``(B, k + 1, ...)`` frame gather that ``obs`` (its first ``k``
    frames a row) and ``nxt`` (its last ``k``) are views of, or None when
    they are not such a pair (``FrameStore.pair``)."""
    if not (isinstance(obs, np.ndarray) and isinstance(nxt, np.ndarray)) or obs.ndim < 2 \
            or obs.shape != nxt.shape or obs.strides != nxt.strides or obs.dtype != nxt.dtype:
        return None
    b, k = obs.shape[0], obs.shape[1]
    step = obs.strides[1]
    rest = obs.shape[2:]
    inner = obs.dtype.itemsize * int(np.prod(rest, dtype=np.int64))
    if step != inner or obs.strides[0] != (k + 1) * step or b == 0 or k == 0:
        return None
    if nxt.__array_interface__["data"][0] - obs.__array_interface__["data"][0] != step:
        return None
    if obs.strides[2:] != np.empty(rest, obs.dtype).strides:
        return None
    return np.lib.stride_tricks.as_strided(obs, shape=(b, k + 1, *rest), strides=obs.strides,
                                           writeable=False)


# Keys of what travels besides the batch's own (a frame gather, its indices) start with "." so that
# no field can take them (a field name starts with a letter or "_": config.check_name).
def _fields(batch, copies: bool = True) -> tuple[dict, dict]:
    """``(arrays, derived)``: the arrays that travel (by key), and how the
    keys that do not travel are rebuilt from them on the device
    (``key -> (source key, rule)``). ``copies``: the arrays are copied (to a
    device), so frames shared by two stacks travel once; else (the CPU) the
    stacks are shared as they are, where the batch has them."""
    arrays = dict(batch.data)
    derived: dict = {}
    seq = carried(batch).frames
    if not copies and seq is not None and "obs" in arrays:
        seq = None
    if seq is not None:  # sequences: each row's distinct frames once, and the stacks' indices into them
        if seq[0] == "refs":  # taken from the batch's own stacks
            ids, index, first = distinct_frames(seq[1], batch.mask)
            frames = frames_of_stacks([arrays[name] for name in index], first)
        else:
            _, frames, index = seq
        arrays[".frames"] = frames
        arrays[".frame_index"] = index
        for name in ("obs", "next_obs"):
            if name in index:
                arrays.pop(name, None)
                derived[name] = (".frames", name)
    elif copies and "obs" in arrays and "next_obs" in arrays:
        base = pair_base(arrays["obs"], arrays["next_obs"])
        if base is not None:  # obs and next_obs: two views of one (B, k + 1) gather, sent once
            del arrays["obs"], arrays["next_obs"]
            arrays[".pair"] = base
            derived["obs"] = (".pair", "first")
            derived["next_obs"] = (".pair", "last")
    # Copies (B numbers): a learner's in-place op on its tensors never reaches the batch.
    arrays["weights"] = np.array(batch.weights, dtype=np.float32)
    arrays["indices"] = np.array(batch.indices, dtype=np.int64)
    # With the indices, update_priorities(tensors, td) skips slots overwritten since sampling.
    arrays["generations"] = np.array(batch.generations, dtype=np.int64)
    if getattr(batch, "mask", None) is not None:  # sequences: which steps are real
        arrays["mask"] = batch.mask
    return arrays, derived


def _tier_to_torch(torch, batch, ready: TensorBatch, device, non_blocking: bool) -> TensorBatch:
    """``to_torch`` of a device tier's batch (``ready``: the tensors the tier
    gathered). Each call gets a dict, bookkeeping tensors (``weights``,
    ``indices``, ``generations``) and host copies of its own, as a host batch's
    calls do: the first call takes the tier's, a later one new ones made from
    the batch's host values (a learner may have changed the first ones in place)."""
    dev = next(iter(ready.values())).device
    if device is not None and device != dev:
        return TensorBatch({k: v.to(device, non_blocking=non_blocking) for k, v in ready.items()}, _host_of(batch))
    tensors = dict(ready)
    if ready.host.get("given"):
        own = {"indices": np.array(batch.indices, dtype=np.int64),
               "generations": np.array(batch.generations, dtype=np.int64)}
        w = batch.weights
        if isinstance(w, torch.Tensor):  # the batch's own device weights: copied there, no read back
            tensors["weights"] = w.to(dev).clone()
        else:
            own["weights"] = np.array(w, dtype=np.float32)
        tensors.update(move(torch, own, dev, non_blocking))
    ready.host["given"] = True
    return TensorBatch(tensors, _host_of(batch))


def _host_of(batch) -> dict:
    """The host copies ``update_priorities`` reads: copies (the tensors of a CPU
    batch share the batch's arrays, which a learner may change in place)."""
    mask = getattr(batch, "mask", None)
    if mask is not None and not isinstance(mask, np.ndarray):  # a tier's device mask: the host copy it kept
        host = getattr(carried(batch).tensors, "host", None)
        kept = host.get("mask") if isinstance(host, dict) else None
        mask = kept if isinstance(kept, np.ndarray) else as_numpy(mask)
    return {"indices": np.array(batch.indices, dtype=np.int64), "generations": np.array(batch.generations, np.int64),
            "mask": None if mask is None else np.array(mask)}


def as_device(device):
    """``device`` as a ``torch.device`` the feed supports ("cpu", "cuda",
    "cuda:N"); ``InvalidArgumentError`` naming it otherwise (an unknown name, a
    device type this torch has no backend for, ``"meta"``: tensors without data)."""
    torch = _torch()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise InvalidArgumentError(f"device must name a torch device ('cuda', 'cuda:1', 'cpu'), "
                                   f"got {device!r} ({e})") from None
    if dev.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"device={device!r}: bigper feeds 'cpu' and 'cuda' devices, got type {dev.type!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgumentError(f"device={device!r}: this torch has no CUDA device "
                                       f"(torch {torch.__version__})")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.index >= torch.cuda.device_count():
            raise InvalidArgumentError(f"device={device!r}: there are {torch.cuda.device_count()} CUDA devices")
    return dev


def _torch_dtype(torch, dtype: np.dtype, key: str):
    try:
        return torch.from_numpy(np.empty(0, dtype=dtype.newbyteorder("="))).dtype
    except TypeError:
        raise InvalidTypeError(f"field {key!r} has dtype {dtype}, which torch cannot hold") from None


def batch_to_torch(batch, device=None, non_blocking: bool = True) -> TensorBatch:
    """Tensors keyed like ``batch``, plus ``weights`` (float32), ``indices`` and
    ``generations`` (int64); the dict can be passed to ``update_priorities``.

    Parameters
    ----------
    batch : Batch
    device : str or torch.device, optional
        Default the CPU (or, for a batch of a buffer with a device tier, that device).
    non_blocking : bool
        With a CUDA device, return before the copy finishes (it is ordered
        on the current stream, so kernels launched on it after this call see
        the data).

    Returns
    -------
    TensorBatch
        A dict: every data field with its own dtype (uint8 frames stay uint8,
        bool flags stay bool), shape ``(B, ...)``, on ``device``.
    """
    torch = _torch()
    if device is not None:
        device = as_device(device)
    staged = carried(batch).take_staged()
    if staged is not None and device is not None and torch.device(device) == staged.dev:
        return send_staged(batch, staged, non_blocking)
    if staged is not None:
        staged.drop()
    ready = carried(batch).tensors
    if ready is not None:  # a device tier's batch: its tensors are on its device already
        return _tier_to_torch(torch, batch, ready, device, non_blocking)
    dev = torch.device("cpu") if device is None else torch.device(device)
    arrays, derived = _fields(batch, copies=dev.type != "cpu")
    tensors = _derive(torch, move(torch, arrays, dev, non_blocking), derived)
    if derived:  # the batch's key order on every device (the rebuilt stacks come back first)
        tensors = {key: tensors[key] for key in (*batch.data, *tensors) if key in tensors}
    return TensorBatch(tensors, _host_of(batch))


def move(torch, arrays: dict, dev, non_blocking: bool = True) -> dict:
    """Numpy ``arrays`` (by key; a value may be a dict of arrays) as tensors
    on ``dev``: on CUDA one pinned block and one copy, on the CPU shared
    where torch can share them."""
    if dev.type == "cuda":
        return _to_cuda(torch, arrays, dev, non_blocking)
    out = {key: _from_numpy(torch, key, arr) for key, arr in arrays.items()}
    if dev.type != "cpu":  # other accelerators: torch handles pinning (or not) itself
        out = {key: (t.to(dev, non_blocking=non_blocking) if not isinstance(t, dict) else
                     {n: v.to(dev, non_blocking=non_blocking) for n, v in t.items()}) for key, t in out.items()}
    return out


def _derive(torch, out: dict, derived: dict) -> dict:
    """Rebuild the derived keys from what travelled, in the batch's key order:
    ``obs``/``next_obs`` as views of the pair gather, or the stacks of a
    sequence batch gathered from its rows' distinct frames."""
    if not derived:
        return out
    res = {}
    src = out.pop(".pair", None)
    frames, index = out.pop(".frames", None), out.pop(".frame_index", None)
    for name, (_, rule) in derived.items():
        if rule == "first":
            res[name] = src[:, :-1]
        elif rule == "last":
            res[name] = src[:, 1:]
        else:
            res[name] = stacks_from(torch, frames, index[name])
    res.update(out)
    return res


def stacks_from(torch, frames, index):
    """``(B, T, k, *frame)`` stacks from a row's frames: ``frames`` is
    ``(B, n, *frame)``, ``index`` ``(B, T, k)`` positions into each row
    (one gather on the tensors' device)."""
    b, n = frames.shape[0], frames.shape[1]
    flat = frames.reshape(b * n, *frames.shape[2:])
    rows = index + (torch.arange(b, device=index.device, dtype=index.dtype) * n).view(b, 1, 1)
    return flat.index_select(0, rows.reshape(-1)).view(*index.shape, *frames.shape[2:])


def _from_numpy(torch, key: str, arr):
    if type(arr) is np.ndarray and arr.flags.writeable and arr.dtype.isnative:
        try:  # the common case: shared as it is
            return torch.from_numpy(arr)
        except ValueError:  # negative strides: copied below
            pass
        except TypeError:
            raise InvalidTypeError(f"field {key!r} has dtype {arr.dtype}, which torch cannot hold") from None
    if isinstance(arr, dict):  # a sequence batch's frame indices, by stack name
        return {n: _from_numpy(torch, key, a) for n, a in arr.items()}
    try:
        return torch.from_numpy(_host_array(arr))
    except TypeError:
        raise InvalidTypeError(f"field {key!r} has dtype {np.asarray(arr).dtype}, which torch cannot hold") from None


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
            self.parts.append((dt, _torch_dtype(torch, dt, key if isinstance(key, str) else f"{key[0]}[{key[1]}]"),
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


def _flat(arrays: dict) -> dict:
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
        self.slot = _POOL.acquire(self.key, (lay.size,), torch.uint8)
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
            _POOL.release(self.key, self.slot, None)
            return _unpack(block, self.layout)
        stream = torch.cuda.current_stream(self.dev)
        try:
            block = self.slot.host.to(self.dev, non_blocking=non_blocking)
            event = torch.cuda.Event()
            event.record(stream)
        except BaseException:
            stream.synchronize()  # a copy may be in flight without its event: let it finish first
            _POOL.release(self.key, self.slot, None)
            raise
        _POOL.release(self.key, self.slot, event)
        return _unpack(block, self.layout)

    def drop(self) -> None:
        """Give the block back unused."""
        _POOL.release(self.key, self.slot, None)


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


def _to_cuda(torch, arrays: dict, dev, non_blocking: bool) -> dict:
    flat = _flat(arrays)
    staged = Staged(torch, dev, {key: (a.shape, a.dtype) for key, a in flat.items()})
    try:
        for key, a in flat.items():
            np.copyto(staged.views[key], a, casting="no" if a.dtype.isnative else "equiv")
    except BaseException:
        staged.drop()
        raise
    return staged.send(non_blocking)


def send_staged(batch, staged: "Staged", non_blocking: bool = True) -> TensorBatch:
    """``to_torch`` of a batch gathered into ``staged``: its block moved with
    one copy; a field that did not land in the block (``obs``/``next_obs``
    when they were not one pair gather) travels in a second one."""
    torch = staged.torch
    data = batch.data
    rest = {}
    derived = {}
    for key in data:
        if key in staged.views:
            if data[key] is not staged.views[key]:
                rest[key] = data[key]
    if ".pair" in staged.views:
        base = pair_base(data["obs"], data["next_obs"])
        if base is not None and base.ctypes.data == staged.views[".pair"].ctypes.data:
            derived = {"obs": (".pair", "first"), "next_obs": (".pair", "last")}
        else:
            rest["obs"], rest["next_obs"] = data["obs"], data["next_obs"]
    out = staged.send(non_blocking)
    if ".pair" not in derived.get("obs", ("",)):
        out.pop(".pair", None)
    if rest:
        out.update(_to_cuda(torch, rest, staged.dev, non_blocking))
    out = _derive(torch, out, derived)
    ordered = {key: out[key] for key in data}
    for key in ("weights", "indices", "generations"):
        ordered[key] = out[key]
    return TensorBatch(ordered, _host_of(batch))


def mark_ready(tensors: TensorBatch) -> TensorBatch:
    """In a sampler's thread: record, on its current stream, the event after
    the work that makes ``tensors`` (for ``handover`` in the learner's thread)."""
    t = tensors.get("indices")
    if t is not None and t.device.type == "cuda":
        torch = _torch()
        stream = torch.cuda.current_stream(t.device)
        event = torch.cuda.Event()
        event.record(stream)
        tensors.host["ready"] = (event, stream)
    return tensors


def handover(tensors: TensorBatch) -> TensorBatch:
    """In the learner's thread, as it takes a batch from a sampler: where its
    current stream is not the one the batch was made on, that stream waits for
    the batch (no host wait) and the tensors are marked used on it (the caching
    allocator then keeps their memory until its work is done)."""
    ready = tensors.host.pop("ready", None)
    if ready is None:
        return tensors
    event, made_on = ready
    torch = _torch()
    here = torch.cuda.current_stream(made_on.device)
    if here != made_on:
        here.wait_event(event)
        for t in tensors.values():
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                t.record_stream(here)
    return tensors


def as_array(x, what: str) -> np.ndarray:
    """User input ``x`` (numpy, torch, nested lists) as a numpy array;
    ``InvalidTypeError`` naming ``what`` where numpy cannot make one (a
    ragged list, an object whose ``__array__`` fails), not numpy's own error."""
    try:
        return np.asarray(as_numpy(x))
    except (ValueError, TypeError, OverflowError, NotImplementedError, RuntimeError) as e:  # (a meta tensor: no data)
        raise InvalidTypeError(f"{what} is not an array of numbers ({type(e).__name__}: {str(e)[:120]})") from None


def is_device_tensor(x) -> bool:
    """Whether ``x`` is a torch tensor whose memory is not the host's (reading
    it would wait for the device)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor) and x.device.type not in ("cpu", "meta")


def as_numpy(x):
    """``x`` as numpy when it is a torch tensor (any device, any grad), else ``x`` unchanged.

    A CPU tensor without grad is shared, not copied; a CUDA tensor is copied
    to the host (which waits for the kernels that produce it). Dtypes numpy
    lacks (bfloat16, float8) become float32.
    """
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(x, torch.Tensor):
        return x
    t = x.detach()
    try:  # the common case (a CPU tensor, numpy's dtypes, no conj/neg bit) in one call
        return t.numpy()
    except (TypeError, RuntimeError):
        pass
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.resolve_conj().resolve_neg()
    try:
        return t.numpy()
    except TypeError:
        return t.to(torch.float32 if t.is_floating_point() else torch.int64).numpy()

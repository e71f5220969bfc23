"""Torch conversion, imported only when asked for.

``batch_to_torch`` turns a ``Batch`` into tensors; ``as_numpy`` turns what a
learner hands back (a tensor on any device, with or without grad) into numpy.

CPU: a field whose array is C-contiguous, writable and in native byte order
is shared with ``torch.from_numpy`` (no copy); any other array is copied once,
into a host array reused from earlier calls once no tensor holds it any more
(``_reuse.ReusedArrays``).

CUDA: each field is copied once into a pinned host buffer, and from there to
the device with ``non_blocking``. Pinned buffers are kept between calls (pinning
is slow) in a small pool per (device, field, shape, dtype). Each buffer carries
the CUDA event recorded after its last host-to-device copy; a buffer is filled
again only once its event has completed, so the host never overwrites bytes a
copy still in flight is reading::

    call t    fill pinned[0] -> copy to GPU (stream) -> record event[0]
    call t+1  event[0] busy? take pinned[1] (or wait on the oldest once the pool is full)
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict, deque

import numpy as np

from ._reuse import ReusedArrays
from .errors import InvalidTypeError

# Pinned buffers a field keeps at most; beyond it the oldest one's event is waited on.
POOL_DEPTH = 3
# Distinct (device, field, shape, dtype) keys kept; the least recently used pool goes first.
# Dropping a pool while its copy is in flight is safe: torch's pinned-memory allocator
# does not reuse a block until the copies recorded on it are done.
MAX_KEYS = 64


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("Batch.to_torch needs PyTorch: pip install 'bigper[torch]'") from e
    return torch


class _Slot:
    __slots__ = ("host", "view", "event")

    def __init__(self, host):
        self.host = host            # pinned torch tensor
        self.view = host.numpy()    # numpy view of the same pinned memory
        self.event = None           # CUDA event recorded after the last copy out of host


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
        return _Slot(_torch().empty(shape, dtype=torch_dtype).pin_memory())

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


def _host_array(arr: np.ndarray) -> np.ndarray:
    """``arr`` as an array torch can share: C-contiguous, writable, native byte
    order. A copy (one) only where ``arr`` is not already that."""
    arr = np.asarray(arr)
    if not arr.dtype.isnative:
        return arr.astype(arr.dtype.newbyteorder("="), order="C")
    if arr.flags.c_contiguous and arr.flags.writeable:
        return arr
    out = _HOST.take(arr.shape, arr.dtype)
    np.copyto(out, arr)
    return out


def _fields(batch) -> dict:
    arrays = dict(batch.data)
    arrays["weights"] = np.asarray(batch.weights).astype(np.float32, copy=False)
    arrays["indices"] = np.asarray(batch.indices).astype(np.int64, copy=False)
    # With the indices, update_priorities(tensors, td) skips slots overwritten since sampling.
    arrays["generations"] = np.asarray(batch.generations).astype(np.int64, copy=False)
    if getattr(batch, "mask", None) is not None:  # sequences: which steps are real
        arrays["mask"] = batch.mask
    return arrays


def _torch_dtype(torch, dtype: np.dtype, key: str):
    try:
        return torch.from_numpy(np.empty(0, dtype=dtype.newbyteorder("="))).dtype
    except TypeError:
        raise InvalidTypeError(f"field {key!r} has dtype {dtype}, which torch cannot hold") from None


def batch_to_torch(batch, device=None, non_blocking: bool = True) -> dict:
    """Tensors keyed like ``batch``, plus ``weights`` (float32), ``indices`` and
    ``generations`` (int64); the dict can be passed to ``update_priorities``.

    Parameters
    ----------
    batch : Batch
    device : str or torch.device, optional
        Default the CPU.
    non_blocking : bool
        With a CUDA device, return before the copies finish (they are ordered
        on the current stream, so kernels launched on it after this call see
        the data).

    Returns
    -------
    dict[str, torch.Tensor]
        Every data field with its own dtype (uint8 frames stay uint8, bool
        flags stay bool), shape ``(B, ...)``, on ``device``.
    """
    torch = _torch()
    dev = torch.device("cpu") if device is None else torch.device(device)
    arrays = _fields(batch)
    if dev.type == "cpu":
        return {key: _from_numpy(torch, key, arr) for key, arr in arrays.items()}
    if dev.type == "cuda":
        return _to_cuda(torch, arrays, dev, non_blocking)
    # Other accelerators: torch handles pinning (or not) itself.
    return {key: _from_numpy(torch, key, arr).to(dev, non_blocking=non_blocking)
            for key, arr in arrays.items()}


def _from_numpy(torch, key: str, arr: np.ndarray):
    try:
        return torch.from_numpy(_host_array(arr))
    except TypeError:
        raise InvalidTypeError(f"field {key!r} has dtype {np.asarray(arr).dtype}, which torch cannot hold") from None


def _to_cuda(torch, arrays: dict, dev, non_blocking: bool) -> dict:
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    out = {}
    with torch.cuda.device(dev):
        stream = torch.cuda.current_stream(dev)
        for key, arr in arrays.items():
            arr = np.asarray(arr)
            tdt = _torch_dtype(torch, arr.dtype, key)
            pkey = (dev.index, key, arr.shape, arr.dtype.newbyteorder("=").str)
            slot = _POOL.acquire(pkey, arr.shape, tdt)
            issued = False
            try:
                np.copyto(slot.view, arr, casting="no" if arr.dtype.isnative else "equiv")
                issued = True
                out[key] = slot.host.to(dev, non_blocking=non_blocking)
                event = torch.cuda.Event()
                event.record(stream)
            except BaseException:
                if issued:  # a copy may be in flight without its event: let it finish first
                    stream.synchronize()
                _POOL.release(pkey, slot, None)
                raise
            _POOL.release(pkey, slot, event)
    return out


def as_array(x, what: str) -> np.ndarray:
    """User input ``x`` (numpy, torch, nested lists) as a numpy array;
    ``InvalidTypeError`` naming ``what`` where numpy cannot make one (a
    ragged list, an object whose ``__array__`` fails), not numpy's own error."""
    try:
        return np.asarray(as_numpy(x))
    except (ValueError, TypeError, OverflowError) as e:
        raise InvalidTypeError(f"{what} is not an array of numbers ({type(e).__name__}: {str(e)[:120]})") from None


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
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.resolve_conj().resolve_neg()
    try:
        return t.numpy()
    except TypeError:
        return t.to(torch.float32 if t.is_floating_point() else torch.int64).numpy()
